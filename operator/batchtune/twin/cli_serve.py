"""`batchtune twin serve MODEL [vLLM flags] [--twin-gpu NAME] [--time-scale X]`: the real-time twin server.

Startup, as vLLM's: the process "loads the model" for a time that scales with the weights
(`STARTUP_*` below, divided by the time scale), logging vLLM's lines on the way, including
`GPU KV cache size: N tokens` and `Maximum concurrency for ...`. When the memory plan does not
fit, it logs vLLM's error, writes it to $BATCHTUNE_TERMINATION_MESSAGE_PATH and exits 1. While
loading, the socket is bound and /health answers 503. A runtime OOM under load kills the process
with SIGKILL (exit 137, reported as OOMKilled). SIGTERM/SIGINT stop it with exit 0.

Bind address: $BATCHTUNE_POD_IP when set (the node agent's pod IP wins over `--host`), else
`--host`, else 127.0.0.1; an any-address host (0.0.0.0, ::) is narrowed to 127.0.0.1 because
this twin only ever serves loopback.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

from batchtune.twin.server import VLLM_VERSION

POD_IP_ENV = "BATCHTUNE_POD_IP"
GPU_PRODUCT_ENV = "BATCHTUNE_GPU_PRODUCT"
GPU_COUNT_ENV = "BATCHTUNE_GPU_COUNT"
ACTIVITY_ENV = "BATCHTUNE_GPU_ACTIVITY_FILE"
TIME_SCALE_ENV = "BATCHTUNE_TIME_SCALE"
TERMINATION_ENV = "BATCHTUNE_TERMINATION_MESSAGE_PATH"

STARTUP_INIT_S = 5.0
"""Engine process start, config, NCCL/CUDA init (simulated seconds)."""
WEIGHT_LOAD_GIB_PER_S = 2.0
"""Safetensors from a warm local disk / page cache."""
STARTUP_COMPILE_S = 10.0
"""torch.compile with a warm cache (skipped with --enforce-eager)."""
STARTUP_PROFILE_S = 2.0
"""The dummy profile run that measures the activation peak."""
GRAPH_CAPTURE_S_PER_SIZE = 0.12
"""CUDA-graph capture per batch size."""


@dataclass(frozen=True)
class TwinFlags:
    """Flags of the twin itself, taken out of the vLLM argv before it is parsed."""

    gpu: str | None = None
    time_scale: float = 1.0
    load_seconds: float | None = None
    seed: int = 0
    legacy_metrics: bool = False
    activity_file: str | None = None
    stats_log_interval: float = 5.0


def _twin_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--twin-gpu", default=None)
    p.add_argument("--time-scale", type=float, default=None)
    p.add_argument("--twin-load-seconds", type=float, default=None)
    p.add_argument("--twin-seed", type=int, default=0)
    p.add_argument("--twin-legacy-metrics", action="store_true")
    p.add_argument("--twin-activity-file", default=None)
    p.add_argument("--twin-stats-log-interval", type=float, default=5.0)
    return p


def split_twin_flags(argv: list[str]) -> tuple[TwinFlags, list[str]]:
    """Separate the twin's flags (any position) from the vLLM argv; env supplies the defaults."""
    known, rest = _twin_parser().parse_known_args(argv)
    time_scale = known.time_scale
    if time_scale is None:
        raw = os.environ.get(TIME_SCALE_ENV, "").strip()
        try:
            time_scale = float(raw) if raw else 1.0
        except ValueError:
            raise ValueError(f"{TIME_SCALE_ENV}={raw!r} is not a number") from None
    if time_scale <= 0:
        raise ValueError(f"time scale must be > 0, got {time_scale}")
    flags = TwinFlags(
        gpu=known.twin_gpu,
        time_scale=time_scale,
        # A pod spec can shorten "model loading" for tests and demos without touching vLLM's argv.
        load_seconds=known.twin_load_seconds if known.twin_load_seconds is not None
        else (float(os.environ["BATCHTUNE_TWIN_LOAD_SECONDS"]) if os.environ.get("BATCHTUNE_TWIN_LOAD_SECONDS")
              else None),
        seed=known.twin_seed,
        legacy_metrics=known.twin_legacy_metrics,
        activity_file=known.twin_activity_file or os.environ.get(ACTIVITY_ENV) or None,
        stats_log_interval=known.twin_stats_log_interval,
    )
    return flags, rest


def bind_host(argv_host: str | None) -> str:
    """$BATCHTUNE_POD_IP, else the argv host, else 127.0.0.1; any-address hosts narrow to loopback."""
    pod_ip = os.environ.get(POD_IP_ENV, "").strip()
    if pod_ip:
        return pod_ip
    if not argv_host or argv_host in ("0.0.0.0", "::", "[::]", "*"):
        return "127.0.0.1"
    return argv_host


