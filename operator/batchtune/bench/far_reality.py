"""The far ground truth (`--truth far`): a hidden reality further from the twin than `bench.reality`'s.

The perturbed truth re-draws the twin's own parameters, so a calibrated twin can match it parameter by
parameter: six of its hidden figures are the ones `twin.fit` fits by name, and TwinGuided's accuracy there is an
upper bound. This truth is the same engine (vLLM V1's scheduler, the twin's memory plan) with a step time, a
scheduler and an API server the twin has no parameters for, in three parts:

1. **Another parameterisation** (always on): the figures are drawn as a different model of the same step, so no
   `TwinParams` reproduces them and a fit can only approximate them.

| hidden figure | range | why plausible |
|---|---|---|
| weight-streaming bandwidth | 0.70-0.92 of the datasheet | vllm-gpu-facts R14 (eta_bw 0.7-0.9; R3 0.77, R4 ~0.9) |
| KV-cache read bandwidth (paged attention) | 0.55-0.95 of the weights' | scattered 16-token blocks stream worse than dense weights; the twin reads both at one bandwidth |
| compute efficiency at large batches | 0.55-0.85 of dense peak | R14 (eta_f 0.6-0.8; Vidur's A100 Llama-3-8B MLP GEMMs 75-80 % at 32k tokens) |
| ... rising with the step's tokens | eta(T) = eta_max T / (T + T_half), T_half 8-64 | GEMMs with few rows under-fill the tensor cores (tile quantization); the twin's efficiency is one constant |
| overlap of memory, compute and the kernel floor | p-norm, p 1.5-3.0 | the twin's p = 2; how well kernels overlap loads and math depends on the kernels |
| kernel floor per layer | 8-16 kernels x 3-6 us (24-96 us) | the twin's 60 us (~12 small kernels of ~5 us), as a count and a latency |
| CPU time per step | 0.2-1.5 ms | R14 (t_ovh 0.5-3 ms, less with CUDA graphs); the twin's 0.6 ms |
| ... per layer in an eager step | 15-60 us per layer, above the largest CUDA graph | an eager step launches a dozen kernels per layer from Python; the twin only raises its GPU floor |
| ... per step carrying prompt tokens | 0.05-0.8 ms | building a prefill's positions, slot mapping and sampling metadata; R14: scheduling took 29 % of the time before v0.6.0's fixes |
| CPU time per scheduled sequence | 5-30 us | the twin's 12 us, x0.4-2.5 |
| memory outside the KV pool | 0-1.2 GiB + the CUDA-graph pool x0.6-2.5 | the graph pool grows with the capture sizes, so with max-num-seqs (vllm-gpu-facts 2.1: "more graphs ... more graph memory"); the twin's fitted offset is one number for every setting |
| activation peak; runtime-OOM margin | x0.9-1.4; 0.35-0.8 of it + 0.1-0.4 GiB | as the perturbed truth |
| API-server ingest | 1.5-4 ms per request + a tokenizer at 35-100 k tokens/s | the twin's 2 ms + 16 us per token (62.5 k tokens/s; R11) |
| response path | 8-30 ms | the twin's 15 ms |

2. **Structures** the twin has no parameter for, 1-3 per scenario and truth seed (`STRUCTURES`):

| structure | range | why plausible |
|---|---|---|
| `kv_superlinear`: KV-read time grows as kv^(1+g) above a threshold | g 0.08-0.25 above 16-128 k tokens read per step | paged attention splits long contexts into partitions with a reduction pass, and a batch's scattered blocks outgrow the L2 and TLB reach; R14: KV reads push decode further memory-bound |
| `watermark`: admission keeps a share of the KV blocks free | 1-5 % of the blocks | vLLM V0's block manager (`watermark_blocks = int(watermark * num_gpu_blocks)`, default 0.01, read through the code index) admitted a prompt only above it; V1 has none |
| `admit_cap`: at most k new requests admitted per step | k 1, 2 or 4 | schedulers that bound a step's new prefills (V0's `max_num_partial_prefills`, SGLang's conservative admission); the perturbed truth caps prefilling requests, this caps admissions |
| `frontend_contention`: API-server time per request grows with the requests in flight | x(1 + in flight / N), N 64-512 | the API server is one Python process that also detokenizes and streams every running request's output; R14: the HTTP server took 33 % of the time in the v0.6.0 profile |
| `periodic_stall`: every n-th engine step stalls | n 16-256 steps, 5-40 ms | a Python GC pass or a detokenizer/scheduler hiccup in the engine loop (SGLang warns that GC causes latency jitter; vLLM freezes its GC heap after warm-up, which later allocations outgrow; read through the code index) |

3. **What the strategies see**: nothing of it. The structures live in this module's `FarEngine` and `FarStepCost`,
which only `FarTruth` builds; the strategies, their memory prefilter and TwinGuided's guide keep the nominal twin
(`runner.default_strategies`). This module is apart from `reality.py` on purpose: the oracle cache's key hashes
that file's source, and the perturbed truth's cached results stay valid; `bench.cache` hashes this one's for a
far truth's key.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from batchtune.bench.reality import TRUTH_SEED
from batchtune.bench.testbed import derive_seed
from batchtune.bench.twin_truth import PROMPT_RUN_CAP_S, TwinTruth
from batchtune.bench.types import Knobs, Load, Reading, StartResult
from batchtune.twin.catalog import GIB, MIB
from batchtune.twin.engine import SimEngine
from batchtune.twin.memory import CUDAGRAPH_MIB_PER_SIZE_LAYER, StartupFailure, cudagraph_capture_sizes, plan_memory
from batchtune.twin.params import TwinParams
from batchtune.twin.perf import StepCostModel

if TYPE_CHECKING:
    from batchtune.bench.scenarios import Scenario
    from batchtune.twin.config import ServeConfig
    from batchtune.twin.engine import _Batch, _Request
    from batchtune.twin.predict import Prediction, Workload

STRUCTURES = ("kv_superlinear", "watermark", "admit_cap", "frontend_contention", "periodic_stall")
"""The structural differences a far reality draws 1-3 of."""


@dataclass(frozen=True)
class FarReality:
    """One scenario's far reality: the step, scheduler and API server the truth simulates (see the module's tables)."""

    weight_bw_efficiency: float
    kv_bw_ratio: float
    """KV-cache reads' bandwidth relative to the weights'."""
    compute_efficiency: float
    compute_half_tokens: float
    overlap_p: float
    kernels_per_layer: int
    kernel_latency_s: float
    step_fixed_s: float
    eager_launch_per_layer_s: float
    prefill_step_s: float
    seq_s: float
    memory_fixed_gib: float
    cudagraph_memory_scale: float
    activation_scale: float
    runtime_fragment_fraction: float
    runtime_fixed_gib: float
    frontend_request_s: float
    tokenizer_tokens_per_s: float
    response_path_s: float
    structures: tuple[str, ...] = ()
    # The structures' figures (their neutral values where a structure is not drawn).
    kv_superlinear_exponent: float = 0.0
    kv_superlinear_from_tokens: int = 0
    watermark: float = 0.0
    admit_per_step: int | None = None
    frontend_half_in_flight: float | None = None
    stall_every_steps: int | None = None
    stall_s: float = 0.0

    def without(self, structure: str) -> FarReality:
        """The same reality less one structure (its neutral figures): what the tests compare against."""
        neutral: dict[str, dict[str, Any]] = {
            "kv_superlinear": {"kv_superlinear_exponent": 0.0, "kv_superlinear_from_tokens": 0},
            "watermark": {"watermark": 0.0},
            "admit_cap": {"admit_per_step": None},
            "frontend_contention": {"frontend_half_in_flight": None},
            "periodic_stall": {"stall_every_steps": None, "stall_s": 0.0},
        }
        return dataclasses.replace(self, structures=tuple(s for s in self.structures if s != structure),
                                   **neutral[structure])

    def engine_params(self, cfg: ServeConfig) -> TwinParams:
        """The twin's own figures this reality shares with it at one setting: memory and the API server. The memory
        outside the pool depends on the setting (the CUDA-graph pool's share scales with the capture sizes); the step
        figures stay the catalog's, since `FarStepCost` replaces the twin's step time."""
        sizes = len(cudagraph_capture_sizes(cfg))
        graphs_gib = sizes * cfg.model.num_layers * CUDAGRAPH_MIB_PER_SIZE_LAYER * MIB / GIB
        return TwinParams(
            memory_offset_gib=self.memory_fixed_gib + (self.cudagraph_memory_scale - 1.0) * graphs_gib,
            activation_scale=self.activation_scale,
            runtime_fragment_fraction=self.runtime_fragment_fraction,
            runtime_fixed_gib=self.runtime_fixed_gib,
            frontend_per_request_s=self.frontend_request_s,
            frontend_per_prompt_token_s=1.0 / self.tokenizer_tokens_per_s,
            response_path_s=self.response_path_s,
        )

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def far_reality(scenario: Scenario, seed: int = TRUTH_SEED) -> FarReality:
    """The scenario's far reality (deterministic in the scenario's name and the seed)."""
    return _far(scenario.name, seed)


@lru_cache(maxsize=256)
def _far(name: str, seed: int) -> FarReality:
    return draw(name, seed)


def draw(name: str, seed: int) -> FarReality:
    """A far reality drawn afresh (the uncached `far_reality`)."""
    rng = random.Random(derive_seed("far-reality", seed, name))

    def log_uniform(lo: float, hi: float) -> float:
        return float(lo * (hi / lo) ** rng.random())

    base = FarReality(
        weight_bw_efficiency=rng.uniform(0.70, 0.92),
        kv_bw_ratio=rng.uniform(0.55, 0.95),
        compute_efficiency=rng.uniform(0.55, 0.85),
        compute_half_tokens=log_uniform(8.0, 64.0),
        overlap_p=rng.uniform(1.5, 3.0),
        kernels_per_layer=rng.randint(8, 16),
        kernel_latency_s=rng.uniform(3e-6, 6e-6),
        step_fixed_s=log_uniform(0.2e-3, 1.5e-3),
        eager_launch_per_layer_s=rng.uniform(15e-6, 60e-6),
        prefill_step_s=log_uniform(0.05e-3, 0.8e-3),
        seq_s=log_uniform(5e-6, 30e-6),
        memory_fixed_gib=rng.uniform(0.0, 1.2),
        cudagraph_memory_scale=rng.uniform(0.6, 2.5),
        activation_scale=rng.uniform(0.9, 1.4),
        runtime_fragment_fraction=rng.uniform(0.35, 0.8),
        runtime_fixed_gib=rng.uniform(0.1, 0.4),
        frontend_request_s=rng.uniform(1.5e-3, 4e-3),
        tokenizer_tokens_per_s=log_uniform(35e3, 100e3),
        response_path_s=rng.uniform(8e-3, 30e-3),
    )
    structures = tuple(sorted(rng.sample(STRUCTURES, k=rng.choice((1, 2, 3)))))
    drawn: dict[str, Any] = {"structures": structures}
    # Every structure's figures are drawn whether or not it is chosen, so adding one to `STRUCTURES` later moves
    # no other figure of a reality.
    figures: dict[str, dict[str, Any]] = {
        "kv_superlinear": {"kv_superlinear_exponent": rng.uniform(0.08, 0.25),
                           "kv_superlinear_from_tokens": int(log_uniform(16_384, 131_072))},
        "watermark": {"watermark": rng.uniform(0.01, 0.05)},
        "admit_cap": {"admit_per_step": rng.choice((1, 2, 4))},
        "frontend_contention": {"frontend_half_in_flight": log_uniform(64.0, 512.0)},
        "periodic_stall": {"stall_every_steps": int(log_uniform(16, 256)), "stall_s": log_uniform(5e-3, 40e-3)},
    }
    for name_ in structures:
        drawn.update(figures[name_])
    return dataclasses.replace(base, **drawn)


class FarStepCost:
    """The far reality's step time (a `twin.perf.StepCost`): the twin's geometry (bytes and FLOPs per token, peaks,
    tensor-parallel terms) under this reality's efficiencies, overlap, overheads and structures. Stateful: it counts
    the engine's steps for the periodic stall, so each engine has its own."""

    __slots__ = ("base", "weight_bw", "kv_bw", "flops_per_s", "half_tokens", "p", "floor_s", "eager_cpu_s", "fixed_s",
                 "seq_s", "prefill_step_s", "kv_exponent", "kv_from", "stall_every", "stall_s", "steps")

    def __init__(self, base: StepCostModel, reality: FarReality, num_layers: int) -> None:
        r = reality
        self.base = base
        self.weight_bw = base.peak_bytes_per_s * r.weight_bw_efficiency
        self.kv_bw = self.weight_bw * r.kv_bw_ratio
        self.flops_per_s = base.peak_flops_per_s * r.compute_efficiency
        self.half_tokens = r.compute_half_tokens
        self.p = r.overlap_p
        self.floor_s = num_layers * r.kernels_per_layer * r.kernel_latency_s
        self.eager_cpu_s = num_layers * r.eager_launch_per_layer_s
        self.fixed_s = r.step_fixed_s
        self.seq_s = r.seq_s
        self.prefill_step_s = r.prefill_step_s
        self.kv_exponent = r.kv_superlinear_exponent
        self.kv_from = r.kv_superlinear_from_tokens
        self.stall_every = r.stall_every_steps or 0
        self.stall_s = r.stall_s
        self.steps = 0

    def step_time(self, num_tokens: float, num_seqs: float, kv_tokens_read: float, attn_qk: float,
                  prompt_tokens: float = 0) -> tuple[float, float, float, float]:
        """(duration_s, gpu_busy_s, bytes moved, flops) of one step."""
        b = self.base
        kv_bytes = kv_tokens_read * b.kv_bytes_per_token
        t_kv = kv_bytes / self.kv_bw
        if self.kv_exponent and kv_tokens_read > self.kv_from:
            t_kv *= (kv_tokens_read / self.kv_from) ** self.kv_exponent
        t_mem = b.weight_bytes / self.weight_bw + t_kv
        flops = b.flops_per_token * num_tokens + b.lm_head_flops_per_seq * num_seqs + b.attn_flops_per_qk * attn_qk
        t_cmp = flops / self.flops_per_s * (1.0 + self.half_tokens / max(num_tokens, 1.0))
        p = self.p
        t_gpu = (t_mem ** p + t_cmp ** p + self.floor_s ** p) ** (1.0 / p)
        if b.tp_fixed_s:
            t_gpu += b.tp_fixed_s + num_tokens * b.tp_bytes_per_token / b.interconnect_bytes_per_s
        duration = t_gpu + self.fixed_s + self.seq_s * num_seqs
        if num_tokens > b.max_graph_tokens:
            duration += self.eager_cpu_s
        if prompt_tokens:
            duration += self.prefill_step_s
        if self.stall_every:
            self.steps += 1
            if self.steps % self.stall_every == 0:
                duration += self.stall_s
        return duration, t_gpu, b.weight_bytes + kv_bytes, flops

    def signals(self, duration: float, t_gpu: float, nbytes: float, flops: float) -> tuple[
            float, float, float, float, float]:
        return self.base.signals(duration, t_gpu, nbytes, flops)


