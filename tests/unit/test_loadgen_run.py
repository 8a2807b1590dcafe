"""The load generator end to end: `vllm bench serve` through the twin shim, Poisson arrivals, the loopback rule."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from batchtune.cli import main
from batchtune.loadgen import LoadRun, run_load
from batchtune.twin.config import ServeConfig
from batchtune.twin.engine import SimEngine
from batchtune.twin.server import ServerOptions, TwinServer

MODEL = "Qwen/Qwen2.5-0.5B-Instruct"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def twin_process():
    port = _free_port()
    env = {**os.environ, "BATCHTUNE_TIME_SCALE": "20", "BATCHTUNE_GPU_PRODUCT": "NVIDIA-H100-80GB-HBM3"}
    env.pop("BATCHTUNE_POD_IP", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchtune", "twin", "vllm", "vllm", "serve", MODEL, "--host", "0.0.0.0", "--port",
         str(port), "--max-num-seqs", "32", "--max-model-len", "4096", "--twin-load-seconds", "0"],  # fmt: skip
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as resp:
                if resp.status == 200:
                    break
        except OSError:
            time.sleep(0.1)
    yield proc, port
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_vllm_bench_serve_through_the_shim(twin_process, tmp_path, monkeypatch):
    proc, port = twin_process
    monkeypatch.setenv("BATCHTUNE_TIME_SCALE", "20")
    term = tmp_path / "term"
    code = main(["twin", "vllm", "vllm", "bench", "serve", "--host", "127.0.0.1", "--port", str(port),
                 "--dataset-name", "random", "--random-input-len", "128", "--random-output-len", "16",
                 "--num-prompts", "24", "--max-concurrency", "4", "--ignore-eos", "--save-result", "--result-dir",
                 str(tmp_path), "--result-filename", "bench.json", "--percentile-metrics", "ttft,tpot,itl,e2el",
                 "--metric-percentiles", "50,95,99", "--termination-message-path", str(term)])  # fmt: skip
    assert code == 0
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["completed"] == 24 and result["failed"] == 0 and result["model_id"] == MODEL
    for key in ("request_throughput", "output_throughput", "total_token_throughput", "duration", "median_ttft_ms",
                "p95_itl_ms", "p99_e2el_ms", "std_tpot_ms", "p50_ttft_ms"):  # fmt: skip
        assert isinstance(result[key], float) and result[key] > 0, key
    summary = term.read_text()
    assert len(summary.encode()) < 4096 and json.loads(summary)["completed"] == 24
    # The twin stops cleanly on SIGTERM.
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=15)
    assert proc.returncode == 0, out
    assert "GPU KV cache size:" in out and "Maximum concurrency for 4,096 tokens per request" in out
    assert f"Starting vLLM API server 0 on http://127.0.0.1:{port}" in out  # 0.0.0.0 narrowed to loopback


def test_refuses_non_loopback_target_without_dialing(tmp_path):
    term = tmp_path / "term"
    code = main(["loadgen", "--base-url", "http://10.1.2.3:8000", "--num-prompts", "1", "--termination-message-path",
                 str(term)])  # fmt: skip
    assert code == 2
    assert "--allow-non-loopback" in json.loads(term.read_text())["error"]


@pytest.mark.wallclock
def test_poisson_rate_and_duration_bound():
    rate, duration, scale = 10.0, 10.0, 4.0

    async def go():
        cfg = ServeConfig(model=MODEL, gpu="H100-SXM", max_num_seqs=64, max_model_len=4096)
        server = TwinServer(SimEngine(cfg), ServerOptions(served_model_name=MODEL, port=0, time_scale=scale,
                                                       stats_log_interval_s=0), on_log=lambda *_a: None)  # fmt: skip
        await server.start()
        server.mark_ready()
        try:
            spec = LoadRun(base_url=f"http://127.0.0.1:{server.bound_port}", input_len=64, output_len=400,
                            request_rate=rate, num_prompts=10**6, duration_s=duration, time_scale=scale, seed=3)
            started = time.monotonic()
            result = await run_load(spec)
            return result, time.monotonic() - started
        finally:
            await server.stop()

    result, wall = asyncio.run(asyncio.wait_for(go(), timeout=60))
    assert wall < duration / scale + 2.0  # the hard stop holds even with requests in flight
    assert result["stopped_by_duration"] is True
    assert 0.6 * rate * duration <= result["requests_sent"] <= 1.4 * rate * duration
    assert result["duration"] == pytest.approx(duration, rel=0.05)
    assert result["completed"] > 0 and result["failed"] == 0


def _fake_count(text: str) -> int:
    # A tokenizer that splits words longer than three letters in two, unlike the twin's 1.3 rule.
    return sum(2 if len(word) > 3 else 1 for word in text.split())


class _Engine:
    """A minimal OpenAI-style server with its own tokenizer: records the prompts it was sent."""

    def __init__(self, tokenize: bool) -> None:
        self.tokenize, self.prompts, self.tokenized = tokenize, [], []

    async def serve(self):
        from aiohttp import web

        async def models(_request):
            return web.json_response({"data": [{"id": "tiny"}]})

        async def tokenize(request):
            body = await request.json()
            self.tokenized.append(body)
            return web.json_response({"count": _fake_count(body["prompt"]), "max_model_len": 4096})

        async def completions(request):
            body = await request.json()
            self.prompts.append(body["prompt"])
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for _ in range(body["max_tokens"]):
                await resp.write(b'data: {"choices": [{"text": " x"}]}\n\n')
            await resp.write(b"data: [DONE]\n\n")
            return resp

        app = web.Application()
        app.router.add_get("/v1/models", models)
        app.router.add_post("/v1/completions", completions)
        if self.tokenize:
            app.router.add_post("/tokenize", tokenize)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner, site._server.sockets[0].getsockname()[1]


@pytest.mark.parametrize("tokenize", [True, False], ids=["engine-tokenizer", "no-tokenizer-twin-rule"])
def test_prompts_are_the_requested_length_in_the_engines_own_tokens(tokenize):
    engine = _Engine(tokenize)

    async def go():
        runner, port = await engine.serve()
        try:
            spec = LoadRun(base_url=f"http://127.0.0.1:{port}", input_len=100, output_len=2, range_ratio=0.5,
                            concurrency=2, num_prompts=12, duration_s=30, seed=5)
            return await run_load(spec)
        finally:
            await runner.cleanup()

    result = asyncio.run(asyncio.wait_for(go(), timeout=30))
    assert result["completed"] == 12 and all(isinstance(p, str) for p in engine.prompts)  # text, as production's
    served = sum(_fake_count(p) for p in engine.prompts)
    if tokenize:
        assert all(b["add_special_tokens"] is False and b["model"] == "tiny" for b in engine.tokenized)
        assert served == result["total_input_tokens"]  # exact, in the engine's tokens
        assert len({_fake_count(p) for p in engine.prompts}) > 1 and len({p[:40] for p in engine.prompts}) == 12
    else:
        assert served > 1.2 * result["total_input_tokens"]  # the twin's rule, off on this tokenizer
