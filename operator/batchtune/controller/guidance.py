"""TwinGuided in the operator: when to ask for the twin's advice (off the reconcile path) and its record in status.

A tick with strategy TwinGuided needs the advice for the trials finished so far (`core.guidance.advice_basis`).
If `status.twin` already holds it, the strategy is rebuilt from status alone. Otherwise the tick hands the
calibration and search (`batchtune.twin.guide.advise`, seconds of CPU) to the twin worker (`ports.twin`)
and waits (`TwinSearching`); a later tick finds the result, writes it to status (the ranking, the verdict,
the fitted parameters, and on each trial launched on a prediction whether its first step agreed), and
asks the strategy with the advice as status holds it, so a restarted operator asks the same.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from batchtune.controller import records
from batchtune.controller.tick import Target, Tick
from batchtune.core.guidance import TwinAdvice, advice_basis, measured, truncated
from batchtune.core.outcomes import HistoryEntry
from batchtune.core.search import Search
from batchtune.core.strategies import TwinGuided
from batchtune.core.vocabulary import Reason

if TYPE_CHECKING:
    from batchtune.twin.fit import Calibration
    from batchtune.twin.guide import Deployment

log = logging.getLogger(__name__)
KIND = TwinGuided.kind


def deployment(tick: Tick, target: Target) -> tuple[Deployment | None, str]:
    """What the twin needs to know of production, or None with why there is no twin for it."""
    from batchtune.twin.guide import Deployment
    from batchtune.twin.prefilter import baseline_config
    from batchtune.twin.steady import Shape

    engine = target.engine
    try:
        baseline = engine.read(target.container)
    except Exception as exc:  # noqa: BLE001  # planning refused such args already; say why, do not fail the tick
        return None, str(exc)
    product = tick.status.plan.gpu_product if tick.status.plan else None
    base, generic, why = baseline_config(engine, baseline, product, generic=True)
    if base is None:
        return None, why
    limits = tick.status.plan.engine_limits if tick.status.plan else None
    if limits is not None and limits.max_model_len:
        with contextlib.suppress(ValueError):  # a limit the model does not have: planning said so already
            base = base.replace(max_model_len=limits.max_model_len)
    view = tick.view
    shape = Shape(float(view.input_tokens), float(view.output_tokens))
    config = view.protocol
    if config.trace:
        return None, "the twin does not replay traces (spec.load.traceConfigMapRef): loads are percent of its speed"
    return Deployment(base, shape, config.slo, config.objective, config.open_loop,
                      float(view.spec.trial.measure_seconds), config.fixed_load, generic), why


def advice(tick: Tick, target: Target, the_search: Search, done: list[HistoryEntry]) -> TwinAdvice | None:
    """The advice for this history from status, or once the worker has it; None while it is being computed."""
    history = done  # the trials: what the prefilter learned is the catalog's own memory model, nothing to fit
    basis = advice_basis(history)
    record = tick.status.twin
    if record is not None and record.basis == basis:
        return records.advice_of(record, tick.status.trials)
    prior = records.launched(tick.status.trials)
    found, why = deployment(tick, target)
    if found is None:
        result: tuple[TwinAdvice, Calibration | None] | None = (
            TwinAdvice(basis, available=False, reason=why), None)
    else:
        dep, candidates = found, the_search.candidates

        def compute() -> tuple[TwinAdvice, Calibration | None]:
            from batchtune.twin.guide import advise

            return advise(dep, candidates, history, prior)

        result = tick.ports.twin.advise(f"{tick.tuning.uid}/{tick.tuning.generation}/{basis}", compute)
    if result is None:
        tick.waiting(Reason.TWIN_SEARCHING, f"The twin is calibrating on {len(measured(history))} measured trial(s) "
                                            "and searching every candidate; the next trial waits for it")
        return None
    fresh, calibration = result
    kept = truncated(fresh, [s for s, _ in measured(history)])
    record_advice(tick, kept, calibration, history, the_search)
    assert tick.status.twin is not None
    return records.advice_of(tick.status.twin, tick.status.trials)


def record_advice(tick: Tick, fresh: TwinAdvice, calibration: Calibration | None,
                  history: Sequence[HistoryEntry], the_search: Search) -> None:
    """The advice into status: the ranking and verdict, and each launched trial's agreement."""
    verdict = "Unavailable" if not fresh.available else (
        calibration.verdict if calibration is not None else "Nominal")
    params = calibration.params.as_dict() if calibration is not None else None
    worst = calibration.worst.error if calibration is not None and calibration.worst is not None else None
    records.write_agreements(tick.status.trials, fresh)
    previous = tick.status.twin.mode if tick.status.twin else None
    tick.status.twin = records.twin_record(fresh, verdict, params, worst, history)
    strategy = TwinGuided(the_search.strategy.plan, tick.view.slo, tick.view.objective,
                          advice=records.advice_of(tick.status.twin, tick.status.trials))
    mode, why = strategy.mode(list(history))
    tick.status.twin.mode = mode
    if mode == "measure" and previous not in (None, "measure"):
        tick.event(True, Reason.TWIN_DISTRUSTED, f"TwinGuided falls back to measuring (Adaptive): {why}"[:1000])
    tick.log.info("Recorded the twin's advice for %s: %s, %s (%d candidates ranked)", tick.tuning.name, verdict,
                  mode, len(fresh.ranked))


class TwinWorker:
    """`ports.Twin` for the operator: one background thread; per tuning only the newest request is kept."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._queue: OrderedDict[str, tuple[str, Callable[[], Any]]] = OrderedDict()
        self._results: OrderedDict[str, Any] = OrderedDict()
        self._running: str | None = None
        self._thread: threading.Thread | None = None

    def advise(self, key: str, compute: Callable[[], Any]) -> Any | None:
        tuning = key.split("/", 1)[0]
        with self._lock:
            if key in self._results:
                return self._results[key]
            if self._running != key:
                self._queue[tuning] = (key, compute)
                self._queue.move_to_end(tuning)
                if self._thread is None or not self._thread.is_alive():
                    self._thread = threading.Thread(target=self._work, name="batchtune-twin", daemon=True)
                    self._thread.start()
                self._lock.notify()
        return None

    def _work(self) -> None:
        while True:
            with self._lock:
                while not self._queue:
                    self._lock.wait()
                _, (key, compute) = self._queue.popitem(last=False)
                self._running = key
            try:
                result = compute()
            except Exception as exc:  # noqa: BLE001  # an advice that fails is an unavailable twin, not a dead worker
                from batchtune.core.guidance import TwinAdvice as Advice

                log.warning("The twin's advice for %s failed: %s", key, exc)
                result = (Advice(key.rsplit("/", 1)[-1], available=False, reason=f"the twin failed: {exc}"[:500]),
                          None)
            with self._lock:
                self._results[key] = result
                while len(self._results) > 64:
                    self._results.popitem(last=False)
                self._running = None

    def drain(self, timeout_s: float = 120) -> bool:
        """Wait until nothing is queued or running (tests); False on timeout."""
        import time

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if not self._queue and self._running is None:
                    return True
            time.sleep(0.05)
        return False
