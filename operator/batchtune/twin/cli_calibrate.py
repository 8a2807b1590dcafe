"""`batchtune twin calibrate`: fit the twin to one deployment from `vllm bench serve --save-result` files.

    batchtune twin calibrate --model M --gpu G [vLLM serve flags] --observations FILE [FILE ...] -o json

The vLLM serve flags (`--max-num-seqs`, `--tensor-parallel-size`, `--quantization`, `--max-model-len`,
...; vLLM's own spellings, read by the engine adapter's grammar) say how the measured server ran.
`--metrics FILE` (a `curl /metrics` scrape or the engine's startup log) or `--kv-pool-tokens N` gives the
engine's KV pool, `--random-range-ratio R` how the random dataset spread the lengths (docs/twin.md).
The result (`-o json`) is a calibration document that `batchtune twin predict --calibration FILE`
reads. Exit 0 with a Trusted verdict, 1 with an Untrusted one (the document is still written;
`--allow-untrusted` exits 0), 2 on bad input (the file and key named).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Sequence

    from batchtune.twin.catalog import GpuSpec, ModelSpec
    from batchtune.twin.config import ServeConfig
    from batchtune.twin.fit import Calibration, Observation
    from batchtune.twin.params import TwinParams

DOCUMENT_KIND = "batchtune.io/twin-calibration"
DOCUMENT_VERSION = 1


def add_parser(twin_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = twin_sub.add_parser(
        "calibrate", allow_abbrev=False,
        help="fit the twin's deployment parameters to vllm bench serve results (for twin predict --calibration)",
        description="Fit bandwidth and compute efficiency, CPU overheads, the kernel floor and the response path "
                    "(or, for a model or GPU missing from the catalog, a generic step-time model) to `vllm bench serve "
                    "--save-result` files, and report the residuals and a trust verdict. Any other flag is read as "
                    "a `vllm serve` flag describing how the measured server ran (e.g. --max-num-seqs 256 "
                    "--tensor-parallel-size 2 --quantization fp8 --max-model-len 8192).")
    p.add_argument("--model", required=True, help="the served model (catalog name or HF id); unknown: generic fit")
    p.add_argument("--gpu", required=True, help="GPU name or nvidia.com/gpu.product label; unknown: generic fit")
    p.add_argument("--observations", nargs="+", required=True, metavar="FILE",
                   help="vllm bench serve --save-result JSON files (an object, a list of objects, or JSON lines)")
    p.add_argument("--metrics", default=None, metavar="FILE",
                   help="the measured server's KV pool: a `curl /metrics` scrape (vllm:cache_config_info) or its "
                        "startup log (\"KV cache size: N tokens\")")
    p.add_argument("--kv-pool-tokens", type=int, default=None, metavar="N",
                   help="the measured server's KV pool in tokens (vllm:cache_config_info's kv_cache_size_tokens)")
    p.add_argument("--random-range-ratio", default=None, metavar="R",
                   help="the --random-range-ratio the runs used (a number, or '{\"input\": r, \"output\": r}'); "
                        "per-request lengths (--save-detailed) and --metadata random_range_ratio=R win")
    p.add_argument("--allow-untrusted", action="store_true",
                   help="exit 0 on an Untrusted verdict too (the document says Untrusted either way)")
    p.add_argument("--generic", action="store_true", help="fit the generic step-time model even for catalog entries")
    p.add_argument("--catalog", default=None, help="YAML file with extra GPUs/models")
    p.add_argument("--seed", type=int, default=0, help="seed of the simulations behind the residuals")
    p.add_argument("-o", "--output", choices=("json", "table"), default="table")
    p.set_defaults(func=_run, vllm_flags=True)


def resolve(model: str, gpu: str, max_model_len: int | None) -> tuple[ModelSpec, GpuSpec, list[str]]:
    """Catalog entries for the model and GPU; a placeholder for one missing (only its name and limits matter
    to a generic step-time model), with a note saying so."""
    from batchtune.twin.catalog import GpuSpec, ModelSpec, UnknownGpu, UnknownModel, get_gpu, get_model

    notes: list[str] = []
    try:
        model_spec = get_model(model)
    except UnknownModel:
        model_spec = ModelSpec(model, (model,), 1.0, 1, 64, 1, 1, 64, 64, 1024, max_model_len or 131072,
                               placeholder=True)
        notes.append(f"model {model!r} is not in the catalog: a generic step-time model stands in for its physics")
    try:
        gpu_spec = get_gpu(gpu)
    except UnknownGpu:
        gpu_spec = GpuSpec(gpu, 80.0, 1000.0, 100.0, None, 300.0, 50.0, (gpu,))
        notes.append(f"GPU {gpu!r} is not in the catalog: a generic step-time model stands in for its physics")
    return model_spec, gpu_spec, notes


def serve_config(model: str, gpu: str, flags: list[str]) -> tuple[ServeConfig, bool, list[str]]:
    """The measured server's config from `--model`, `--gpu` and vLLM serve flags; (config, generic, notes)."""
    from batchtune.twin.config import ServeConfig, parse_vllm_argv

    notes: list[str] = []
    argv = parse_vllm_argv(["vllm", "serve", model, *flags], on_unknown=lambda f: notes.append(
        f"vLLM flag {f} does not change the twin; ignored"))
    settings = dict(argv.settings)
    max_len = settings.get("max_model_len")
    model_spec, gpu_spec, missing = resolve(model, gpu, max_len if isinstance(max_len, int) else None)
    cfg = ServeConfig(model=model_spec, gpu=gpu_spec, model_id=model, **settings)  # type: ignore[arg-type]
    return cfg, bool(missing), [*notes, *missing]


