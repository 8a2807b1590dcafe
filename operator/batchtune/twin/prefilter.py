"""The twin's memory model as the planner's prefilter: which settings cannot start on the target's GPU."""

from __future__ import annotations

from batchtune.core.planning import FitCheck, FitVerdict
from batchtune.core.settings import Setting
from batchtune.engines import Engine, Invocation


def memory_fit(engine: Engine, baseline: Invocation, gpu_product: str | None) -> tuple[FitCheck | None, str]:
    """A fit check for the target's model on its GPU, or None (with why) when either is unknown."""
    from batchtune.twin.catalog import UnknownGpu, UnknownModel, gpu_from_product_label
    from batchtune.twin.config import ServeConfig
    from batchtune.twin.memory import StartupFailure, plan_memory

    if engine.name != "vllm":
        return None, f"memory prefilter skipped: the twin models vLLM, not {engine.display}"
    if not gpu_product:
        return None, ("GPU model unknown (no nvidia.com/gpu.product label on the target's nodes, no dcgm-exporter "
                      "modelName for its pods): memory prefilter skipped")
    try:
        gpu = gpu_from_product_label(gpu_product)
        argv = list(baseline.argv) if baseline.form.endswith("api_server") else ["vllm", "serve", *baseline.argv]
        if baseline.form.endswith("api_server"):
            argv = ["python", "-m", "vllm.entrypoints.openai.api_server", *argv]
        base = ServeConfig.from_vllm_argv(argv, gpu)
    except (UnknownGpu, UnknownModel, ValueError, TypeError) as exc:
        return None, f"memory prefilter skipped: {exc}"

    def fits(setting: Setting) -> FitVerdict:
        cfg = base.replace(max_num_seqs=setting.max_num_seqs,
                           gpu_memory_utilization=setting.gpu_memory_utilization_percent / 100,
                           **({"max_num_batched_tokens": setting.max_num_batched_tokens}
                              if setting.max_num_batched_tokens else {}))
        try:
            plan = plan_memory(cfg)
        except StartupFailure as exc:
            text = str(exc).splitlines()[-1][:300]
            return FitVerdict(False, text, engine.classify_failure(text))
        return FitVerdict(True, f"KV cache {plan.kv_cache_tokens} tokens on {gpu.name}")

    return fits, f"memory prefilter: twin model of {base.model.name} on {gpu.name}"
