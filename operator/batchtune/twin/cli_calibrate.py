"""`batchtune twin calibrate`: fit the twin to one deployment from `vllm bench serve --save-result` files.

    batchtune twin calibrate --model M --gpu G [vLLM serve flags] --observations FILE [FILE ...] -o json

The vLLM serve flags (`--max-num-seqs`, `--tensor-parallel-size`, `--quantization`, `--max-model-len`,
...; vLLM's own spellings, read by the engine adapter's grammar) say how the measured server ran.
The result (`-o json`) is a calibration document that `batchtune twin predict --calibration FILE`
reads. Exit 0 with a Trusted or Untrusted verdict, 2 on bad input (the file and key named).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from batchtune.twin.catalog import GpuSpec, ModelSpec
    from batchtune.twin.config import ServeConfig
    from batchtune.twin.fit import Calibration
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
        model_spec = ModelSpec(model, (model,), 1.0, 1, 64, 1, 1, 64, 64, 1024, max_model_len or 131072)
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
    from batchtune.twin.observations import ObservationError, load_observations

    try:
        if args.catalog:
            load_custom_catalog(args.catalog)
        cfg, generic, notes = serve_config(args.model, args.gpu, list(getattr(args, "extra", []) or []))
    except (ValueError, KeyError) as exc:
        print(f"error: {safe(exc)}", file=sys.stderr)
        return 2
    observations = []
    try:
        for path in args.observations:
            observations.extend(load_observations(path, cfg))
    except ObservationError as exc:
        print(f"error: {safe(exc)}", file=sys.stderr)
        return 2
    try:
        calibration = calibrate(observations, generic=generic or args.generic, seed=args.seed)
    except ValueError as exc:
        print(f"error: {safe(exc)}", file=sys.stderr)
        return 2
    document = calibration_document(calibration, cfg, args.model, args.gpu, [*notes, *calibration.notes],
                                    [o.source for o in observations])
    if args.output == "json":
        print(json.dumps(document, indent=2))
    else:
        _print_table(document)
    return 0


def calibration_document(calibration: Calibration, cfg: ServeConfig, model: str, gpu: str, notes: list[str],
                         sources: list[str]) -> dict[str, Any]:
    """The calibration as JSON: what was fitted, how well, and whether to trust it."""
    from batchtune.twin.fit import TOLERANCE

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
    elif params.generic is not None:
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
        "residuals": [r.as_dict() for r in calibration.residuals],
        "rmsLogError": round(rms, 4) if math.isfinite(rms) else None,
        "verdict": calibration.verdict,
        "reason": calibration.reason,
        "tolerancePercent": {k: round(v * 100) for k, v in TOLERANCE.items()},
        "notes": notes,
        "fitSeconds": round(calibration.fit_seconds, 2),
    }


def read_calibration(path: str) -> dict[str, Any]:
    """A calibration document written by `twin calibrate -o json`; ValueError naming the file and key."""
    try:
        with open(path, encoding="utf-8") as fh:
            document = json.load(fh)
    except OSError as exc:
        raise ValueError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ValueError(f"{path}: not JSON: {exc}") from None
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
