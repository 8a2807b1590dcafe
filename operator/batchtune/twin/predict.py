"""`predict`: a discrete-event simulation of a load test against the twin engine, on a virtual clock.

Closed loop (`concurrency`: each finished request is replaced at once, as `vllm bench serve
--max-concurrency C --request-rate inf`) or open loop (Poisson `request_rate`, seeded). The engine
advances step by step (no per-token events); inter-token gaps of requests that decoded in
consecutive steps are counted per step, so a step costs O(running) pure-Python work.

Metrics use `vllm bench serve` key names and are measured over a window of `duration_s` after a
warm-up (or, with `num_prompts`, over the whole bench run as `vllm bench serve` does).
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict, deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, cast

import numpy as np

from batchtune.twin.config import ServeConfig
from batchtune.twin.engine import SimEngine, _Request
from batchtune.twin.memory import MemoryPlan, RuntimeOutOfMemory, StartupFailure

if TYPE_CHECKING:
    from batchtune.twin.params import TwinParams

LengthDist = Literal["fixed", "uniform", "exponential"]
PERCENTILES = (50, 90, 95, 99)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass(frozen=True, slots=True)
class Workload:
    input_len: int
    output_len: int
    concurrency: int | None = None
    """Closed-loop client concurrency (`--max-concurrency`)."""
    request_rate: float | None = None
    """Poisson arrivals per second (`--request-rate`); `inf` sends everything at t=0 (needs num_prompts)."""
    length_dist: LengthDist = "fixed"
    range_ratio: float = 0.5
    """For `uniform`: lengths drawn from [L(1-r), L(1+r)] (vllm's --random-range-ratio)."""
    output_dist: LengthDist | None = None
    """Distribution of output lengths when it differs from `length_dist` (e.g. EOS without --ignore-eos)."""
    output_range_ratio: float | None = None
    """The output's own range ratio for `uniform` (None: `range_ratio`; vLLM's --random-range-ratio
    '{"input": r1, "output": r2}')."""
    num_prompts: int | None = None
    """Bench mode: send exactly this many requests and measure the whole run (no warm-up)."""
    warmup_s: float | None = None
    """Excluded start of the run; None = automatic (one full turnover of the concurrency, or 10%)."""

    def __post_init__(self) -> None:
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError(f"input_len and output_len must be >= 1, got {self.input_len}, {self.output_len}")
        if (self.concurrency is None) == (self.request_rate is None):
            raise ValueError("give exactly one of concurrency or request_rate, "
                             f"got concurrency={self.concurrency}, request_rate={self.request_rate}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.request_rate is not None and not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0, got {self.request_rate}")
        if self.request_rate == math.inf and self.num_prompts is None:
            raise ValueError("request_rate=inf needs num_prompts")
        for name in ("length_dist", "output_dist"):
            value = getattr(self, name)
            if value is not None and value not in ("fixed", "uniform", "exponential"):
                raise ValueError(f"{name} must be fixed, uniform or exponential, got {value!r}")
        for name in ("range_ratio", "output_range_ratio"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < 1:
                raise ValueError(f"{name} must be in [0, 1), got {value}")


@dataclass(frozen=True)
class Prediction:
    config: ServeConfig
    workload: Workload
    metrics: dict[str, Any] = field(default_factory=dict)
    """`vllm bench serve` keys plus GPU signals; empty on a startup failure."""
    startup_error: str | None = None
    """vLLM's own message when the setting does not boot."""
    runtime_error: str | None = None
    """torch's out-of-memory message when the setting boots but fails under load."""
    memory: MemoryPlan | None = None

    @property
    def ok(self) -> bool:
        return self.startup_error is None and self.runtime_error is None

    def __getitem__(self, key: str) -> Any:
        return self.metrics[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.metrics.get(key, default)

    def as_dict(self) -> dict[str, Any]:
        cfg = self.config
        out: dict[str, Any] = {
            "model_id": cfg.model_id, "gpu": cfg.gpu.name, "max_num_seqs": cfg.max_num_seqs,
            "gpu_memory_utilization": cfg.gpu_memory_utilization,
            "max_num_batched_tokens": cfg.max_num_batched_tokens, "max_model_len": cfg.max_model_len,
            "tensor_parallel_size": cfg.tensor_parallel_size,
            "max_concurrency": self.workload.concurrency,
            "request_rate": "inf" if self.workload.request_rate == math.inf else self.workload.request_rate,
            "random_input_len": self.workload.input_len, "random_output_len": self.workload.output_len,
        }
        if self.startup_error is not None:
            out["startup_error"] = self.startup_error
            return out
        if self.runtime_error is not None:
            out["runtime_error"] = self.runtime_error
        if self.memory is not None:
            out["kv_cache_tokens"] = self.memory.kv_cache_tokens
            out["num_gpu_blocks"] = self.memory.num_gpu_blocks
        out.update(self.metrics)
        return out


class _LengthSampler:
    def __init__(self, wl: Workload, rng: random.Random, max_model_len: int):
        self.wl, self.rng, self.limit = wl, rng, max_model_len

    def _draw(self, mean: int, dist: str, ratio: float) -> int:
        if dist == "fixed":
            return mean
        if dist == "uniform":
            lo = max(1, int(mean * (1 - ratio)))
            hi = max(lo, int(mean * (1 + ratio)))
            return self.rng.randint(lo, hi)
        return max(1, int(self.rng.expovariate(1.0 / mean)))

    def __call__(self) -> tuple[int, int]:
        wl = self.wl
        out_ratio = wl.range_ratio if wl.output_range_ratio is None else wl.output_range_ratio
        prompt = min(self._draw(wl.input_len, wl.length_dist, wl.range_ratio), self.limit - 1)
        output = min(self._draw(wl.output_len, wl.output_dist or wl.length_dist, out_ratio), self.limit - prompt)
        return prompt, output


def _summary(name: str, values: Any, out: dict[str, Any]) -> None:
    arr = np.asarray(values, dtype=float)
    if arr.size == 0:
        for key in (f"mean_{name}_ms", f"median_{name}_ms", f"std_{name}_ms",
                    *(f"p{p}_{name}_ms" for p in PERCENTILES)):
            out[key] = None
        return
    ms = arr * 1000.0
    out[f"mean_{name}_ms"] = float(ms.mean())
    out[f"median_{name}_ms"] = float(np.median(ms))
    out[f"std_{name}_ms"] = float(ms.std())
    for p, v in zip(PERCENTILES, np.percentile(ms, PERCENTILES), strict=True):
        out[f"p{p}_{name}_ms"] = float(v)


def predict(cfg: ServeConfig, workload: Workload, duration_s: float, seed: int = 0,
            noise: float = 0.0, params: TwinParams | None = None) -> Prediction:
    """Simulate `workload` against `cfg` and return `vllm bench serve`-style metrics.

    `duration_s` is the measured window (after warm-up); with `workload.num_prompts` it is a cap on
    the simulated run. `noise` (e.g. 0.03) multiplies each metric family by a seeded factor
    1 + noise*N(0,1), standing in for run-to-run measurement noise. `params`: a deployment's own
    figures (`batchtune.twin.params`, e.g. fitted by `batchtune.twin.fit`); None is the catalog's twin.
    """
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    memo = _memo
    if memo is None:
        simulated = _simulate(cfg, workload, duration_s, seed, params)
    else:
        key = memo.key(cfg, workload, duration_s, seed, params)
        found = memo.get(key)
        simulated = found if found is not None else _simulate(cfg, workload, duration_s, seed, params)
        if found is None:
            memo.put(key, simulated)
    # Every caller gets its own metrics (the noise below scales them in place) and its own arguments back.
    metrics = dict(simulated.metrics)
    if noise and simulated.ok:
        _apply_noise(metrics, noise, seed)
    return Prediction(cfg, workload, metrics=metrics, startup_error=simulated.startup_error,
                      runtime_error=simulated.runtime_error, memory=simulated.memory)


def _simulate(cfg: ServeConfig, workload: Workload, duration_s: float, seed: int,
              params: TwinParams | None) -> Prediction:
    """The noise-free simulation behind `predict`."""
    try:
        engine = SimEngine(cfg, seed=seed, params=params)
    except StartupFailure as exc:
        return Prediction(cfg, workload, startup_error=str(exc))
    sim = _Simulation(engine, workload, duration_s, seed)
    try:
        sim.run()
    except RuntimeOutOfMemory as exc:
        return Prediction(cfg, workload, metrics={"completed": sim.completed_total, "failed": sim.in_flight()},
                          runtime_error=str(exc), memory=engine.memory)
    return Prediction(cfg, workload, metrics=sim.metrics(), memory=engine.memory)


def draws_random_numbers(workload: Workload) -> bool:
    """Whether a simulation of `workload` reads its seed: Poisson arrivals (a finite open-loop rate) or drawn
    lengths. A closed loop (or an infinite rate) of fixed lengths is the same run at every seed (`SimEngine`'s own
    generator serves only a jitter `predict` never sets)."""
    poisson = workload.request_rate is not None and workload.request_rate != math.inf
    drawn = workload.length_dist != "fixed" or (workload.output_dist or workload.length_dist) != "fixed"
    return poisson or drawn


class PredictMemo:
    """Noise-free simulations by a key of every argument that changes one (`key`), the least recently used
    dropped past `maxsize`. Installed with `memoised` (none by default: the operator's twin never keeps one)."""

    def __init__(self, maxsize: int = 4096) -> None:
        self.maxsize = maxsize
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[tuple[str, str, str, int | None, str], Prediction] = OrderedDict()

    @staticmethod
    def key(cfg: ServeConfig, workload: Workload, duration_s: float, seed: int,
            params: TwinParams | None) -> tuple[str, str, str, int | None, str]:
        """Every argument of the simulation by its repr (every field, int and float told apart; frozen value
        types throughout); the seed only where the run reads it (`draws_random_numbers`); the noise is not in
        it (applied afterwards)."""
        return (repr(cfg), repr(workload), repr(duration_s), seed if draws_random_numbers(workload) else None,
                repr(params))

    def get(self, key: tuple[str, str, str, int | None, str]) -> Prediction | None:
        found = self._entries.get(key)
        if found is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return found

    def put(self, key: tuple[str, str, str, int | None, str], prediction: Prediction) -> None:
        self._entries[key] = prediction
        if len(self._entries) > self.maxsize:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)


_memo: PredictMemo | None = None


@contextmanager
def memoised(memo: PredictMemo | None = None) -> Iterator[PredictMemo]:
    """Serve repeated identical simulations from `memo` (the one installed already, else a new one) while the
    block runs, as the benchmark does: its judge, its strategies' common random numbers and its twin-guided
    strategies ask for the same run many times."""
    global _memo
    previous = _memo
    installed = memo if memo is not None else previous if previous is not None else PredictMemo()
    _memo = installed
    try:
        yield installed
    finally:
        _memo = previous


def _apply_noise(metrics: dict[str, Any], noise: float, seed: int) -> None:
    rng = random.Random(seed * 7919 + 17)
    families: dict[str, tuple[str, ...]] = {"throughput": ("request_throughput", "output_throughput", "total_token_throughput")}
    for name in LATENCY_METRICS:
        families[name] = tuple(k for k in metrics if k.endswith(f"_{name}_ms"))
    for keys in families.values():
        factor = max(0.05, 1.0 + rng.gauss(0.0, noise))
        for key in keys:
            if metrics.get(key) is not None:
                metrics[key] *= factor


class _Simulation:
    def __init__(self, engine: SimEngine, wl: Workload, duration_s: float, seed: int):
        self.engine = engine
        self.wl = wl
        self.rng = random.Random(seed)
        self.lengths = _LengthSampler(wl, random.Random(seed + 1), engine.cfg.max_model_len)
        self.bench = wl.num_prompts is not None
        self.duration = duration_s
        self.sent = 0
        self.completed_total = 0
        # measurement accumulators
        self.ttft: list[float] = []
        self.tpot: list[float] = []
        self.e2el: list[float] = []
        self.itl_gaps: list[float] = []
        self.itl_step_values: list[float] = []
        self.itl_step_counts: list[int] = []
        self.completed = 0
        self.completed_input = 0
        self.output_tokens = 0
        self.busy = 0.0
        self.sm_active = 0.0
        self.kv_usage = 0.0
        self.power_busy = 0.0
        self.preemptions = 0
        self.max_running = 0
        self.running_time = 0.0
        self.path_s = engine.params.response_path_s
        self.window_start = 0.0
        self.window_end = math.inf

    def in_flight(self) -> int:
        return self.engine.num_running + self.engine.num_waiting

    def _send(self, now: float) -> None:
        prompt, output = self.lengths()
        req = _Request(str(self.sent), prompt, output, now)
        self.sent += 1
        self.engine._add(req)

    def _can_send(self) -> bool:
        num_prompts = self.wl.num_prompts  # None exactly when not in bench mode
        return num_prompts is None or self.sent < num_prompts

    def run(self) -> None:
        eng, wl = self.engine, self.wl
        run = eng._run
        cost = eng._cost
        now = 0.0
        closed = wl.concurrency is not None
        # None only in a closed loop, which draws no arrivals (Workload takes exactly one of the two).
        rate = cast(float, wl.request_rate)
        next_arrival = self._first_arrivals(rate)
        # A closed-loop client sends its next request once the last token reached it (the response path later).
        replacements: deque[float] = deque()
        measuring = self.bench
        warmup = self._warmup(closed)
        turnover = wl.concurrency or 0  # auto warm-up for closed loop: C completions
        window_start = self.window_start
        window_end = self.window_end

        while True:
            next_arrival = self._send_due(now, next_arrival, rate, replacements)
            if not eng.has_work():
                due = min(next_arrival, replacements[0] if replacements else math.inf)
                if due == math.inf:
                    break
                now = due
                continue
            step = run(now)
            if step is None:
                break
            t_end = step.t_end
            if not measuring and t_end > window_start and (warmup is not None):
                measuring = True
            if measuring:
                if t_end > window_end:
                    break
                self._record(step, cost)
            self.completed_total += len(step.finished)
            if closed:
                replacements.extend(t_end + self.path_s for _ in step.finished)
            if warmup is None and self.completed_total >= turnover:
                # closed-loop auto warm-up ends after one full turnover of the client pool
                warmup = t_end
                self.window_start, self.window_end = t_end, t_end + self.duration
                window_start, window_end = self.window_start, self.window_end
            now = t_end
            if self.bench and now >= window_end:
                break
        if self.bench:
            self.window_end = min(now, self.window_end)

    def _first_arrivals(self, rate: float) -> float:
        """Sends what arrives at time 0 (a closed loop's clients, an infinite rate's every prompt); the first
        Poisson arrival after it (inf: none)."""
        wl = self.wl
        if wl.concurrency is not None:
            for _ in range(min(wl.concurrency, wl.num_prompts or wl.concurrency)):
                self._send(0.0)
        elif rate == math.inf:
            for _ in range(cast(int, wl.num_prompts)):  # Workload requires num_prompts with an infinite rate
                self._send(0.0)
        else:
            return self.rng.expovariate(rate)
        return math.inf

    def _warmup(self, closed: bool) -> float | None:
        """The warm-up in seconds, with the measuring window set from it; None: a closed loop's, which ends after
        one turnover of its clients (the window is set then)."""
        warmup = 0.0 if self.bench else self.wl.warmup_s
        if warmup is None and not closed:
            warmup = min(0.1 * self.duration, 10.0)
        if self.bench:
            self.window_end = self.duration
        elif warmup is not None:
            self.window_start, self.window_end = warmup, warmup + self.duration
        return warmup

    def _send_due(self, now: float, next_arrival: float, rate: float, replacements: deque[float]) -> float:
        """Sends the arrivals and closed-loop replacements due by `now`; the next arrival (inf once no more may
        be sent)."""
        while next_arrival <= now and self._can_send():
            self._send(next_arrival)
            next_arrival += self.rng.expovariate(rate)
        while replacements and replacements[0] <= now and self._can_send():
            self._send(replacements.popleft())
        if not self._can_send():
            replacements.clear()
            return math.inf
        return next_arrival

    def _record(self, step: Any, cost: Any) -> None:
        if step.idle:
            return
        d = step.duration
        self.busy += d
        n_running = len(self.engine.running) + len(step.finished)
        if n_running > self.max_running:
            self.max_running = n_running
        self.running_time += n_running * d
        sm, _, _, _, power = cost.signals(d, step.t_gpu, step.nbytes, step.flops)
        self.sm_active += sm * d
        self.power_busy += power * d
        self.kv_usage += self.engine.kv_usage * d
        self.preemptions += step.preempted
        self.output_tokens += len(step.emitted)
        if step.contiguous:
            self.itl_step_values.append(d)
            self.itl_step_counts.append(step.contiguous)
        if step.gaps:
            self.itl_gaps.extend(step.gaps)
        t_end = step.t_end
        for r in step.emitted:
            if r.output == 1:
                self.ttft.append(t_end - r.arrival + self.path_s)
        for r in step.finished:
            self.completed += 1
            self.completed_input += r.prompt
            self.e2el.append(t_end - r.arrival + self.path_s)
            if r.output > 1:
                self.tpot.append((t_end - r.t_first) / (r.output - 1))

    def metrics(self) -> dict[str, Any]:
        span = self.window_end - self.window_start
        if not math.isfinite(span) or span <= 0:
            span = self.duration
        out: dict[str, Any] = {
            "duration": span,
            "completed": self.completed,
            "failed": 0,
            "total_input_tokens": self.completed_input,
            "total_output_tokens": self.output_tokens,
            "request_throughput": self.completed / span,
            "output_throughput": self.output_tokens / span,
            "total_token_throughput": (self.output_tokens + self.completed_input) / span,
            "max_concurrent_requests": self.max_running,
            "mean_running_requests": self.running_time / span,
        }
        _summary("ttft", self.ttft, out)
        _summary("tpot", self.tpot, out)
        itl = np.repeat(np.asarray(self.itl_step_values, dtype=float), np.asarray(self.itl_step_counts, dtype=int))
        if self.itl_gaps:
            itl = np.concatenate([itl, np.asarray(self.itl_gaps, dtype=float)])
        _summary("itl", itl, out)
        _summary("e2el", self.e2el, out)
        busy = min(self.busy, span)
        gpu = self.engine.cfg.gpu
        idle_time = max(0.0, span - self.busy)
        energy = self.power_busy + gpu.idle_w * idle_time
        out.update({
            "gpu_util_pct": 100.0 * busy / span,
            "sm_active_pct": 100.0 * self.sm_active / span,
            "kv_cache_usage_pct": 100.0 * self.kv_usage / span,
            "preemptions_per_s": self.preemptions / span,
            "num_preemptions": self.preemptions,
            "fb_used_mib": self.engine.fb_used_mib,
            "power_w": energy / span,
            "tokens_per_joule": self.output_tokens / energy if energy > 0 else None,
        })
        return out