class FarEngine(SimEngine):
    """The twin's engine with the far reality's step time, scheduler (watermark, admission cap) and API server
    (contention). Only `FarTruth` builds one."""

    def __init__(self, cfg: ServeConfig, reality: FarReality, seed: int = 0) -> None:
        super().__init__(cfg, seed=seed, params=reality.engine_params(cfg))
        assert isinstance(self._cost, StepCostModel)  # engine_params has no generic step model
        self._cost = FarStepCost(self._cost, reality, cfg.model.num_layers)
        self.reality = reality
        self._watermark_blocks = int(reality.watermark * self.memory.num_gpu_blocks)

    def _add(self, req: _Request) -> None:
        half = self.reality.frontend_half_in_flight
        if half is None:
            super()._add(req)
            return
        per_request, per_token = self._frontend_per_request, self._frontend_per_token
        factor = 1.0 + (len(self.running) + len(self.waiting)) / half
        self._frontend_per_request, self._frontend_per_token = per_request * factor, per_token * factor
        try:
            super()._add(req)
        finally:
            self._frontend_per_request, self._frontend_per_token = per_request, per_token

    def _admit_waiting(self, batch: _Batch, now: float) -> None:
        """The twin's admission with the watermark's blocks held back and at most `admit_per_step` new requests."""
        held = min(self._watermark_blocks, batch.free)
        max_seqs = self._max_seqs
        cap = self.reality.admit_per_step
        if cap is not None:
            self._max_seqs = min(max_seqs, len(self.running) + cap)
        batch.free -= held
        try:
            super()._admit_waiting(batch, now)
        finally:
            batch.free += held
            self._max_seqs = max_seqs


