"""The twin's advice, computed: calibrate on the finished trials, predict every candidate (core/guidance.py's types).

`advise(deployment, candidates, history)` is what `TwinGuided` (core) reads, computed off the
reconcile path:

1. Calibrate (`twin.fit`) on every load step of the measured trials; none yet: the catalog's twin.
2. Rank every candidate on the calibrated twin: the fast path (`twin.steady`) finds each one's SLO
   capacity (or its throughput at the fixed load) by bisection, the whole grid in well under a second;
   the best few are then confirmed on the event simulation (`predict`), within `budget_s`.
3. Check each trial that was launched on a prediction: its first step ran at the predicted capacity,
   so the prediction and the measurement are at the same load (`core.guidance.agreement`).

A setting the calibrated memory model says cannot start, or that would run out of memory at its first
full-budget step (the runtime-OOM rule), is not ranked.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from batchtune.core.guidance import Agreement, Predicted, TwinAdvice, advice_basis, agreement, measured
from batchtune.core.objective import Objective
from batchtune.core.outcomes import HistoryEntry
from batchtune.core.settings import Setting
from batchtune.core.slo import SloTargets
from batchtune.core.vocabulary import M, Reason, TrialState, Verdict
from batchtune.twin.config import ServeConfig
from batchtune.twin.fit import Calibration, Observation, calibrate, simulate
from batchtune.twin.memory import StartupFailure, plan_memory
from batchtune.twin.params import NOMINAL, TwinParams
from batchtune.twin.steady import ServingModel, Shape, Steady, capacity

SEARCH_BUDGET_S = 30.0
"""Wall time one advice may take (fast path over the grid, then the event simulation of the best)."""
SIMULATED_FINALISTS = 4
"""How many of the fast path's best the event simulation confirms (the best of each gmu/mbt column first)."""
RESOLUTION = 0.03
"""The event simulation's capacity search stops within this fraction."""
OVERLOADED_MARGIN = -0.5
"""A step this far past its SLO is an overload: its latencies are the queue's, only its throughput is fitted."""
SUPPORTED = (Objective.SLO_CAPACITY, Objective.OUTPUT_THROUGHPUT)


@dataclass(frozen=True)
class Deployment:
    """What the guide knows of the deployment being tuned."""

    base: ServeConfig
    """Production's setting (model, GPU, parallelism, quantization, limits); candidates replace its knobs."""
    shape: Shape
    slo: SloTargets
    objective: Objective
    open_loop: bool
    """Loads are requests per minute (Poisson); else concurrent requests."""
    window_s: float
    """The measured window of a load step."""
    fixed_load: int | None = None
    """A non-capacity objective's load (the protocol's unit)."""
    generic: bool = False
    """The model or GPU is missing from the catalog: only a generic step model fitted on trials can predict."""

    def config(self, setting: Setting) -> ServeConfig:
        return self.base.replace(
            max_num_seqs=setting.max_num_seqs, gpu_memory_utilization=setting.gpu_memory_utilization_percent / 100,
            **({"max_num_batched_tokens": setting.max_num_batched_tokens} if setting.max_num_batched_tokens else {}))

    def limits(self) -> dict[str, float]:
        """Bench-key latency limits (the SLO percentile, headroom applied)."""
        p = self.slo.percentile
        names: dict[str, str] = {M.TTFT_MS: f"p{p}_ttft_ms", M.ITL_MS: f"p{p}_itl_ms", M.E2E_MS: f"p{p}_e2el_ms"}
        return {names[k]: self.slo.limit(t) for k, t in self.slo.latency_targets().items()}

    def load_value(self, load: int) -> float:
        """A protocol load as the twin's: requests/s on an open loop, concurrency on a closed one."""
        return load / 60.0 if self.open_loop else float(load)

    def protocol_load(self, value: float) -> int:
        return max(1, int(math.floor(value * 60))) if self.open_loop else max(1, int(math.floor(value)))


