"""The twin as the benchmark's ground truth: `plan_memory` for startup, `predict` for every load step,
and the twin server's startup phases for what a start costs. `params(scenario)` is the deployment the
truth simulates: the catalog's twin here (`--truth nominal`), a hidden reality in `bench.reality`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from batchtune.bench.scenarios import Scenario
from batchtune.bench.types import Knobs, Load, Reading, StartResult

if TYPE_CHECKING:
    from batchtune.twin.config import ServeConfig
    from batchtune.twin.params import TwinParams

POD_OVERHEAD_S = 20.0
"""Scheduling, container start, Python imports and the readiness probe period, on top of vLLM's own
startup phases (the twin models a warm weight cache; a cold pull would cost minutes more)."""

# Cap on the simulated length of a prompt-counted run; beyond it the cost is extrapolated.
PROMPT_RUN_CAP_S = 300.0


@dataclass(frozen=True)
class TwinTruth:
    pod_overhead_s: float = POD_OVERHEAD_S

    def params(self, scenario: Scenario) -> TwinParams:
        """The deployment simulated for this scenario: the catalog's twin."""
        from batchtune.twin.params import NOMINAL

        return NOMINAL

    def describe(self, scenario: Scenario) -> str:
        return "nominal: the catalog's twin"

    def config(self, scenario: Scenario, knobs: Knobs) -> ServeConfig:
        return _config(scenario.model, scenario.gpu, scenario.tensor_parallel_size, scenario.max_model_len,
                       knobs.max_num_seqs, knobs.gpu_memory_utilization_pct, knobs.max_num_batched_tokens)

    def startup(self, scenario: Scenario, knobs: Knobs) -> StartResult:
        return _startup(self.config(scenario, knobs), self.pod_overhead_s, self.params(scenario))

    def fits(self, scenario: Scenario, knobs: Knobs) -> tuple[bool | None, str]:
        """The operator's memory prefilter on this truth's memory model (exact for startup failures; the
        runtime-OOM risk under load is not something a prefilter can rule on, so it stays unknown). The
        strategies get the nominal twin's (`TwinTruth().fits`), never a hidden reality's."""
        from batchtune.twin.memory import StartupFailure, plan_memory

        try:
            plan = plan_memory(self.config(scenario, knobs), self.params(scenario))
        except StartupFailure as exc:
            return False, exc.message[:200]
        if plan.runtime_oom_risk:
            return None, f"steps of {plan.runtime_oom_tokens}+ tokens may run out of memory at runtime"
        return True, ""

    def kv_never_binds(self, scenario: Scenario, knobs: Knobs) -> bool:
        """True when the KV pool holds max-num-seqs requests at their full length: then no step ever
        waits for or preempts KV blocks, and the simulation does not depend on the pool's size."""
        from batchtune.twin.memory import StartupFailure, plan_memory

        try:
            plan = plan_memory(self.config(scenario, knobs), self.params(scenario))
        except StartupFailure:
            return False
        if scenario.length_dist != "fixed":
            return False
        blocks_per_request = math.ceil((scenario.input_len + scenario.output_len) / plan.block_size)
        return plan.num_gpu_blocks > knobs.max_num_seqs * blocks_per_request

    def burst_failure(self, scenario: Scenario, knobs: Knobs) -> str | None:
        """The runtime OOM a full token-budget step hits (any burst of long prompts fills the budget)."""
        from batchtune.twin.memory import StartupFailure, plan_memory

        try:
            plan = plan_memory(self.config(scenario, knobs), self.params(scenario))
        except StartupFailure as exc:
            return str(exc)
        if plan.runtime_oom_tokens is None:
            return None
        return "torch.OutOfMemoryError: " + plan.runtime_oom_message(plan.runtime_oom_tokens)

    def measure(
        self, scenario: Scenario, knobs: Knobs, load: Load, *, duration_s: float, seed: int, noise: float,
        prompts: int | None = None, warmup_s: float | None = None,
    ) -> Reading:
        from batchtune.twin.predict import Workload, predict

        cfg = self.config(scenario, knobs)
        conc = int(load.value) if load.kind == "concurrency" else None
        rate = load.value if load.kind == "request_rate" else None
        # An open loop's default warm-up is the full window's whatever this window (the twin's own scales with the
        # window, which would leave a short one in the ramp); a closed loop's is one turnover of its streams.
        warmup = None
        if rate is not None and prompts is None:
            warmup = warmup_s if warmup_s is not None else min(0.1 * scenario.window_s, 10.0)
        workload = Workload(
            scenario.input_len, scenario.output_len, concurrency=conc, request_rate=rate,
            length_dist=scenario.length_dist, num_prompts=prompts, warmup_s=warmup,
        )
        # An operator window is simulated for its whole length: a run lengthened for too few requests must see more
        # of them (capped here, a 1200 s run of slow requests was billed in full but counted 300 s of requests).
        window = max(duration_s, 1.0) if prompts is None else PROMPT_RUN_CAP_S
        prediction = predict(cfg, workload, window, seed=seed, noise=noise, params=self.params(scenario))
        if prediction.startup_error:
            return Reading(load, failure=prediction.startup_error)
        if prediction.runtime_error:
            return Reading(load, failure=prediction.runtime_error)
        metrics = {k: float(v) for k, v in prediction.metrics.items() if isinstance(v, (int, float))}
        if prediction.memory is not None:
            metrics["kv_cache_tokens"] = float(prediction.memory.kv_cache_tokens)  # vllm:cache_config_info
        return Reading(load, metrics)


@lru_cache(maxsize=4096)
def _config(
    model: str, gpu: str, tp: int, max_model_len: int | None, mns: int, gmu_pct: int, mbt: int | None
) -> ServeConfig:
    from batchtune.twin.config import ServeConfig

    return ServeConfig(
        model=model, gpu=gpu, max_num_seqs=mns, gpu_memory_utilization=gmu_pct / 100.0,
        max_num_batched_tokens=mbt, max_model_len=max_model_len, tensor_parallel_size=tp,
    )


@lru_cache(maxsize=4096)
def _startup(cfg: ServeConfig, pod_overhead_s: float, params: TwinParams) -> StartResult:
    from batchtune.twin.cli_serve import startup_phases
    from batchtune.twin.memory import StartupFailure, plan_memory

    phases = dict(startup_phases(cfg))
    try:
        plan_memory(cfg, params)
    except StartupFailure as exc:
        text = exc.message
        if "Free memory on device" in text or "must be" in text or "max_model_len" in text and "greater" in text:
            spent = phases["init"]  # config and free-memory checks run before the weights load
        elif "loading model weights" in text:
            spent = phases["init"] + phases["weights"]
        else:
            spent = phases["init"] + phases["weights"] + phases["compile"] + phases["profile"]
        return StartResult(False, pod_overhead_s + spent, str(exc))
    return StartResult(True, pod_overhead_s + math.fsum(phases.values()))