def simulate(cfg: ServeConfig, workload: Workload, duration_s: float, seed: int, noise: float,
             reality: FarReality) -> Prediction:
    """`twin.predict.predict` on a `FarEngine`: served from the simulation memo the bench installs, noise applied
    to the caller's own copy of the metrics."""
    from batchtune.twin import predict as twin_predict

    memo = twin_predict._memo
    key = (repr(cfg), repr(workload), repr(duration_s), seed if twin_predict.draws_random_numbers(workload) else None,
           "far|" + repr(reality))
    found = memo.get(key) if memo is not None else None
    simulated = found if found is not None else _simulate(cfg, workload, duration_s, seed, reality)
    if memo is not None and found is None:
        memo.put(key, simulated)
    metrics = dict(simulated.metrics)
    if noise and simulated.ok:
        twin_predict._apply_noise(metrics, noise, seed)
    return dataclasses.replace(simulated, metrics=metrics)


def _simulate(cfg: ServeConfig, workload: Workload, duration_s: float, seed: int, reality: FarReality) -> Prediction:
    """`twin.predict._simulate` on a `FarEngine`. Written again rather than shared: sharing it would take an engine
    hook in `twin/predict.py`, whose source is in every truth's cache key, and so would drop the perturbed truth's
    cached results for no change of theirs."""
    from batchtune.twin.memory import RuntimeOutOfMemory
    from batchtune.twin.predict import Prediction, _Simulation

    try:
        engine = FarEngine(cfg, reality, seed=seed)
    except StartupFailure as exc:
        return Prediction(cfg, workload, startup_error=str(exc))
    run = _Simulation(engine, workload, duration_s, seed)
    try:
        run.run()
    except RuntimeOutOfMemory as exc:
        return Prediction(cfg, workload, metrics={"completed": run.completed_total, "failed": run.in_flight()},
                          runtime_error=str(exc), memory=engine.memory)
    return Prediction(cfg, workload, metrics=run.metrics(), memory=engine.memory)