# ---- status metrics <-> bench keys ---------------------------------------------------------------


def bench_names(percentile: int) -> dict[str, str]:
    """Status metric key -> `vllm bench serve` key at the SLO percentile, for every figure a twin predicts (a
    prediction in status keeps these and the ones the report compares: `vocabulary.PREDICTED_METRICS`)."""
    p = f"p{percentile}"
    return {M.TTFT_MS: f"{p}_ttft_ms", M.ITL_MS: f"{p}_itl_ms", M.E2E_MS: f"{p}_e2el_ms",
            M.TTFT_MEAN_MS: "mean_ttft_ms", M.ITL_MEAN_MS: "mean_itl_ms",
            M.REQUEST_THROUGHPUT: "request_throughput", M.OUTPUT_THROUGHPUT: "output_throughput",
            M.RUNNING_REQUESTS: "mean_running_requests"}


def bench_metrics(metrics: Mapping[str, float], percentile: int) -> dict[str, float]:
    """Status metric keys (a step's) as `vllm bench serve` keys at the SLO percentile."""
    return {bench: float(metrics[status]) for status, bench in bench_names(percentile).items()
            if isinstance(metrics.get(status), (int, float)) and math.isfinite(float(metrics[status]))}


def status_metrics(bench: Mapping[str, float], percentile: int) -> dict[str, float]:
    """The inverse: predicted bench keys as the status metric keys a trial would carry."""
    return {status: round(float(bench[key]), 4) for status, key in bench_names(percentile).items()
            if key in bench and math.isfinite(float(bench[key]))}


def observations(deployment: Deployment, history: Sequence[HistoryEntry]) -> list[Observation]:
    """Every load step of the measured trials as an observation for the fit."""
    out = []
    for setting, outcome in measured(history):
        try:
            cfg = deployment.config(setting)
        except ValueError:
            continue
        for n, step in enumerate(outcome.steps):
            metrics = bench_metrics(step.metrics, deployment.slo.percentile)
            if step.margin is not None and step.margin < OVERLOADED_MARGIN and step.verdict is Verdict.VIOLATED:
                metrics = {k: v for k, v in metrics.items() if k.endswith("throughput")}
            if not metrics:
                continue
            load = deployment.load_value(step.load)
            pool = step.metrics.get(M.KV_POOL_TOKENS)
            out.append(Observation(
                cfg, deployment.shape, metrics, concurrency=None if deployment.open_loop else load,
                rate=load if deployment.open_loop else None, window_s=deployment.window_s,
                kv_pool_tokens=int(pool) if pool and math.isfinite(pool) and pool >= 1 else None,
                source=f"{setting.label()} step {n + 1}"))
    return out


# ---- ranking ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Candidate:
    setting: Setting
    cfg: ServeConfig
    model: ServingModel
    fast: float
    fast_load: float | None
    fast_state: Steady | None


