"""The twin's memory model as the planner's prefilter: which settings cannot start on the target's GPU."""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchtune.core.planning import FitCheck, FitVerdict
from batchtune.core.settings import Setting
from batchtune.engines import Engine, Invocation

if TYPE_CHECKING:
    from batchtune.twin.config import ServeConfig


def baseline_config(engine: Engine, baseline: Invocation, gpu_product: str | None,
                    generic: bool = False) -> tuple[ServeConfig | None, bool, str]:
    """The twin's config of production's command line on its GPU: (config, is generic, why not / what).

    `generic`: a model or GPU missing from the catalog gets a placeholder (a generic step model fitted on
    measurements stands in for its physics) instead of None."""
    from batchtune.twin.catalog import UnknownGpu, UnknownModel, gpu_from_product_label
    from batchtune.twin.config import ServeConfig, parse_vllm_argv

    if engine.name != "vllm":
        return None, False, f"the twin models vLLM, not {engine.display}"
    if not gpu_product:
        return None, False, ("GPU model unknown (no nvidia.com/gpu.product label on the target's nodes, no "
                             "dcgm-exporter modelName for its pods)")
    argv = list(baseline.argv) if baseline.form.endswith("api_server") else ["vllm", "serve", *baseline.argv]
    if baseline.form.endswith("api_server"):
        argv = ["python", "-m", "vllm.entrypoints.openai.api_server", *argv]
    try:
        gpu = gpu_from_product_label(gpu_product)
        return ServeConfig.from_vllm_argv(argv, gpu), False, f"twin model of {baseline.model} on {gpu.name}"
    except (UnknownGpu, UnknownModel) as exc:
        if not generic:
            return None, False, str(exc)
        try:
            from batchtune.twin.cli_calibrate import resolve

            parsed = parse_vllm_argv(argv)
            max_len = parsed.settings.get("max_model_len")
            model, gpu_spec, _ = resolve(parsed.model, gpu_product, max_len if isinstance(max_len, int) else None)
            cfg = ServeConfig(model=model, gpu=gpu_spec, model_id=parsed.model, **parsed.settings)  # type: ignore[arg-type]
        except (ValueError, TypeError) as err:
            return None, False, str(err)
        return cfg, True, f"{exc}: a generic step model, fitted on the trials, stands in"
    except (ValueError, TypeError) as exc:
        return None, False, str(exc)


def memory_fit(engine: Engine, baseline: Invocation, gpu_product: str | None) -> tuple[FitCheck | None, str]:
    """A fit check for the target's model on its GPU, or None (with why) when either is unknown."""
    from batchtune.twin.memory import StartupFailure, plan_memory

    base, _, why = baseline_config(engine, baseline, gpu_product)
    if base is None:
        return None, (f"{why}: memory prefilter skipped" if engine.name == "vllm" and not gpu_product
                      else f"memory prefilter skipped: {why}")
    gpu = base.gpu

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