@dataclass(frozen=True)
class _Pinned(TwinTruth):
    """The twin's memory rules at one setting's figures (the far reality's memory depends on the setting)."""

    fixed: TwinParams = TwinParams()

    def params(self, scenario: Scenario) -> TwinParams:
        return self.fixed


@dataclass(frozen=True)
class FarTruth(TwinTruth):
    """Each scenario's far reality (`far_reality`): what `--truth far` judges against."""

    truth_seed: int = TRUTH_SEED

    def reality(self, scenario: Scenario) -> FarReality:
        return far_reality(scenario, self.truth_seed)

    def params(self, scenario: Scenario) -> TwinParams:
        raise TypeError("a far reality's figures depend on the setting: use setting_params(scenario, knobs)")

    def setting_params(self, scenario: Scenario, knobs: Knobs) -> TwinParams:
        return self.reality(scenario).engine_params(self.config(scenario, knobs))

    def describe(self, scenario: Scenario) -> str:
        return f"far (seed {self.truth_seed}): {self.reality(scenario).as_dict()}"

    def _pinned(self, scenario: Scenario, knobs: Knobs) -> TwinTruth:
        return _Pinned(self.pod_overhead_s, self.setting_params(scenario, knobs))

    def startup(self, scenario: Scenario, knobs: Knobs) -> StartResult:
        return self._pinned(scenario, knobs).startup(scenario, knobs)

    def fits(self, scenario: Scenario, knobs: Knobs) -> tuple[bool | None, str]:
        return self._pinned(scenario, knobs).fits(scenario, knobs)

    def burst_failure(self, scenario: Scenario, knobs: Knobs) -> str | None:
        return self._pinned(scenario, knobs).burst_failure(scenario, knobs)

    def kv_never_binds(self, scenario: Scenario, knobs: Knobs) -> bool:
        """As the twin's, less the watermark's blocks (admission cannot use them, so a pool that just holds
        max-num-seqs full requests may still bind)."""
        if not self._pinned(scenario, knobs).kv_never_binds(scenario, knobs):
            return False
        reality = self.reality(scenario)
        if not reality.watermark:
            return True
        plan = plan_memory(self.config(scenario, knobs), self.setting_params(scenario, knobs))
        blocks_per_request = math.ceil((scenario.input_len + scenario.output_len) / plan.block_size)
        held = int(reality.watermark * plan.num_gpu_blocks)
        return plan.num_gpu_blocks - held > knobs.max_num_seqs * blocks_per_request

    def measure(
        self, scenario: Scenario, knobs: Knobs, load: Load, *, duration_s: float, seed: int, noise: float,
        prompts: int | None = None, warmup_s: float | None = None,
    ) -> Reading:
        """As `TwinTruth.measure` (the same workload, warm-up and window), simulated on the far reality."""
        from batchtune.twin.predict import Workload

        closed = load.kind == "concurrency"
        # An open loop's default warm-up is a tenth of the window up to 10 s; a closed loop's one turnover of its
        # streams (the twin's own), as TwinTruth.measure sets them.
        warmup = None if closed or prompts is not None else (
            warmup_s if warmup_s is not None else min(0.1 * scenario.window_s, 10.0))
        workload = Workload(
            scenario.input_len, scenario.output_len, concurrency=int(load.value) if closed else None,
            request_rate=None if closed else load.value, length_dist=scenario.length_dist, num_prompts=prompts,
            warmup_s=warmup,
        )
        # An operator window is simulated for its whole length (a run lengthened for too few requests sees more).
        window = PROMPT_RUN_CAP_S if prompts is not None else max(duration_s, 1.0)
        prediction = simulate(self.config(scenario, knobs), workload, window, seed, noise, self.reality(scenario))
        failure = prediction.startup_error or prediction.runtime_error
        if failure:
            return Reading(load, failure=failure)
        metrics = {k: float(v) for k, v in prediction.metrics.items() if isinstance(v, (int, float))}
        if prediction.memory is not None:
            metrics["kv_cache_tokens"] = float(prediction.memory.kv_cache_tokens)  # vllm:cache_config_info
        return Reading(load, metrics)
