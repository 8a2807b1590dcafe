"""`batchtune loadgen`: streaming load against an OpenAI endpoint, `vllm bench serve`-style results."""

from __future__ import annotations

import argparse
import math
import os
import sys

from batchtune.loadgen.command import (
    TERMINATION_ENV,
    TIME_SCALE_ENV,
    env_time_scale,
    execute,
    parse_floats,
    write_file,
)

__all__ = ["execute", "parse_floats", "parse_goodput", "run", "summarize"]

def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "loadgen",
        help="send streaming load to an OpenAI endpoint and write a vllm-bench-style result",
        description="Closed-loop (--concurrency) or Poisson (--request-rate) load, bounded by --num-prompts "
        "and --duration. Durations and rates are simulated seconds when a time scale is set.",
    )
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server URL (default %(default)s)")
    parser.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    parser.add_argument("--model", default=None, help="model name (default: first from /v1/models)")
    parser.add_argument("--input-len", type=int, default=1024, help="prompt tokens (default %(default)s)")
    parser.add_argument("--output-len", type=int, default=128, help="max_tokens (default %(default)s)")
    parser.add_argument("--range-ratio", type=float, default=0.0, help="uniform length spread (default 0: fixed)")
    parser.add_argument("--prompt-buckets", default=None, metavar="LE:COUNT,...",
                        help="sample prompt lengths from this histogram (per-bucket counts, +Inf as inf)")
    parser.add_argument("--output-buckets", default=None, metavar="LE:COUNT,...",
                        help="sample output lengths (max_tokens) from this histogram")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="the engine's context length: a prompt plus its output is cut to fit")
    parser.add_argument("--trace", default=None, metavar="FILE",
                        help="replay this JSONL trace as is (offset_seconds, prompt_tokens, output_tokens per line)")
    parser.add_argument("--trace-speed-percent", type=float, default=100.0,
                        help="replay speed of --trace in percent (200: twice as fast; default 100)")
    parser.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                        help="count requests meeting every target (ttft, tpot, e2el in ms) as request_goodput, "
                             "as vllm bench serve --goodput")
    parser.add_argument("--concurrency", type=int, default=None, help="closed-loop streams / in-flight cap")
    parser.add_argument("--request-rate", type=float, default=math.inf, help="Poisson req/s (default inf)")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals (1 = Poisson)")
    parser.add_argument("--num-prompts", type=int, default=1000, help="hard cap on requests (default %(default)s)")
    parser.add_argument("--duration", type=float, default=600.0, help="hard cap in seconds (default %(default)s)")
    parser.add_argument("--warmup-seconds", type=float, default=0.0, help="excluded from stats (default 0)")
    parser.add_argument("--steady-warmup", action="store_true",
                        help="end the warm-up once the load has settled (steady-state test), at most at "
                             "--warmup-seconds; the measured window keeps its length (never for --trace)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el")
    parser.add_argument("--metric-percentiles", default="50,90,95,99")
    parser.add_argument("--time-scale", type=float, default=None, help=f"twin time scale (default ${TIME_SCALE_ENV} or 1)")
    parser.add_argument("--result-file", default=None, help="write the full result JSON here")
    parser.add_argument(
        "--termination-message-path", default=None, help=f"write a compact JSON summary here (default ${TERMINATION_ENV})"
    )
    parser.add_argument("--allow-non-loopback", action="store_true", help="allow targets outside 127.0.0.0/8")
    parser.add_argument("--ready-timeout", type=float, default=60.0, help="seconds to wait for /v1/models")
    parser.add_argument("--quiet", action="store_true", help="do not print the text report")
    parser.add_argument("--summarize-result", metavar="FILE", default=None,
                        help="send no load: summarize a `vllm bench serve --save-result` FILE into the termination "
                             "message (the VllmBench generator's second container)")
    # The operator reads the summary once the process has ended: end it as soon as the summary is written.
    parser.set_defaults(func=run, exit_when_done=True)