def add_parser(twin_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = twin_sub.add_parser(
        "serve",
        help="run the real-time twin server (accepts `vllm serve MODEL [flags]` argv)",
        description="Serve the OpenAI API, /health and vLLM's /metrics with timing from the twin model. "
        "Takes vLLM's flags (--max-num-seqs, --gpu-memory-utilization, --max-num-batched-tokens, "
        "--max-model-len, --tensor-parallel-size, --dtype, --quantization, --kv-cache-dtype, "
        "--served-model-name, --host, --port, --block-size, --[no-]enable-chunked-prefill, --enforce-eager) "
        "plus --twin-gpu NAME, --time-scale X (default $BATCHTUNE_TIME_SCALE or 1), --twin-load-seconds S, "
        "--twin-seed N, --twin-legacy-metrics, --twin-activity-file PATH.",
    )
    parser.add_argument("argv", nargs=argparse.REMAINDER, help="MODEL and vLLM flags")
    parser.set_defaults(func=lambda args: serve_main(list(args.argv)))


def _log(level: str, source: str, message: str) -> None:
    stamp = time.strftime("%m-%d %H:%M:%S")
    print(f"{level} {stamp} [{source}] {message}", flush=True)


def _write_termination(text: str) -> None:
    path = os.environ.get(TERMINATION_ENV)
    if not path:
        return
    try:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text[-4000:])
    except OSError as exc:
        _log("WARNING", "twin", f"Could not write the termination message to {path}: {exc}")


def _fail(text: str, code: int = 1) -> int:
    """Log vLLM's way of dying at startup and return the exit code."""
    print("Traceback (most recent call last):", file=sys.stderr)
    print('  File "/usr/local/lib/python3.12/dist-packages/vllm/v1/engine/core.py", line 691, in run_engine_core',
          file=sys.stderr)  # fmt: skip
    print(text, file=sys.stderr)
    print("RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
          file=sys.stderr, flush=True)  # fmt: skip
    _write_termination(text)
    return code


def serve_main(argv: list[str]) -> int:
    """Entry point shared by `batchtune twin serve` and `batchtune twin vllm serve ...`."""
    from batchtune.twin.catalog import UnknownGpu, UnknownModel, get_gpu, gpu_from_product_label
    from batchtune.twin.config import parse_vllm_argv

    try:
        flags, rest = split_twin_flags(argv)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    ignored: list[str] = []
    try:
        parsed = parse_vllm_argv(rest, on_unknown=ignored.append)
    except ValueError as exc:
        print(f"vllm serve: error: {exc}", file=sys.stderr)
        return 2
    _log("INFO", "api_server.py:1839", f"vLLM API server version {VLLM_VERSION} (batchtune twin)")
    for flag in ignored:
        _log("WARNING", "twin", f"Ignored vLLM flag the twin does not model: {flag}")
    try:
        if flags.gpu:
            gpu = get_gpu(flags.gpu)
        elif os.environ.get(GPU_PRODUCT_ENV):
            gpu = gpu_from_product_label(os.environ[GPU_PRODUCT_ENV])
        else:
            return _fail("RuntimeError: Failed to infer device type (no GPU: set --twin-gpu or "
                         f"${GPU_PRODUCT_ENV})")  # fmt: skip
        cfg = parsed.to_config(gpu)
    except (UnknownGpu, UnknownModel) as exc:
        return _fail(f"ValueError: {exc}")
    except ValueError as exc:
        return _fail(f"ValueError: {exc}")
    served = parsed.served_model_name or parsed.model
    host = bind_host(parsed.host)
    non_default = {k: v for k, v in parsed.settings.items()}
    _log("INFO", "utils.py:233", f"non-default args: {{'model': {parsed.model!r}, **{non_default!r}}}")
    try:
        return asyncio.run(_serve(cfg, flags, served, host, parsed.port, parsed.model))
    except KeyboardInterrupt:
        return 0


def startup_phases(cfg: Any) -> list[tuple[str, float]]:
    """(phase, simulated seconds) of vLLM's startup for `cfg`."""
    from batchtune.twin.catalog import GIB
    from batchtune.twin.memory import cudagraph_capture_sizes, weight_bytes

    eager = bool(getattr(cfg, "enforce_eager", False))
    return [
        ("init", STARTUP_INIT_S),
        ("weights", weight_bytes(cfg) / GIB / WEIGHT_LOAD_GIB_PER_S),
        ("compile", 0.0 if eager else STARTUP_COMPILE_S),
        ("profile", STARTUP_PROFILE_S),
        ("graphs", GRAPH_CAPTURE_S_PER_SIZE * len(cudagraph_capture_sizes(cfg))),
    ]