def rank(deployment: Deployment, candidates: Sequence[Setting], params: TwinParams = NOMINAL, *,
         budget_s: float = SEARCH_BUDGET_S, finalists: int = SIMULATED_FINALISTS, seed: int = 0) -> list[Predicted]:
    """Every candidate that starts, holds without a runtime OOM and meets its SLO somewhere, best first."""
    started = time.monotonic()
    limits = deployment.limits()
    pool: list[_Candidate] = []
    for setting in candidates:
        try:
            cfg = deployment.config(setting)
            memory = plan_memory(cfg, params)
        except (StartupFailure, ValueError):
            continue
        if memory.runtime_oom_tokens is not None:
            continue  # it would die at the first burst of long prompts: no recommendation
        model = ServingModel(cfg, deployment.shape, params, memory)
        value, load, state = _fast_objective(deployment, model, limits)
        pool.append(_Candidate(setting, cfg, model, value, load, state))
    pool = [c for c in pool if c.fast > 0]
    pool.sort(key=lambda c: _order(c.fast, c.setting))
    # The event simulation confirms the best of each column first (memory and budget change what the fast
    # path ranks least well), then the next best overall.
    seen: set[tuple[int, int | None]] = set()
    heads = [c for c in pool if c.setting.column not in seen and not seen.add(c.setting.column)]  # type: ignore[func-returns-value]
    heads = heads[:max(1, finalists - 1)]
    order = heads + [c for c in pool if c not in heads]
    out: dict[Setting, Predicted] = {}
    shared: dict[tuple[int, int | None], Predicted] = {}
    ratios: list[float] = []
    simulated = 0
    for cand in order:
        if simulated >= finalists or time.monotonic() - started > budget_s:
            break
        key = (cand.setting.max_num_seqs, cand.setting.max_num_batched_tokens)
        if key in shared and not cand.model.kv_binds:
            # Where the pool holds every request at full length the run is the same at any gmu.
            out[cand.setting] = replace(shared[key], setting=cand.setting)
            continue
        predicted = _simulated(deployment, cand, params, limits, seed)
        simulated += 1
        out[cand.setting] = predicted
        if not cand.model.kv_binds:
            shared[key] = predicted
        if predicted.objective > 0:
            ratios.append(predicted.objective / cand.fast)
    scale = sorted(ratios)[len(ratios) // 2] if ratios else 1.0
    for cand in pool:
        if cand.setting not in out:
            out[cand.setting] = Predicted(cand.setting, cand.fast * scale, _load(deployment, cand.fast_load),
                                          status_metrics(cand.fast_state.metrics, deployment.slo.percentile)
                                          if cand.fast_state else {}, simulated=False)
    ranked = [p for p in out.values() if p.objective > 0]
    ranked.sort(key=lambda p: _order(p.objective, p.setting))
    return ranked


def _order(objective: float, setting: Setting) -> tuple[float, int, int, int]:
    # Best first; within 0.5 % (the search's own resolution) less memory, then a smaller batch.
    bucket = round(math.log(max(objective, 1e-12)) / math.log1p(0.005))
    return (-bucket, setting.gpu_memory_utilization_percent, setting.max_num_seqs,
            setting.max_num_batched_tokens or 0)


def _passes(state_or_metrics: Steady | Mapping[str, float], limits: Mapping[str, float]) -> bool:
    for key, limit in limits.items():
        value = state_or_metrics.get(key)
        if value is None or not math.isfinite(value) or value > limit:
            return False
    return True


def _fast_objective(deployment: Deployment, model: ServingModel, limits: Mapping[str, float]) -> tuple[
        float, float | None, Steady | None]:
    if deployment.objective is Objective.OUTPUT_THROUGHPUT:
        load = deployment.load_value(deployment.fixed_load or model.cfg.max_num_seqs)
        state = model.at(rate=load) if deployment.open_loop else model.at(concurrency=load)
        ok = state.stable and _passes(state, limits)
        return (state["output_throughput"] if ok else 0.0), load, state
    if deployment.open_loop:
        # no rate beyond what the whole batch could decode is worth bisecting over
        ceiling = max(0.05, 4 * model.max_batch / max(1e-3, model.at(concurrency=model.max_batch)["mean_step_ms"]
                                                      / 1000 * model.o))
        value, found = capacity(model, lambda s: s.stable and _passes(s, limits), closed=False, highest=ceiling)
        return value, (value if found else None), found
    highest = float(max(2, 2 * model.cfg.max_num_seqs))  # the protocol's closed-loop ceiling
    value, found = capacity(model, lambda s: _passes(s, limits), closed=True, highest=highest)
    return (found["request_throughput"] if found else 0.0), (value if found else None), found


def _simulated(deployment: Deployment, cand: _Candidate, params: TwinParams, limits: Mapping[str, float],
               seed: int) -> Predicted:
    """The candidate on the event simulation: its capacity near the fast path's, or its fixed-load throughput."""
    percentile = deployment.slo.percentile

    def run(load: float) -> dict[str, float]:
        obs = Observation(cand.cfg, deployment.shape, {}, concurrency=None if deployment.open_loop else load,
                          rate=load if deployment.open_loop else None, window_s=deployment.window_s)
        return simulate(obs, params, seed)

    if deployment.objective is Objective.OUTPUT_THROUGHPUT:
        load = deployment.load_value(deployment.fixed_load or cand.cfg.max_num_seqs)
        metrics = run(load)
        ok = bool(metrics) and _passes(metrics, limits)
        return Predicted(cand.setting, metrics.get("output_throughput", 0.0) if ok else 0.0,
                         deployment.protocol_load(load), status_metrics(metrics, percentile), simulated=True)
    closed = not deployment.open_loop
    start = cand.fast_load or 1.0
    ceiling = float(max(2, 2 * cand.cfg.max_num_seqs)) if closed else math.inf

    def clamp(load: float) -> float:
        return max(1.0, min(ceiling, float(round(load)))) if closed else load

    low: tuple[float, dict[str, float]] | None = None
    high: float | None = None
    load = clamp(start)
    for _ in range(6):
        metrics = run(load)
        if metrics and _passes(metrics, limits):
            low = (load, metrics)
            if load >= ceiling:
                break
            nxt = clamp(load * 1.1 if high is None else math.sqrt(load * high))
        else:
            high = load
            nxt = clamp(load * 0.9 if low is None else math.sqrt(low[0] * load))
        if low is not None and high is not None and (high / low[0] - 1 <= RESOLUTION or (closed and high - low[0] <= 1)):
            break
        if nxt == load or (closed and low is not None and nxt <= low[0]) or nxt < (1.0 if closed else 1e-3):
            break
        load = nxt
    if low is None:
        return Predicted(cand.setting, 0.0, None, {}, simulated=True)
    value, metrics = low
    objective = value if deployment.open_loop else metrics.get("request_throughput", 0.0)
    return Predicted(cand.setting, objective, deployment.protocol_load(value), status_metrics(metrics, percentile),
                     simulated=True)


def _load(deployment: Deployment, value: float | None) -> int | None:
    return None if value is None else deployment.protocol_load(value)


# ---- memory failures ---------------------------------------------------------------------------------

RUNTIME_OOM = (Reason.OUT_OF_MEMORY.value, Reason.OOM_KILLED.value, Reason.BURST_OUT_OF_MEMORY.value)


def learn_failures(deployment: Deployment, params: TwinParams, history: Sequence[HistoryEntry]) -> tuple[
        TwinParams, list[str]]:
    """The memory model moved just enough that every setting that failed for memory is predicted to fail.

    Out of memory under load: the runtime headroom a step needs beyond the gmu budget is more than the
    twin's rule says (raise its fixed part). The KV pool too small at startup: more memory sits outside
    the pool (raise the offset). Settings measured alive keep their measured pool."""
    lessons: list[str] = []
    for setting, outcome in history:
        if outcome.state is not TrialState.INFEASIBLE or outcome.steps:
            continue
        try:
            cfg = deployment.config(setting)
        except ValueError:
            continue
        if outcome.reason in RUNTIME_OOM:
            raised = _raised(cfg, params, "runtime_fixed_gib", _runtime_oom)
            if raised is not None and raised.runtime_fixed_gib > params.runtime_fixed_gib:
                lessons.append(f"{setting.label()} ran out of memory under load: runtime headroom "
                               f"{raised.runtime_fixed_gib:.2f} GiB beyond the activation peak")
                params = raised
        elif outcome.reason == Reason.KV_CACHE_TOO_SMALL.value:
            raised = _raised(cfg, params, "memory_offset_gib", _fails_to_start)
            if raised is not None and raised.memory_offset_gib > params.memory_offset_gib:
                lessons.append(f"{setting.label()} could not hold a request: memory outside the KV pool "
                               f"{raised.memory_offset_gib:+.2f} GiB")
                params = raised
    return params, lessons


def _runtime_oom(cfg: ServeConfig, params: TwinParams) -> bool:
    try:
        return plan_memory(cfg, params).runtime_oom_tokens is not None
    except StartupFailure:
        return True


def _fails_to_start(cfg: ServeConfig, params: TwinParams) -> bool:
    try:
        plan_memory(cfg, params)
    except StartupFailure:
        return True
    return False


def _raised(cfg: ServeConfig, params: TwinParams, name: str, fails: Callable[[ServeConfig, TwinParams], bool],
            ceiling: float = 40.0) -> TwinParams | None:
    """`params` with `name` raised just enough (to 0.01 GiB) that `fails(cfg, ...)`; None when 40 GiB do not."""
    start = float(getattr(params, name))

    def at(value: float) -> TwinParams:
        return params.replace(**{name: round(value, 3)})

    if fails(cfg, at(start)):
        return at(start)
    lo, hi = start, start + 0.25
    while not fails(cfg, at(hi)):
        lo, hi = hi, start + (hi - start) * 2
        if hi - start > ceiling:
            return None
    while hi - lo > 0.01:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if fails(cfg, at(mid)) else (mid, hi)
    return at(hi)


# ---- the advice ------------------------------------------------------------------------------------


def advise(deployment: Deployment, candidates: Sequence[Setting], history: Sequence[HistoryEntry],
           launched: Mapping[Setting, Predicted] | None = None, *, budget_s: float = SEARCH_BUDGET_S,
           seed: int = 0) -> tuple[TwinAdvice, Calibration | None]:
    """The advice for this history, and the calibration behind it (None: the catalog's twin, nothing measured).

    `launched`: what was predicted for each trial when it was started, to check against its first step."""
    started = time.monotonic()
    basis = advice_basis(history)
    if deployment.objective not in SUPPORTED:
        return TwinAdvice(basis, available=False,
                          reason=f"the twin does not predict the {deployment.objective.value} objective"), None
    found = observations(deployment, history)
    calibration: Calibration | None = None
    params = NOMINAL
    notes: list[str] = []
    if found:
        try:
            calibration = calibrate(found, generic=deployment.generic, seed=seed, limits=deployment.limits())
        except ValueError as exc:
            return TwinAdvice(basis, available=False, reason=f"calibration failed: {exc}"), None
        params = calibration.params
        notes.extend(calibration.notes)
    if deployment.generic and calibration is None:
        return TwinAdvice(basis, available=False,
                          reason="the model or GPU is not in the twin's catalog and nothing is measured yet"), None
    learned, lessons = learn_failures(deployment, params, history)
    if lessons:
        notes.extend(lessons)
        params = learned
        if calibration is not None:
            calibration = replace(calibration, params=params)
    remaining = max(1.0, budget_s - (time.monotonic() - started))
    ranked = rank(deployment, candidates, params, budget_s=remaining, seed=seed)
    agreements: dict[Setting, Agreement] = {}
    for setting, outcome in measured(history):
        prediction = (launched or {}).get(setting)
        if prediction is None or prediction.capacity_load is None or not outcome.steps:
            continue
        # The step at the predicted load; of two there (a short bracketing one, then the full window), the later.
        target = prediction.capacity_load
        _, step = min(enumerate(outcome.steps), key=lambda pair: (abs(pair[1].load - target), -pair[0]))
        limits = {k: deployment.slo.limit(t) for k, t in deployment.slo.latency_targets().items()}
        agreements[setting] = agreement(prediction.metrics, step.metrics, limits)
    trusted = calibration.trusted if calibration is not None else True
    reason = calibration.reason if calibration is not None else "the catalog's twin (nothing measured yet)"
    return TwinAdvice(
        basis=basis, available=True, trusted=trusted, reason=reason[:500],
        calibration_setting=ranked[0].setting if ranked and calibration is None else None,
        ranked=tuple(ranked), agreements=agreements, seconds=round(time.monotonic() - started, 2),
        notes=tuple(notes)), calibration