def parse_goodput(item: str) -> tuple[str, float]:
    """`ttft:500` -> ("ttft", 500.0); ValueError names the item."""
    key, sep, value = item.partition(":")
    try:
        if not sep or key not in ("ttft", "tpot", "e2el"):
            raise ValueError
        return key, float(value)
    except ValueError:
        raise ValueError(f"--goodput {item!r}: expected ttft:MS, tpot:MS or e2el:MS") from None


def run(args: argparse.Namespace) -> int:
    from batchtune.core.workload import parse_bucket_text
    from batchtune.loadgen import LoadRun
    from batchtune.loadgen.workload import read_trace

    if args.summarize_result:
        return summarize(args.summarize_result, args.termination_message_path)

    try:
        prompts = parse_bucket_text(args.prompt_buckets) if args.prompt_buckets else None
        outputs = parse_bucket_text(args.output_buckets) if args.output_buckets else None
        for flag, dist in (("--prompt-buckets", prompts), ("--output-buckets", outputs)):
            if dist is not None and dist.total <= 0:
                raise ValueError(f"{flag}: the histogram holds no request")
        trace = tuple(read_trace(args.trace)) if args.trace else ()
        goodput = tuple(parse_goodput(item) for item in args.goodput or ())
        spec = LoadRun(
            base_url=args.base_url,
            endpoint=args.endpoint,
            model=args.model,
            input_len=args.input_len,
            output_len=args.output_len,
            range_ratio=args.range_ratio,
            concurrency=args.concurrency,
            request_rate=args.request_rate,
            burstiness=args.burstiness,
            num_prompts=args.num_prompts,
            duration_s=args.duration,
            warmup_s=args.warmup_seconds,
            steady_warmup=args.steady_warmup,
            seed=args.seed,
            ignore_eos=args.ignore_eos,
            percentile_metrics=tuple(m.strip() for m in args.percentile_metrics.split(",") if m.strip()),
            percentiles=parse_floats(args.metric_percentiles, "--metric-percentiles"),
            time_scale=args.time_scale if args.time_scale is not None else env_time_scale(),
            allow_non_loopback=args.allow_non_loopback,
            ready_timeout_s=args.ready_timeout,
            prompt_lengths=prompts,
            output_lengths=outputs,
            max_model_len=args.max_model_len,
            trace=trace,
            trace_speed_percent=args.trace_speed_percent,
            goodput_ms=goodput,
        )
    except (ValueError, OSError, argparse.ArgumentTypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return execute(spec, result_file=args.result_file, termination_path=args.termination_message_path, quiet=args.quiet)


def summarize(path: str, termination_path: str | None) -> int:
    """The compact summary of a `vllm bench serve` result file, with its window in wall-clock seconds.

    vLLM writes `date` (local time, second resolution) when the benchmark ends and `duration` (the
    benchmark's own length, warm-ups excluded): the window is [date - duration, date]. Every request
    of a bench run finishes before it ends, so none is in flight.
    """
    import json
    from datetime import datetime

    from batchtune.files import InputFileError, expect, read_json
    from batchtune.loadgen import compact_summary

    termination = os.environ.get(TERMINATION_ENV) or termination_path or None
    try:
        result = expect(read_json(path, nonfinite=True), dict, path)  # vLLM writes Infinity for an unbounded rate
        completed = int(result.get("completed") or 0)
        result.setdefault("samples", completed)
        result.setdefault("in_flight", 0)
        if "measure_end" not in result and result.get("date") and result.get("duration"):
            end = datetime.strptime(str(result["date"]), "%Y%m%d-%H%M%S").astimezone().timestamp()
            result["measure_end"] = end
            result["measure_start"] = end - float(result["duration"])
        text = compact_summary(result)
    except (ValueError, TypeError, OverflowError) as exc:
        where = str(exc) if isinstance(exc, InputFileError) else f"{path}: {exc}"
        print(f"error: {where}", file=sys.stderr)
        if termination:
            write_file(termination, json.dumps({"error": where[:3500]}))
        return 2
    if termination:
        write_file(termination, text)
    print(text)
    return 0 if result.get("samples") else 1