async def _serve(cfg: Any, flags: TwinFlags, served: str, host: str, port: int, model_path: str) -> int:
    from batchtune.twin.engine import SimEngine
    from batchtune.twin.memory import StartupFailure
    from batchtune.twin.server import ServerOptions, TwinServer

    phases = startup_phases(cfg)
    total = sum(s for _, s in phases)
    # --twin-load-seconds rescales the phases to a given total (0 = instant, for tests)
    factor = (flags.load_seconds / total if total else 0.0) if flags.load_seconds is not None else 1.0
    wall = {name: seconds * factor / flags.time_scale for name, seconds in phases}
    sim = {name: seconds * factor for name, seconds in phases}
    _log("INFO", "core.py:77", f"Initializing a V1 LLM engine (v{VLLM_VERSION}) with config: model={model_path!r}, "
         f"served_model_name={served}, max_seq_len={cfg.max_model_len}, tensor_parallel_size="
         f"{cfg.tensor_parallel_size}, max_num_seqs={cfg.max_num_seqs}, max_num_batched_tokens="
         f"{cfg.max_num_batched_tokens}, gpu={cfg.gpu.name}, time_scale={flags.time_scale}")  # fmt: skip
    try:
        engine = SimEngine(cfg, seed=flags.seed)
        failure: StartupFailure | None = None
    except StartupFailure as exc:
        engine, failure = None, exc

    server = None
    if engine is not None:
        options = ServerOptions(
            served_model_name=served,
            host=host,
            port=port,
            time_scale=flags.time_scale,
            activity_file=flags.activity_file,
            gpu_count=max(cfg.tensor_parallel_size, _env_int(GPU_COUNT_ENV, 1)),
            stats_log_interval_s=flags.stats_log_interval,
            legacy_gpu_cache_usage=flags.legacy_metrics,
            root_model=model_path,
            termination_message_path=os.environ.get(TERMINATION_ENV) or None,
        )
        server = TwinServer(engine, options, on_log=_log)
        try:
            await server.start()
        except OSError as exc:
            return _fail(f"OSError: [Errno 98] error while attempting to bind on address ({host!r}, {port}): {exc}")

    await asyncio.sleep(wall["init"])
    await asyncio.sleep(wall["weights"])
    weights_gib = (engine.memory.weights_gib if engine is not None else _weights_gib(cfg))
    _log("INFO", "default_loader.py:267", f"Loading weights took {sim['weights']:.2f} seconds")
    _log("INFO", "gpu_model_runner.py:2653",
         f"Model loading took {weights_gib:.4f} GiB and {sim['init'] + sim['weights']:.6f} seconds")  # fmt: skip
    if sim["compile"]:
        await asyncio.sleep(wall["compile"])
        _log("INFO", "monitor.py:34", f"torch.compile takes {sim['compile']:.2f} s in total")
    await asyncio.sleep(wall["profile"])
    if failure is not None:
        return _fail(str(failure))
    assert engine is not None and server is not None
    plan = engine.memory
    _log("INFO", "gpu_worker.py:298", f"Available KV cache memory: {plan.kv_cache_gib:.2f} GiB")
    _log("INFO", "kv_cache_utils.py:1087", f"GPU KV cache size: {plan.kv_cache_tokens:,} tokens")
    _log("INFO", "kv_cache_utils.py:1091",
         f"Maximum concurrency for {plan.max_model_len:,} tokens per request: {plan.max_concurrency_at_max_len:.2f}x")
    if sim["graphs"]:
        await asyncio.sleep(wall["graphs"])
        _log("INFO", "gpu_model_runner.py:3480",
             f"Graph capturing finished in {sim['graphs']:.0f} secs, took {plan.cudagraph_gib:.2f} GiB")
    _log("INFO", "core.py:210", f"init engine (profile, create kv cache, warmup model) took {total * factor:.2f} seconds")
    server.mark_ready()
    _log("INFO", "api_server.py:1882", f"Starting vLLM API server 0 on http://{host}:{server.bound_port}")
    _log("INFO", "launcher.py:44", "Available routes are: /health, /metrics, /version, /v1/models, "
         "/v1/completions, /v1/chat/completions")  # fmt: skip
    _log("INFO", "uvicorn", "Application startup complete.")

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    stopper = asyncio.create_task(stop.wait())
    dead = asyncio.create_task(server.stopped.wait())
    await asyncio.wait({stopper, dead}, return_when=asyncio.FIRST_COMPLETED)
    failed = server.failure is not None
    if not failed:
        _log("INFO", "launcher.py:99", "Shutting down FastAPI HTTP server.")
    await server.stop()
    stopper.cancel()
    dead.cancel()
    return 1 if failed else 0


def _weights_gib(cfg: Any) -> float:
    from batchtune.twin.catalog import GIB
    from batchtune.twin.memory import weight_bytes

    return weight_bytes(cfg) / GIB


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, "") or default)
    except ValueError:
        return default
