"""The twin's fast path: a setting's steady state at one load, from queueing arithmetic over the engine's
own step-time model and memory plan, in about a tenth of a millisecond instead of a simulation.

Per step, in steady state at throughput X (requests/s) and mean step time tau:
    decode tokens   d = X (O - 1) tau            (each decoding request gets one token per step)
    prompt tokens   p = X I tau                  (token conservation; chunked by the budget left, T - d)
    tau             = mean of the decode-only and the prompt-carrying step times (the same `step_time`)
Closed loop (C users): C = X (response path + ingest + admission + life), life = (prefill steps + O - 1) tau
(a client sends its next request once the last token reached it); past the
batch (max-num-seqs, or what the KV pool holds) the rest wait in a FIFO queue. Open loop (rate L):
X = L, the running batch follows from Little's law; waits for a batch slot (M/D/c, Erlang C with
the Allen-Cunneen correction), for the token budget (M/D/1 on prompt tokens) and for the API
server (M/D/1) make the TTFT tail; the ITL distribution is the mixture of decode-only and
prompt-carrying steps. An arrival rate the engine cannot serve is `stable=False`.

It is an approximation of `predict` (the event simulation), checked against it in
tests/unit/test_twin_steady.py, used where thousands of evaluations are needed: fitting a
deployment's parameters and ranking a whole candidate grid (`batchtune.twin.guide`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from batchtune.twin.config import ServeConfig
from batchtune.twin.memory import MemoryPlan, cudagraph_capture_sizes, plan_memory, weight_bytes
from batchtune.twin.perf import StepCost, StepCostModel, nominal_params

if TYPE_CHECKING:
    from batchtune.twin.params import TwinParams

PERCENTILES = (50, 90, 95, 99)
_ITERATIONS = 40
COHORT_STEPS = 1.0
"""How many full budget steps a closed-loop cohort's prompts add to a request's TTFT, at most."""


@dataclass(frozen=True, slots=True)
class Shape:
    """The request mix: mean prompt and output tokens and how they are spread (as `predict.Workload`)."""

    input_len: float
    output_len: float
    length_dist: str = "fixed"
    range_ratio: float = 0.5
    output_dist: str | None = None
    output_range_ratio: float | None = None
    """The output's own range ratio for `uniform` (None: `range_ratio`, as vLLM's single --random-range-ratio)."""

    def __post_init__(self) -> None:
        if not (self.input_len >= 1 and self.output_len >= 1):
            raise ValueError(f"input_len and output_len must be >= 1, got {self.input_len}, {self.output_len}")

    @property
    def output_ratio(self) -> float:
        return self.range_ratio if self.output_range_ratio is None else self.output_range_ratio

    def output_quantile(self, u: float) -> float:
        dist = self.output_dist or self.length_dist
        o = self.output_len
        if dist == "uniform":
            return o * (1 - self.output_ratio + 2 * self.output_ratio * u)
        if dist == "exponential":
            return -o * math.log(max(1e-9, 1 - u))
        return o

    @property
    def output_cv2(self) -> float:
        """Squared coefficient of variation of the output length (how variable a request's life is)."""
        dist = self.output_dist or self.length_dist
        if dist == "uniform":
            return self.output_ratio ** 2 / 3
        if dist == "exponential":
            return 1.0
        return 0.0


@dataclass(frozen=True)
class Steady:
    """A steady state: `vllm bench serve` keys (ms for latencies) and the engine's gauges."""

    metrics: dict[str, float]
    stable: bool
    """False when the load exceeds what the setting can serve (its queue grows without bound)."""

    def __getitem__(self, key: str) -> float:
        return self.metrics[key]

    def get(self, key: str, default: float = math.nan) -> float:
        return self.metrics.get(key, default)


class ServingModel:
    """One setting on one deployment, precomputed so that `at(load)` is a handful of float operations.

    Raises `StartupFailure` (vLLM's message) when the setting does not boot, like `Engine`."""

    def __init__(self, cfg: ServeConfig, shape: Shape, params: TwinParams | None = None,
                 memory: MemoryPlan | None = None):
        self.cfg = cfg
        self.shape = shape
        self.params = params = params or nominal_params()
        self.memory = memory or plan_memory(cfg, params)
        sizes = cudagraph_capture_sizes(cfg)
        self.cost: StepCost = params.generic if params.generic is not None else \
            StepCostModel.for_config(cfg, weight_bytes(cfg), max(sizes) if sizes else 0, params)
        i, o = min(shape.input_len, cfg.max_model_len - 1), shape.output_len
        self.i, self.o = i, max(1.0, min(o, cfg.max_model_len - i))
        bs = self.memory.block_size
        # A running request holds its prompt and, on average, half its output; vLLM allocates whole blocks.
        blocks_per_request = math.ceil(i / bs) + self.o / (2 * bs) + 0.5
        self.kv_batch = self.memory.num_gpu_blocks / blocks_per_request
        self.full_blocks = math.ceil((i + self.o) / bs)
        self.max_batch = float(min(cfg.max_num_seqs, self.kv_batch))
        """The largest running batch the setting sustains: max-num-seqs, or what the KV pool holds."""
        self.cohort_batch = float(min(cfg.max_num_seqs, self.memory.num_gpu_blocks // self.full_blocks))
        """The same for a cohort in step: all its requests reach full length together."""
        self.kv_binds = self.memory.num_gpu_blocks < cfg.max_num_seqs * self.full_blocks
        self.budget = float(cfg.max_num_batched_tokens)
        self.ingest_s = params.frontend_per_request_s + params.frontend_per_prompt_token_s * i
        self.path_s = params.response_path_s
        self._prefill_cap = params.max_prefills_per_step

    # ---- one step --------------------------------------------------------------------------
    def _step(self, decode: float, prompt: float, prefills: float) -> float:
        i, ctx = self.i, self.i + self.o / 2
        seqs = decode + prefills
        kv_read = decode * ctx + prompt * (1 + 0.5 * max(0.0, i / max(1.0, self.budget - decode) - 1))
        attn = decode * ctx + prompt * i * 0.5
        # Fractional tokens on purpose: the fit differentiates through this.
        return self.cost.step_time(decode + prompt, seqs, kv_read, attn, prompt)[0]

    def _steps(self, x: float, tau: float, cohort: float = 0.0) -> tuple[float, float, float, float, float, float]:
        """(decode tokens, prompt steps per request, carrying fraction, tokens per carrying step, t_decode,
        t_carrying) at throughput x and mean step time tau. `cohort`: requests that arrive together (a
        closed loop of fixed-length requests stays in step: its prompts come in bursts that fill the budget)."""
        i, o = self.i, self.o
        decode = min(x * (o - 1) * tau, self.max_batch)
        room = max(1.0, self.budget - decode)
        n_prefill = max(1.0, math.ceil(i / room))
        prompt = x * i * tau
        chunks = x * tau * n_prefill  # prompt chunks per step
        if self._prefill_cap:
            room = min(room, self._prefill_cap * i)
        if prompt <= 0:
            carrying = 0.0
        elif cohort:
            carrying = min(1.0, prompt / min(room, cohort * i))
        else:
            carrying = min(1.0, max(1.0 - math.exp(-chunks), prompt / room))
        per_carrying = min(room, prompt / carrying) if carrying > 0 else 0.0
        t_decode = self._step(decode, 0.0, 0.0) if decode >= 0.5 else self._step(1.0, 0.0, 0.0)
        t_carry = self._step(decode, per_carrying, max(1.0, per_carrying / i)) if carrying > 0 else t_decode
        return decode, n_prefill, carrying, per_carrying, t_decode, t_carry

    # ---- a load ----------------------------------------------------------------------------
    def at(self, *, concurrency: float | None = None, rate: float | None = None) -> Steady:
        """The steady state at a closed-loop concurrency or an open-loop Poisson rate (requests/s)."""
        if (concurrency is None) == (rate is None):
            raise ValueError("give exactly one of concurrency or rate")
        if concurrency is not None:
            return self._closed(float(concurrency))
        assert rate is not None
        return self._open(float(rate))

    def _life(self, x: float, tau: float, cohort: float = 0.0) -> tuple[
            float, tuple[float, float, float, float, float, float]]:
        parts = self._steps(x, tau, cohort)
        _, n_prefill, carrying, _, t_decode, t_carry = parts
        mean = (1 - carrying) * t_decode + carrying * t_carry
        return mean, parts

    def _closed(self, c: float) -> Steady:
        o = self.o
        in_step = self.shape.output_cv2 == 0  # every request ends in the step it would alone: cohorts stay
        batch = max(1.0, self.cohort_batch) if in_step else self.max_batch
        cohort = min(c, batch) if in_step else 0.0

        def throughput(tau: float) -> tuple[float, float, float]:
            """(x, queue wait, admission) at mean step time tau."""
            n_prefill = max(1.0, math.ceil(self.i / max(1.0, self.budget - min(c, batch))))
            life = (n_prefill + o - 1) * tau
            admission = max(tau, self.ingest_s + tau / 2)  # the next step after ingest (smooth for the fit)
            # A client sends its next request once it has the last token: the response path is in its cycle.
            x = c / (self.path_s + admission + life)
            if x * life <= batch:
                return x, 0.0, admission
            x = batch / life  # the batch is full: the rest wait their turn
            return x, max(0.0, c / x - self.path_s - admission - life), admission

        tau, stable = _solve(lambda t: self._life(throughput(t)[0], t, cohort)[0], self._step(min(c, batch), 0, 0))
        x, queue_wait, admission = throughput(tau)
        parts = self._steps(x, tau, cohort)
        waits = _Waits(deterministic=queue_wait + admission)
        if cohort:
            # A cohort's prompts go through the budget one after another, and through the API server too
            # where its requests come faster than it ingests them. The event simulation's cohorts spread
            # out to about one full budget step beyond a request's own (COHORT_STEPS, fitted to it).
            room, t_carry = max(1.0, self.budget - parts[0]), parts[5]
            phase = min(COHORT_STEPS, max(0.0, cohort * self.i / room - parts[1])) * t_carry
            waits.add_uniform(phase)
            waits.add_uniform(max(0.0, cohort * self.ingest_s - phase - parts[1] * t_carry))
        return self._metrics(x, tau, parts, waits, running=x * (parts[1] + o - 1) * tau, waiting=x * queue_wait,
                             stable=stable)

    def _open(self, rate: float) -> Steady:
        o = self.o
        tau, stable = _solve(lambda t: self._life(rate, t)[0], self._step(1.0, 0.0, 0.0))
        parts = self._steps(rate, tau)
        decode, n_prefill, carrying, per_carrying, t_decode, t_carry = parts
        life = (n_prefill + o - 1) * tau
        running = rate * life
        # Waits: a batch slot (M/D/c; a request waits only while the batch is full, when steps are their
        # slowest), the prompt steps (M/D/1 on their GPU time), the API server (M/D/1).
        full_life = (n_prefill + o - 1) * max(tau, self._step(self.max_batch, 0.0, 0.0))
        slots = _erlang_wait(rate, full_life, self.max_batch, self.shape.output_cv2)
        room = max(1.0, self.budget - decode)
        budget_util = rate * self.i / room * t_carry
        budget_service = self.i / room * t_carry
        frontend_util = rate * self.ingest_s
        stable = stable and slots is not None and budget_util < 1 and frontend_util < 1
        waits = _Waits(deterministic=self.ingest_s)
        # An arrival waits out the step under way: arrivals land in long steps more often (size-biased).
        residual = ((1 - carrying) * t_decode ** 2 + carrying * t_carry ** 2) / (2 * tau)
        waits.add_uniform(2 * residual)
        if slots is not None:
            waits.add_queue(*slots)
        if budget_util < 1:
            waits.add_queue(budget_util, _md1_mean(budget_util, budget_service))
        if frontend_util < 1:
            waits.add_queue(frontend_util, _md1_mean(frontend_util, self.ingest_s))
        waiting = rate * waits.mean_queue()
        return self._metrics(rate, tau, parts, waits, running=min(running, self.max_batch), waiting=waiting,
                             stable=stable)

    # ---- figures ---------------------------------------------------------------------------
    def _metrics(self, x: float, tau: float, parts: tuple[float, float, float, float, float, float],
                 waits: _Waits, *, running: float, waiting: float, stable: bool) -> Steady:
        i, o, path = self.i, self.o, self.path_s
        decode, n_prefill, carrying, per_carrying, t_decode, t_carry = parts
        # A request's own prompt steps are carrying steps (size-biased: it rides in a fuller one).
        prefill_time = n_prefill * t_carry if carrying > 0 else n_prefill * t_decode
        decode_mean = tau
        out: dict[str, float] = {
            "request_throughput": x,
            "output_throughput": x * o,
            "total_token_throughput": x * (o + i),
            "mean_running_requests": running,
            "mean_waiting_requests": waiting,
            "kv_cache_usage_pct": min(100.0, 100.0 * running * (i / self.memory.block_size + o / (2 * self.memory.block_size))
                                      / max(1, self.memory.num_gpu_blocks)),
            "preemptions_per_s": 0.0,
            "mean_step_ms": tau * 1000,
        }
        ttft_base = path + prefill_time
        out["mean_ttft_ms"] = (ttft_base + waits.mean()) * 1000
        for q in PERCENTILES:
            out[f"p{q}_ttft_ms"] = (ttft_base + waits.quantile(q / 100)) * 1000
        out["median_ttft_ms"] = out["p50_ttft_ms"]
        out["mean_itl_ms"] = out["mean_tpot_ms"] = decode_mean * 1000
        for q in PERCENTILES:
            u = q / 100
            out[f"p{q}_itl_ms"] = (t_decode if u <= 1 - carrying else t_carry) * 1000
            out[f"p{q}_tpot_ms"] = decode_mean * 1000
        out["median_itl_ms"] = out["p50_itl_ms"]
        out["median_tpot_ms"] = out["p50_tpot_ms"]
        out["mean_e2el_ms"] = out["mean_ttft_ms"] + (o - 1) * decode_mean * 1000
        for q in PERCENTILES:
            u = q / 100
            decode_u = max(0.0, self.shape.output_quantile(u) - 1) * decode_mean
            # a request's wait and its length are independent: combine their spreads, not their tails
            spread = math.hypot(waits.quantile(u) - waits.mean(), decode_u - (o - 1) * decode_mean)
            out[f"p{q}_e2el_ms"] = (ttft_base + waits.mean() + (o - 1) * decode_mean + spread) * 1000
        out["median_e2el_ms"] = out["p50_e2el_ms"]
        if not stable:
            for key in list(out):
                if key.endswith("_ms") and ("ttft" in key or "e2el" in key):
                    out[key] = math.inf
        return Steady(out, stable)


class _Waits:
    """A request's waits before its first prompt step: a fixed part, a uniform part (the next step
    boundary) and queues with exponential tails; quantiles of the sum by combining spreads."""

    def __init__(self, deterministic: float = 0.0):
        self.fixed = deterministic
        self.uniforms: list[float] = []  # widths of waits uniform on [0, width]
        self.queues: list[tuple[float, float]] = []  # (P(wait > 0), mean wait)

    def add_uniform(self, width: float) -> None:
        if width > 0:
            self.uniforms.append(width)

    def add_queue(self, p_wait: float, mean: float) -> None:
        if mean > 0 and p_wait > 0:
            self.queues.append((min(1.0, p_wait), mean))

    def mean_queue(self) -> float:
        return sum(mean for _, mean in self.queues)

    def mean(self) -> float:
        return self.fixed + sum(self.uniforms) / 2 + self.mean_queue()

    def quantile(self, u: float) -> float:
        deviations = [width * (u - 0.5) for width in self.uniforms]
        for p_wait, mean in self.queues:
            conditional = mean / p_wait  # exponential wait given that there is one
            q = conditional * math.log(p_wait / (1 - u)) if p_wait > 1 - u else 0.0
            deviations.append(q - mean)
        spread = math.copysign(math.sqrt(sum(d * d for d in deviations)), sum(deviations))
        return max(self.fixed, self.mean() + spread)


def _solve(mean_step: Callable[[float], float], low: float) -> tuple[float, bool]:
    """The mean step time tau with mean_step(tau) == tau (steps carry the prompts that arrive while they
    run, so longer steps carry more); (a large tau, False) when there is none: the work outgrows the GPU."""
    lo = max(low, 1e-7)
    if mean_step(lo) <= lo:
        return lo, True
    hi = lo * 2
    while mean_step(hi) > hi:
        if hi > lo * 1e5 or hi > 3600:
            return hi, False
        hi *= 2
    for _ in range(_ITERATIONS):
        mid = math.sqrt(lo * hi)
        if mean_step(mid) > mid:
            lo = mid
        else:
            hi = mid
        if hi / lo < 1 + 1e-4:
            break
    return hi, True


def _md1_mean(utilization: float, service_s: float) -> float:
    """Mean wait in an M/D/1 queue."""
    return utilization * service_s / (2 * (1 - utilization))


def _erlang_wait(rate: float, service_s: float, servers: float, cv2: float) -> tuple[float, float] | None:
    """(P(wait), mean wait) for Poisson arrivals at `servers` parallel slots (Erlang C, Allen-Cunneen for
    service-time variability `cv2`); None when the slots cannot keep up."""
    c = max(1, int(servers))
    a = rate * service_s
    if a >= c:
        return None
    if a <= 0:
        return (0.0, 0.0)
    b = 1.0
    for k in range(1, c + 1):  # Erlang B by recursion, then C
        b = a * b / (k + a * b)
    p_wait = c * b / (c - a * (1 - b))
    mean = p_wait * service_s / (c - a) * (1 + cv2) / 2
    return (p_wait, mean)


def capacity(model: ServingModel, passes: Callable[[Steady], bool], *, closed: bool, highest: float,
             resolution: float = 0.01) -> tuple[float, Steady | None]:
    """The highest load (concurrency, or requests/s) at which `passes` holds, by bisection; (0, None) when
    even the lowest fails. Closed loops search integer concurrencies up to `highest`."""
    def at(load: float) -> Steady:
        return model.at(concurrency=load) if closed else model.at(rate=load)

    low = 1.0 if closed else max(1e-3, highest * 1e-4)
    first = at(low)
    if not passes(first):
        return 0.0, None
    best, best_state = low, first
    top = at(highest)
    if passes(top):
        return highest, top
    hi = highest
    while True:
        if closed:
            if hi - best <= 1:
                break
            mid = float(math.floor(math.sqrt(best * hi)) if hi / best > 2 else (best + hi) // 2)
            mid = min(max(mid, best + 1), hi - 1)
        else:
            if hi / best - 1 <= resolution:
                break
            mid = math.sqrt(best * hi)
        state = at(mid)
        if passes(state):
            best, best_state = mid, state
        else:
            hi = mid
    return best, best_state

