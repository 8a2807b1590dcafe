"""The VllmBench generator: `vllm bench serve` from the target's image, summarised by the operator's image."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime
from pathlib import Path

from batchtune.core.manifests import LoadProfile, build_bench_job
from batchtune.engines import VLLM

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "golden" / "vllm-0.32.0-cpu" / "bench-result.json"


def job(**profile: object) -> dict:
    return build_bench_job(VLLM, "bt", "uid", "ns", 2, "bt-trial-2-s0r0a0", image="vllm/vllm-openai:v0.32.0",
                           operator_image="batchtune:0.1.0", base_url="http://10.0.0.5:8000", model="llama",
                           tokenizer="/models/llama", profile=LoadProfile(**profile))  # type: ignore[arg-type]


def test_the_bench_runs_without_a_shell_and_saves_its_result_for_the_summary():
    spec = job(concurrency=8, input_tokens=256, output_tokens=64)["spec"]["template"]["spec"]
    bench, = spec["initContainers"]
    summary, = spec["containers"]
    assert bench["image"] == "vllm/vllm-openai:v0.32.0" and bench["command"] == ["vllm"]
    argv = bench["args"]
    assert argv[:2] == ["bench", "serve"] and "sh" not in bench["command"]
    flag = lambda name: argv[argv.index(name) + 1]  # noqa: E731  # a lookup for the asserts below
    assert (flag("--max-concurrency"), flag("--random-input-len"), flag("--random-output-len")) == ("8", "256", "64")
    assert flag("--tokenizer") == "/models/llama" and flag("--model") == "llama"
    assert flag("--result-dir") == "/tmp" and flag("--result-filename") == "result.json" and "--save-result" in argv
    assert int(flag("--num-prompts")) >= 100 and "--request-rate" not in argv
    assert summary["image"] == "batchtune:0.1.0"
    assert summary["args"][:3] == ["loadgen", "--summarize-result", "/tmp/result.json"]
    for container in (bench, summary):
        assert container["securityContext"]["runAsNonRoot"] and container["securityContext"]["capabilities"] == {
            "drop": ["ALL"]}
    assert spec["automountServiceAccountToken"] is False


def test_an_open_loop_sends_the_rate_and_enough_prompts_for_the_window():
    argv = job(requests_per_minute=120, duration_seconds=90)["spec"]["template"]["spec"]["initContainers"][0]["args"]
    assert argv[argv.index("--request-rate") + 1] == "2" and int(argv[argv.index("--num-prompts") + 1]) >= 180


def test_production_burstiness_and_the_slo_goodput_reach_vllm_bench():
    argv = job(requests_per_minute=120, burstiness=0.4, goodput_ms=(("ttft", 2000), ("tpot", 50)))[
        "spec"]["template"]["spec"]["initContainers"][0]["args"]
    assert argv[argv.index("--burstiness") + 1] == "0.4"
    i = argv.index("--goodput")
    assert argv[i + 1:i + 3] == ["ttft:2000", "tpot:50"]
    closed = job(concurrency=4)["spec"]["template"]["spec"]["initContainers"][0]["args"]
    assert "--burstiness" not in closed and "--goodput" not in closed  # closed loop: no arrivals to shape


def test_a_real_bench_result_becomes_the_operators_summary(tmp_path):
    out = tmp_path / "termination"
    done = subprocess.run([sys.executable, "-m", "batchtune", "loadgen", "--summarize-result", str(GOLDEN),
                           "--termination-message-path", str(out)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    summary = json.loads(out.read_text())
    real = json.loads(GOLDEN.read_text())
    end = datetime.strptime(real["date"], "%Y%m%d-%H%M%S").astimezone().timestamp()
    assert summary["measure_end"] == end and abs(summary["measure_start"] - (end - real["duration"])) < 1e-3
    assert summary["samples"] == real["completed"] and summary["in_flight"] == 0
    assert summary["p99_itl_ms"] == round(real["p99_itl_ms"], 3)


def test_a_missing_or_broken_result_is_an_error_naming_the_file(tmp_path):
    broken = tmp_path / "result.json"
    broken.write_text("{not json")
    out = tmp_path / "termination"
    for path in (tmp_path / "missing.json", broken):
        done = subprocess.run([sys.executable, "-m", "batchtune", "loadgen", "--summarize-result", str(path),
                               "--termination-message-path", str(out)], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and str(path) in done.stderr and "Traceback" not in done.stderr
        assert str(path) in json.loads(out.read_text())["error"]


def test_the_generator_process_ends_when_its_summary_is_written_without_the_interpreters_teardown(tmp_path):
    # The operator reads a run once its process has ended; the teardown (0.15 s of CPU) is seconds on a starved node.
    # An exit hook stands for the teardown: run as the process it is skipped, called in-process it is not.
    out = tmp_path / "termination"
    script = ("import atexit, sys; atexit.register(lambda: print('teardown', file=sys.stderr)); "
              "from batchtune.cli import main; how = sys.argv.pop(1); "
              "sys.exit(main(None if how == 'process' else sys.argv[1:]))")
    args = ["loadgen", "--summarize-result", str(GOLDEN), "--termination-message-path", str(out)]
    for how in ("process", "in-process"):
        out.unlink(missing_ok=True)
        done = subprocess.run([sys.executable, "-c", script, how, *args], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert ("teardown" in done.stderr) == (how == "in-process"), (how, done.stderr)
        # Nothing it said is lost: the summary reached the pipe (flushed before the exit) and the file.
        assert json.loads(done.stdout) == json.loads(out.read_text()), how
