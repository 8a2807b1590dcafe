"""`batchtune twin vllm ARGV...`: the stand-in for what a vLLM container runs.

- `vllm serve MODEL [flags]`, `serve MODEL [flags]`, `python3 -m vllm.entrypoints.openai.api_server
  --model MODEL [flags]` -> the twin server (`batchtune twin serve`).
- `vllm bench serve [flags]` -> the project's load generator with `vllm bench serve` flag names.

Differences from `vllm bench serve`: only the random dataset; load is additionally bounded by
`--duration` (default 3600 s) and may exclude `--warmup-seconds`; figures are in simulated time
when $BATCHTUNE_TIME_SCALE is set (see docs/loadgen.md); when `--percentile-metrics` /
`--metric-percentiles` are not given, all of ttft,tpot,itl,e2el and 50,90,95,99 are reported
(a superset of vLLM's default keys).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Any

BENCH_DEFAULT_DURATION_S = 3600.0


def add_parser(twin_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = twin_sub.add_parser(
        "vllm",
        help="act as the vllm command of a vLLM container (`vllm serve ...`, `vllm bench serve ...`)",
        description="Dispatch a vLLM container argv to the twin server or the load generator.",
    )
    parser.add_argument("argv", nargs=argparse.REMAINDER, help="the container's command and args")
    parser.set_defaults(func=lambda args: vllm_main(list(args.argv)))


def classify(argv: list[str]) -> tuple[str, list[str]]:
    """("serve" | "bench", argv without the launcher) for a vLLM container argv; ValueError otherwise."""
    args = list(argv)
    if not args:
        raise ValueError("empty vLLM argv: expected `vllm serve MODEL ...` or `vllm bench serve ...`")
    head = os.path.basename(args[0])
    if head.startswith("python"):
        if len(args) >= 3 and args[1] == "-m" and args[2].startswith("vllm.entrypoints"):
            return "serve", args[3:]
        raise ValueError(f"unsupported python entry point in {argv!r}: expected -m vllm.entrypoints.openai.api_server")
    if head == "vllm":
        args = args[1:]
    if args and args[0] == "serve":
        return "serve", args[1:]
    if len(args) >= 2 and args[0] == "bench" and args[1] == "serve":
        return "bench", args[2:]
    if args and args[0].startswith("vllm.entrypoints"):
        return "serve", args[1:]
    raise ValueError(f"unsupported vLLM command {argv!r}: expected `vllm serve MODEL ...` or `vllm bench serve ...`")


def vllm_main(argv: list[str]) -> int:
    try:
        kind, rest = classify(argv)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if kind == "serve":
        from batchtune.twin.cli_serve import serve_main

        return serve_main(rest)
    return bench_main(rest)


def bench_parser() -> argparse.ArgumentParser:
    """`vllm bench serve`'s flags (the subset the load generator honours) plus the twin's bounds."""
    p = argparse.ArgumentParser(prog="vllm bench serve", allow_abbrev=False)
    p.add_argument("--backend", default="openai")
    p.add_argument("--base-url", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default=None)
    p.add_argument("--model", default=None)
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--dataset-name", default="random")
    p.add_argument("--random-input-len", "--input-len", dest="input_len", type=int, default=1024)
    p.add_argument("--random-output-len", "--output-len", dest="output_len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--request-rate", type=float, default=math.inf)
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--save-result", action="store_true")
    p.add_argument("--save-detailed", action="store_true")
    p.add_argument("--result-dir", default=None)
    p.add_argument("--result-filename", default=None)
    p.add_argument("--percentile-metrics", default=None)
    p.add_argument("--metric-percentiles", default=None)
    p.add_argument("--ready-check-timeout-sec", type=float, default=600.0)
    # The twin's additions: a hard time bound, a warm-up, and the loopback rule.
    p.add_argument("--duration", type=float, default=BENCH_DEFAULT_DURATION_S)
    p.add_argument("--warmup-seconds", type=float, default=0.0)
    p.add_argument("--allow-non-loopback", action="store_true")
    p.add_argument("--time-scale", type=float, default=None)
    p.add_argument("--termination-message-path", default=None)
    return p


def bench_spec(argv: list[str], log: Any = None) -> tuple[Any, str | None]:
    """(LoadRun, result file path or None) from `vllm bench serve` flags; unknown flags are logged."""
    from batchtune.loadgen import LoadRun
    from batchtune.loadgen.command import env_time_scale, parse_floats

    args, unknown = bench_parser().parse_known_args(_dashes(argv))
    say = log or (lambda m: print(m, file=sys.stderr))
    for flag in unknown:
        say(f"Ignored vllm bench serve flag the load generator does not model: {flag}")
    if args.dataset_name != "random":
        say(f"Dataset {args.dataset_name!r} is not available; used the random dataset")
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    chat = args.backend in ("openai-chat", "vllm-chat") or (args.endpoint or "").endswith("/chat/completions")
    endpoint = "/v1/chat/completions" if chat else "/v1/completions"
    metrics = tuple(m.strip() for m in args.percentile_metrics.split(",")) if args.percentile_metrics else None
    percentiles = parse_floats(args.metric_percentiles, "--metric-percentiles") if args.metric_percentiles else None
    extra: dict[str, Any] = {}
    if metrics:
        extra["percentile_metrics"] = metrics
    if percentiles:
        extra["percentiles"] = percentiles
    spec = LoadRun(
        base_url=base_url,
        endpoint=endpoint,
        model=args.served_model_name or args.model,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.random_range_ratio,
        concurrency=args.max_concurrency,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        num_prompts=args.num_prompts,
        duration_s=args.duration,
        warmup_s=args.warmup_seconds,
        seed=args.seed,
        ignore_eos=True,  # recent vLLM turns it on for the random dataset
        time_scale=args.time_scale if args.time_scale is not None else env_time_scale(),
        allow_non_loopback=args.allow_non_loopback,
        ready_timeout_s=args.ready_check_timeout_sec,
        **extra,
    )
    result_file = None
    if args.save_result or args.result_filename:
        name = args.result_filename or _default_result_name(args)
        result_file = os.path.join(args.result_dir, name) if args.result_dir else name
    return spec, result_file


def bench_main(argv: list[str]) -> int:
    from batchtune.loadgen.command import execute

    try:
        spec, result_file = bench_spec(argv)
    except (ValueError, argparse.ArgumentTypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    termination = _flag_value(argv, "--termination-message-path")
    return execute(spec, result_file=result_file, termination_path=termination)


def _default_result_name(args: argparse.Namespace) -> str:
    # vLLM: f"{backend}-{request_rate}qps{max_concurrency_str}-{base_model_id}-{current_dt}.json"
    rate = "inf" if not math.isfinite(args.request_rate) else f"{args.request_rate}"
    conc = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
    model = (args.model or "model").split("/")[-1]
    return f"{args.backend}-{rate}qps{conc}-{model}-{time.strftime('%Y%m%d-%H%M%S')}.json"


def _dashes(argv: list[str]) -> list[str]:
    """`--random_input_len=5` -> `--random-input-len=5` (vLLM accepts both)."""
    out = []
    for token in argv:
        if token.startswith("--"):
            name, eq, value = token[2:].partition("=")
            token = "--" + name.replace("_", "-") + eq + value
        out.append(token)
    return out


def _flag_value(argv: list[str], flag: str) -> str | None:
    args = _dashes(argv)
    for i, token in enumerate(args):
        if token == flag and i + 1 < len(args):
            return args[i + 1]
        if token.startswith(flag + "="):
            return token.split("=", 1)[1]
    return None
