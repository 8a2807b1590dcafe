"""`batchtune twin predict`: what-if metrics for one vLLM setting and workload, without a GPU."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from batchtune.twin.predict import Prediction


def add_parser(twin_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = twin_sub.add_parser(
        "predict", help="predict vLLM serving metrics for a setting and workload (no GPU needed)",
        description="Simulate vLLM V1 on a GPU and print `vllm bench serve`-style metrics, or the startup error.")
    p.add_argument("--model", required=True, help="model name or HF id, e.g. meta-llama/Llama-3.1-8B-Instruct")
    p.add_argument("--gpu", required=True, help="GPU name or nvidia.com/gpu.product label, e.g. NVIDIA-H100-80GB-HBM3")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default=None, help="e.g. fp8, awq, gptq (4-bit)")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--input-len", type=int, required=True)
    p.add_argument("--output-len", type=int, required=True)
    load = p.add_mutually_exclusive_group(required=True)
    load.add_argument("--concurrency", type=int, help="closed-loop client concurrency")
    load.add_argument("--rate", type=float, help="Poisson request rate (req/s); 'inf' needs --num-prompts")
    p.add_argument("--num-prompts", type=int, default=None, help="bench mode: exactly N requests, whole run measured")
    p.add_argument("--length-dist", choices=("fixed", "uniform", "exponential"), default=None,
                   help="how lengths spread (default: a closed loop uniform +-10%%, the calibration's default where "
                        "nothing states the lengths; an open loop fixed; a client of fixed lengths, as vllm bench "
                        "--ignore-eos without a range ratio, runs in waves: give fixed)")
    p.add_argument("--range-ratio", type=float, default=None, metavar="R",
                   help="uniform lengths in [L(1-R), L(1+R)] (vllm bench serve's --random-range-ratio)")
    p.add_argument("--duration", type=float, default=60.0, help="measured window in seconds (default 60)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--catalog", default=None, help="YAML file with extra GPUs/models")
    p.add_argument("--calibration", default=None, metavar="FILE",
                   help="a deployment's fitted parameters (`batchtune twin calibrate -o json`); an Untrusted one "
                        "is refused unless --allow-untrusted")
    p.add_argument("--allow-untrusted", action="store_true",
                   help="use a calibration whose verdict is Untrusted (its predictions miss its own measurements)")
    p.add_argument("-o", "--output", choices=("json", "table"), default="table")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from batchtune.terminal import safe
    from batchtune.twin.catalog import UnknownGpu, UnknownModel, load_custom_catalog
    from batchtune.twin.cli_calibrate import calibration_params, resolve
    from batchtune.twin.config import ServeConfig
    from batchtune.twin.predict import Workload, predict

    params = None
    try:
        if args.catalog:
            load_custom_catalog(args.catalog)
        model: object = args.model
        gpu: object = args.gpu
        if args.calibration:
            params, document = calibration_params(args.calibration, args.model, args.gpu)
            if document.get("verdict") != "Trusted" and not args.allow_untrusted:
                raise ValueError(
                    f"{args.calibration}: the calibration's verdict is {document.get('verdict')!r}, not 'Trusted' "
                    f"({str(document.get('reason') or 'no reason given')[:600]}): its predictions miss the "
                    "measurements it was fitted on; fix the inputs and recalibrate, or --allow-untrusted")
            if params.generic is not None:
                model, gpu, _ = resolve(args.model, args.gpu, args.max_model_len)
        cfg = ServeConfig(
            model=model, gpu=gpu, max_num_seqs=args.max_num_seqs,  # type: ignore[arg-type]
            gpu_memory_utilization=args.gpu_memory_utilization, max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len, tensor_parallel_size=args.tensor_parallel_size, dtype=args.dtype,
            quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype, model_id=args.model)
        workload = Workload(args.input_len, args.output_len, concurrency=args.concurrency, request_rate=args.rate,
                            num_prompts=args.num_prompts, **length_spread(args.length_dist, args.range_ratio,
                                                                          closed=args.concurrency is not None))
    except (UnknownGpu, UnknownModel, ValueError) as exc:
        print(f"error: {safe(exc)}", file=sys.stderr)
        return 2
    prediction = predict(cfg, workload, args.duration, seed=args.seed, params=params)
    data = prediction.as_dict()
    data["length_dist"] = workload.length_dist
    if workload.length_dist == "uniform":
        data["random_range_ratio"] = workload.range_ratio
    if args.output == "json":
        print(json.dumps(data, indent=2, default=lambda v: None if isinstance(v, float) and math.isnan(v) else v))
    else:
        _print_table(prediction, data)
    if prediction.startup_error:
        print(prediction.startup_error, file=sys.stderr)
        return 1
    if prediction.runtime_error:
        print(prediction.runtime_error, file=sys.stderr)
        return 1
    return 0


def length_spread(dist: str | None, ratio: float | None, closed: bool) -> dict[str, Any]:
    """Workload keywords for the lengths asked: a closed loop without a choice spreads them by the calibration's
    default (`observations.CLOSED_LOOP_DEFAULT_SPREAD`), so its clients do not fall into step."""
    from batchtune.twin.observations import CLOSED_LOOP_DEFAULT_SPREAD

    if ratio is not None and not 0 <= ratio < 1:
        raise ValueError(f"--range-ratio must be in [0, 1), got {ratio}")
    if dist is None:
        dist = "uniform" if ratio is not None or closed else "fixed"
    if dist == "uniform":
        return {"length_dist": "uniform", "range_ratio": CLOSED_LOOP_DEFAULT_SPREAD if ratio is None else ratio}
    if ratio is not None:
        raise ValueError(f"--range-ratio applies to --length-dist uniform, not {dist}")
    return {"length_dist": dist}


def _print_table(prediction: Prediction, data: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    cfg = prediction.config
    title = (f"{cfg.model.name} on {cfg.gpu.name} x{cfg.tensor_parallel_size}: max_num_seqs={cfg.max_num_seqs}, "
             f"gmu={cfg.gpu_memory_utilization}, max_num_batched_tokens={cfg.max_num_batched_tokens}")
    if prediction.startup_error:
        console.print(f"[bold red]Startup failed[/]: {title}")
        return
    if prediction.memory is not None:
        for line in prediction.memory.log_lines():
            console.print(f"[dim]{line}[/]")
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in data.items():
        if key in ("model_id", "gpu", "max_num_seqs", "gpu_memory_utilization", "max_num_batched_tokens"):
            continue
        if isinstance(value, float):
            text = f"{value:,.2f}"
        else:
            text = "-" if value is None else str(value)
        table.add_row(key, text)
    console.print(table)