def calibration_params(path: str, model: str, gpu: str) -> tuple[TwinParams, dict[str, Any]]:
    """The fitted parameters of a calibration document, checked to be for this model and GPU."""
    from batchtune.twin.catalog import UnknownGpu, UnknownModel, get_gpu, get_model
    from batchtune.twin.params import TwinParams

    document = read_calibration(path)
    params = TwinParams.from_dict(document["parameters"], f"{path}: parameters")

    def same(given: str, fitted_name: str, fitted_catalog: str | None, lookup: Any, unknown: type[Exception]) -> bool:
        try:
            return bool(lookup(given).name == fitted_catalog)
        except unknown:
            return given.strip().lower() == str(fitted_name).strip().lower()

    if not same(model, document["model"], document.get("catalogModel"), get_model, UnknownModel) or \
            not same(gpu, document["gpu"], document.get("catalogGpu"), get_gpu, UnknownGpu):
        raise ValueError(f"{path}: fitted for {document['model']!r} on {document['gpu']!r}, not {model!r} on {gpu!r}: "
                         "a calibration describes one deployment")
    return params, document


def _run(args: argparse.Namespace) -> int:
    from batchtune.terminal import safe
    from batchtune.twin.catalog import load_custom_catalog
    from batchtune.twin.fit import calibrate
    from batchtune.twin.observations import Inputs, ObservationError, kv_pool_from_file, load_all, parse_range_ratio

    try:
        if args.catalog:
            load_custom_catalog(args.catalog)
        cfg, generic, notes = serve_config(args.model, args.gpu, list(getattr(args, "extra", []) or []))
        if args.metrics and args.kv_pool_tokens is not None:
            raise ValueError("--metrics and --kv-pool-tokens both give the KV pool: give one")
        pool, pool_note = args.kv_pool_tokens, "KV pool from --kv-pool-tokens"
        if args.metrics:
            pool, pool_note = kv_pool_from_file(args.metrics, cfg)
        if pool is not None and pool < 1:
            raise ValueError(f"--kv-pool-tokens is {pool}; expected a positive number of tokens")
        ratio = parse_range_ratio(args.random_range_ratio, "--random-range-ratio") \
            if args.random_range_ratio is not None else None
        inputs = Inputs(pool, pool_note if pool is not None else "", ratio)
        observations = load_all(args.observations, cfg, inputs)
    except (ValueError, KeyError) as exc:  # ObservationError is a ValueError
        print(f"error: {safe(exc)}", file=sys.stderr)
        return 2
    if pool is not None:
        notes.append(pool_note if any(o.kv_pool_tokens == pool for o in observations) else
                     f"{pool_note}: no result was served at the command line's setting, so it was not used")
    try:
        calibration = calibrate(observations, generic=generic or args.generic, seed=args.seed)
    except ObservationError as exc:
        print(f"error: {safe(exc)}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"error: {safe(exc)}", file=sys.stderr)
        return 2
    document = calibration_document(calibration, cfg, args.model, args.gpu, [*notes, *calibration.notes],
                                    [o.source for o in observations], observations)
    if args.output == "json":
        print(json.dumps(document, indent=2))
    else:
        _print_table(document)
    if not calibration.trusted:
        hint = "" if args.allow_untrusted else " (exit 1; --allow-untrusted to exit 0)"
        print(f"Untrusted: {safe(calibration.reason)}{hint}", file=sys.stderr)
        return 0 if args.allow_untrusted else 1
    return 0


STATISTICS = {
    "itl": "the gap between consecutive tokens of a request (vllm bench serve's ITL; its median is a decode-only "
           "step; genai-perf and NIM tables call the per-request mean below \"ITL\")",
    "tpot": "a request's mean time per output token after the first (vllm bench serve's TPOT)",
    "ttft": "time to the first token, as the client saw it",
    "e2el": "a request's end-to-end latency, as the client saw it",
    "throughput": "output tokens (or requests) per second over the run",
    "running": "the engine's mean running batch (vllm:num_requests_running)",
}


def fitted_statistics(calibration: Calibration) -> dict[str, Any]:
    """Which statistic of each family the fit compared (the file's keys), and what it measures."""
    from batchtune.twin.fit import family_of

    keys: dict[str, set[str]] = {}
    for r in calibration.residuals:
        keys.setdefault(family_of(r.key), set()).add(r.key)
    return {family: {"keys": sorted(found), "meaning": STATISTICS.get(family, "")} for family, found in keys.items()}


def calibration_document(calibration: Calibration, cfg: ServeConfig, model: str, gpu: str, notes: list[str],
                         sources: list[str], observations: Sequence[Observation] = ()) -> dict[str, Any]:
    """The calibration as JSON: what was fitted, how well, and whether to trust it."""
    from batchtune.twin.fit import (
        MAX_BANDWIDTH_EFFICIENCY,
        MAX_COMPUTE_EFFICIENCY,
        OVERHEAD_BOUNDS,
        TOLERANCE,
    )

    params = calibration.params
    effective: dict[str, Any] = {}
    if calibration.kind == "catalog":
        g = cfg.gpu
        effective = {
            "bandwidthEfficiency": round(g.eta_bw * params.bw_scale, 4),
            "computeEfficiency": round(g.eta_flops * params.flops_scale, 4),
            "achievedBandwidthGBps": round(g.bandwidth_gbps * g.eta_bw * params.bw_scale, 1),
            "achievedTflops": round(g.peak_tflops(cfg.fp8_compute) * g.eta_flops * params.flops_scale, 1),
            "stepOverheadMs": round(params.step_overhead_s * 1000, 4),
            "perSequenceOverheadUs": round(params.seq_overhead_s * 1e6, 3),
            "layerFloorUs": round(params.layer_floor_s * 1e6, 3),
            "responsePathMs": round(params.response_path_s * 1000, 3),
            "memoryOffsetGiB": params.memory_offset_gib,
        }
        physical = {"maxBandwidthEfficiency": MAX_BANDWIDTH_EFFICIENCY, "maxComputeEfficiency": MAX_COMPUTE_EFFICIENCY,
                    **{f"{k.removesuffix('_s')}Seconds": list(v) for k, v in OVERHEAD_BOUNDS.items()}}
    else:
        physical = {}
    if calibration.kind != "catalog" and params.generic is not None:
        effective = {"fixedMs": round(params.generic.fixed_s * 1000, 4),
                     "perSequenceUs": round(params.generic.per_seq_s * 1e6, 3),
                     "perTokenUs": round(params.generic.per_token_s * 1e6, 4),
                     "perKvTokenNs": round(params.generic.per_kv_token_s * 1e9, 4),
                     "responsePathMs": round(params.response_path_s * 1000, 3)}
    rms = calibration.rms_log_error()
    return {
        "kind": DOCUMENT_KIND,
        "version": DOCUMENT_VERSION,
        "model": model,
        "catalogModel": None if calibration.kind == "generic" and cfg.model.name == model else cfg.model.name,
        "gpu": gpu,
        "catalogGpu": cfg.gpu.name,
        "fit": calibration.kind,
        "setting": {"max_num_seqs": cfg.max_num_seqs, "gpu_memory_utilization": cfg.gpu_memory_utilization,
                    "max_num_batched_tokens": cfg.max_num_batched_tokens, "max_model_len": cfg.max_model_len,
                    "tensor_parallel_size": cfg.tensor_parallel_size, "quantization": cfg.quantization,
                    "kv_cache_dtype": cfg.kv_cache_dtype, "dtype": cfg.dtype, "enforce_eager": cfg.enforce_eager},
        "parameters": params.as_dict(),
        "effective": effective,
        "observations": calibration.observations,
        "sources": sources,
        "kvPoolTokens": sorted({o.kv_pool_tokens for o in observations if o.kv_pool_tokens}),
        "lengths": [{"source": o.source, "inputLen": round(o.shape.input_len, 2), "outputLen": round(o.shape.output_len, 2),
                     "simulated": o.shape.length_dist if o.shape.length_dist == "fixed" else
                     f"uniform +-{o.shape.range_ratio:.0%} in, +-{o.shape.output_ratio:.0%} out"} for o in observations],
        "statistics": fitted_statistics(calibration),
        "residuals": [r.as_dict() for r in calibration.residuals],
        "rmsLogError": round(rms, 4) if math.isfinite(rms) else None,
        "verdict": calibration.verdict,
        "reason": calibration.reason,
        "physicalBounds": physical,
        "atPhysicalBound": [b.as_dict() for b in calibration.bounds],
        "contradictions": list(calibration.contradictions),
        "tolerancePercent": {k: round(v * 100) for k, v in TOLERANCE.items()},
        "notes": notes,
        "fitSeconds": round(calibration.fit_seconds, 2),
    }


def read_calibration(path: str) -> dict[str, Any]:
    """A calibration document written by `twin calibrate -o json`; ValueError naming the file and key."""
    from batchtune.files import read_json

    document = read_json(path)  # InputFileError (a ValueError) naming the file and the line or key
    if not isinstance(document, dict) or document.get("kind") != DOCUMENT_KIND:
        raise ValueError(f"{path}: key 'kind' is {document.get('kind') if isinstance(document, dict) else None!r}; "
                         f"expected {DOCUMENT_KIND!r} (the output of `batchtune twin calibrate -o json`)")
    if document.get("version") != DOCUMENT_VERSION:
        raise ValueError(f"{path}: key 'version' is {document.get('version')!r}; this batchtune reads {DOCUMENT_VERSION}")
    for key in ("model", "gpu", "parameters"):
        if key not in document:
            raise ValueError(f"{path}: key {key!r} is missing")
    return document


def _print_table(document: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    from batchtune.terminal import text

    console = Console()
    console.print(text(f"{document['model']} on {document['gpu']}: {document['fit']} fit from "
                       f"{document['observations']} observation(s) in {document['fitSeconds']} s"))
    for key, value in document["effective"].items():
        console.print(text(f"  {key}: {value}"))
    table = Table(title="residuals (the twin's simulation of each measured run)")
    for column in ("observation", "metric", "measured", "predicted", "error", "tolerance"):
        table.add_column(column, justify="left" if column in ("observation", "metric") else "right")
    for r in document["residuals"]:
        error = "-" if r["errorPercent"] is None else f"{r['errorPercent']:+.1f}%"
        table.add_row(text(r["source"]), text(r["key"]), f"{r['measured']:.4g}",
                      "-" if r["predicted"] is None else f"{r['predicted']:.4g}",
                      text(error, "" if r["within"] else "bold red"), f"{r['tolerancePercent']}%")
    console.print(table)
    console.print(text(f"{document['verdict']}: {document['reason']}",
                       "bold green" if document["verdict"] == "Trusted" else "bold red"))
    for note in document["notes"]:
        console.print(text(f"note: {note}", "dim"))
