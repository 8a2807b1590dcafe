"""TwinGuided in the operator: the calibrated twin's advice for the current history, computed off the reconcile path.

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

from batchtune.api import Setting, TrialPrediction, TrialRecord, TwinPredictionRecord, TwinRecord
from batchtune.api.models import camel
from batchtune.controller.tick import Target, Tick
from batchtune.core.guidance import KEPT_PREDICTIONS, Agreement, Predicted, TwinAdvice, measured, truncated
from batchtune.core.objective import Objective
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
    from batchtune.controller.trials import protocol_config
    from batchtune.twin.guide import Deployment
    from batchtune.twin.prefilter import baseline_config
    from batchtune.twin.steady import Shape

    assert tick.spec is not None
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
    load, workload = tick.spec.load, tick.status.workload
    shape = Shape(float(workload.input_tokens if workload and workload.input_tokens else load.input_tokens),
                  float(workload.output_tokens if workload and workload.output_tokens else load.output_tokens))
    config = protocol_config(tick.spec, workload)
    if config.trace:
        return None, "the twin does not replay traces (spec.load.traceConfigMapRef): loads are percent of its speed"
    return Deployment(base, shape, config.slo, config.objective, config.open_loop,
                      float(tick.spec.trial.measure_seconds), config.fixed_load, generic), why


def launched(trials: Sequence[TrialRecord]) -> dict[Any, Predicted]:
    """What was predicted for each trial when it was started."""
    out = {}
    for trial in trials:
        p = trial.prediction
        if p is not None:
            out[trial.setting.core()] = Predicted(trial.setting.core(), p.objective, p.capacity_load,
                                                  dict(p.metrics or {}), p.simulated)
    return out


def from_status(record: TwinRecord, trials: Sequence[TrialRecord]) -> TwinAdvice:
    """The advice as status holds it (what every tick asks the strategy with)."""
    agreements = {t.setting.core(): Agreement(bool(t.prediction.agrees), t.prediction.comparison or "")
                  for t in trials if t.prediction is not None and t.prediction.agrees is not None}
    ranked = tuple(Predicted(p.setting.core(), p.objective, p.capacity_load, dict(p.metrics or {}), p.simulated)
                   for p in record.predictions)
    return TwinAdvice(basis=record.basis, available=record.available, trusted=record.verdict != "Untrusted",
                      reason=record.reason or "", calibration_setting=record.calibration_setting.core()
                      if record.calibration_setting else None, ranked=ranked, agreements=agreements)


def advice(tick: Tick, target: Target, the_search: Search, done: list[HistoryEntry]) -> TwinAdvice | None:
    """The advice for this history from status, or once the worker has it; None while it is being computed."""
    from batchtune.core.guidance import advice_basis

    history = done  # the trials: what the prefilter learned is the catalog's own memory model, nothing to fit
    basis = advice_basis(history)
    record = tick.status.twin
    if record is not None and record.basis == basis:
        return from_status(record, tick.status.trials)
    prior = launched(tick.status.trials)
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
    return from_status(tick.status.twin, tick.status.trials)


def record_advice(tick: Tick, fresh: TwinAdvice, calibration: Calibration | None,
                  history: Sequence[HistoryEntry], the_search: Search) -> None:
    """The advice into status: the ranking and verdict, and each launched trial's agreement."""
    verdict = "Unavailable" if not fresh.available else (
        calibration.verdict if calibration is not None else "Nominal")
    parameters: dict[str, float] = {}
    worst = None
    if calibration is not None:
        for key, value in calibration.params.as_dict().items():
            if isinstance(value, dict):
                parameters.update({camel(f"{key}_{k}"): float(v) for k, v in value.items()})
            elif isinstance(value, (int, float)):
                parameters[camel(key)] = float(value)
        if calibration.worst is not None and calibration.worst.error != float("inf"):
            worst = round(100 * calibration.worst.error, 1)
    for trial in tick.status.trials:
        found = fresh.agreements.get(trial.setting.core())
        if trial.prediction is not None and found is not None:
            trial.prediction.agrees = found.agrees
            trial.prediction.comparison = found.worst[:500]
    previous = tick.status.twin.mode if tick.status.twin else None
    tick.status.twin = TwinRecord(
        basis=fresh.basis, available=fresh.available, verdict=verdict, reason=fresh.reason[:1000],
        calibration_setting=Setting.of(fresh.calibration_setting) if fresh.calibration_setting else None,
        parameters=parameters, observations=sum(len(o.steps) for _, o in measured(history)),
        worst_residual_percent=worst, ranked=len(fresh.ranked),
        predictions=[TwinPredictionRecord(setting=Setting.of(p.setting), objective=max(0.0, p.objective),
                                          capacity_load=p.capacity_load, metrics=dict(p.metrics),
                                          simulated=p.simulated) for p in fresh.ranked[:2 * KEPT_PREDICTIONS]],
        search_seconds=fresh.seconds, notes=[n[:300] for n in fresh.notes][:10])
    strategy = TwinGuided(the_search.strategy.plan, tick.slo(), Objective(tick.spec.objective.type) if tick.spec
                          else Objective.SLO_CAPACITY, advice=from_status(tick.status.twin, tick.status.trials))
    mode, why = strategy.mode(list(history))
    tick.status.twin.mode = mode
    if mode == "measure" and previous not in (None, "measure"):
        tick.event(True, Reason.TWIN_DISTRUSTED, f"TwinGuided falls back to measuring (Adaptive): {why}"[:1000])
    tick.log.info("Recorded the twin's advice for %s: %s, %s (%d candidates ranked)", tick.tuning.name, verdict,
                  mode, len(fresh.ranked))


def prediction(advice_: TwinAdvice, setting: Any) -> TrialPrediction | None:
    """The record a trial launched on the advice carries (none while the calibration is Untrusted)."""
    found = advice_.launch_prediction(setting)
    if found is None:
        return None
    return TrialPrediction(objective=max(0.0, found.objective), capacity_load=found.capacity_load,
                           metrics=dict(found.metrics), simulated=found.simulated)


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
