"""What the load generator sends: sampled lengths, gamma arrivals, traces replayed as they are."""

from __future__ import annotations

import asyncio
import random
import statistics

import pytest

from batchtune.cli import main
from batchtune.core.workload import LengthDistribution, burstiness_from_counts, counts_to_cumulative
from batchtune.loadgen import LoadRun, run_load
from batchtune.loadgen.workload import (
    LengthSampler,
    TraceError,
    TraceRequest,
    arrival_gap,
    fit_context,
    parse_trace,
    synthesize_trace,
    trace_lines,
)
from batchtune.twin.config import ServeConfig
from batchtune.twin.engine import SimEngine
from batchtune.twin.server import ServerOptions, TwinServer

MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
LONG = LengthDistribution.from_cumulative(counts_to_cumulative([(500.0, 50), (1000.0, 450), (2000.0, 500)]))
CHAT = LengthDistribution.from_cumulative(counts_to_cumulative([(50.0, 120), (100.0, 400), (200.0, 380)]))


@pytest.mark.parametrize("burstiness", [0.3, 1.0, 3.0])
def test_gamma_gaps_have_the_rate_and_the_burstiness_asked(burstiness):
    rng = random.Random(11)
    gaps = [arrival_gap(rng, 4.0, burstiness) for _ in range(40_000)]
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(0.25, rel=0.03)
    cv2 = statistics.pvariance(gaps) / mean ** 2  # a gamma's squared coefficient of variation is 1/shape
    assert cv2 == pytest.approx(1 / burstiness, rel=0.1)


def test_the_profile_estimate_recovers_the_burstiness_the_generator_sent():
    # The loop closes: gamma arrivals at shape 0.5, counted per minute as Prometheus would, read back.
    trace = synthesize_trace(60_000, 5.0, 0.5, LengthSampler(10, 10), seed=4)
    windows = int(trace[-1].offset_seconds // 60)
    counts = [0.0] * windows
    for r in trace:
        if int(r.offset_seconds // 60) < windows:
            counts[int(r.offset_seconds // 60)] += 1
    assert burstiness_from_counts(counts) == pytest.approx(0.5, rel=0.2)


def test_arrivals_and_lengths_are_deterministic_per_seed():
    sampler = LengthSampler(100, 100, prompts=LONG, outputs=CHAT)
    one = synthesize_trace(50, 2.0, 0.7, sampler, seed=9)
    assert one == synthesize_trace(50, 2.0, 0.7, sampler, seed=9)
    assert one != synthesize_trace(50, 2.0, 0.7, sampler, seed=10)


def test_sampled_lengths_follow_the_histograms():
    rng = random.Random(2)
    draws = [LengthSampler(1, 1, prompts=LONG, outputs=CHAT).draw(rng) for _ in range(20_000)]
    prompts = sorted(p for p, _ in draws)
    outputs = sorted(o for _, o in draws)
    for q in (0.1, 0.5, 0.9):
        assert prompts[int(q * len(prompts))] == pytest.approx(LONG.quantile(q), rel=0.05)
        assert outputs[int(q * len(outputs))] == pytest.approx(CHAT.quantile(q), rel=0.06)


@pytest.mark.parametrize("prompt, output, context, expected", [
    pytest.param(1900, 200, 2048, (1847, 200), id="prompt-cut"),
    pytest.param(10, 5000, 2048, (1, 2046), id="output-cut-leaves-a-prompt"),
    pytest.param(100, 100, None, (100, 100), id="unknown-context"),
    pytest.param(100, 100, 4096, (100, 100), id="fits"),
])
def test_a_prompt_and_its_output_fit_the_context(prompt, output, context, expected):
    fitted = fit_context(prompt, output, context)
    assert fitted == expected
    if context:
        assert fitted[0] + 1 + fitted[1] <= context  # the twin may count one more prompt token


def test_fixed_lengths_keep_the_range_ratio_meaning():
    rng = random.Random(0)
    lengths = [LengthSampler(100, 10, range_ratio=0.5).draw(rng)[0] for _ in range(2000)]
    assert min(lengths) >= 50 and max(lengths) <= 150 and statistics.fmean(lengths) == pytest.approx(100, rel=0.05)
    assert LengthSampler(100, 10).draw(rng) == (100, 10)


def test_a_trace_error_never_echoes_the_configmaps_data():
    with pytest.raises(TraceError) as caught:
        parse_trace(['{"offset_seconds": 0, "prompt_tokens": "s3cr3t", "output_tokens": 1, "api_key_x": 1}'])
    assert "s3cr3t" not in str(caught.value) and "api_key_x" not in str(caught.value)
    with pytest.raises(TraceError) as caught:
        parse_trace(['{"offset_seconds": 0, "prompt_tokens": "s3cr3t", "output_tokens": 1}'])
    assert "s3cr3t" not in str(caught.value)


def test_a_trace_is_read_in_offset_order_and_round_trips():
    text = ('{"offset_seconds": 1.5, "prompt_tokens": 800, "output_tokens": 90}\n\n'
            '{"offset_seconds": 0, "prompt_tokens": 12, "output_tokens": 3}\n')
    trace = parse_trace(text.splitlines())
    assert trace == [TraceRequest(0.0, 12, 3), TraceRequest(1.5, 800, 90)]
    assert parse_trace(trace_lines(trace).splitlines()) == trace


@pytest.mark.parametrize("line, words", [
    pytest.param("not json", "line 2: not JSON", id="not-json"),
    pytest.param("[1, 2]", "line 2: not a JSON object", id="array"),
    pytest.param('{"offset_seconds": -1, "prompt_tokens": 1, "output_tokens": 1}', "offset_seconds must be", id="neg"),
    pytest.param('{"offset_seconds": 0, "prompt_tokens": true, "output_tokens": 1}', "prompt_tokens must be", id="bool"),
    pytest.param('{"offset_seconds": 0, "prompt_tokens": 1.5, "output_tokens": 1}', "prompt_tokens must be",
                 id="fraction"),
    pytest.param('{"offset_seconds": 0, "prompt_tokens": 1, "output_tokens": 0}', "output_tokens must be", id="zero"),
    pytest.param('{"offset_seconds": 0, "prompt_tokens": 1, "output_tokens": 1, "cmd": "x"}', "1 unknown key(s)",
                 id="unknown-key"),
    pytest.param('{"offset_seconds": NaN, "prompt_tokens": 1, "output_tokens": 1}', "offset_seconds", id="nan"),
])
def test_a_bad_trace_line_is_refused_by_number(line, words):
    with pytest.raises(TraceError, match=words.replace("(", r"\(").replace(")", r"\)")):
        parse_trace(["", line])  # line 2: blank lines count
    with pytest.raises(TraceError, match="holds no request"):
        parse_trace(["", " "])


def _against_the_twin(spec_kwargs: dict) -> dict:
    async def go():
        cfg = ServeConfig(model=MODEL, gpu="H100-SXM", max_num_seqs=64, max_model_len=4096)
        server = TwinServer(SimEngine(cfg), ServerOptions(served_model_name=MODEL, port=0, time_scale=50,
                                                       stats_log_interval_s=0), on_log=lambda *_a: None)
        await server.start()
        server.mark_ready()
        try:
            return await run_load(LoadRun(base_url=f"http://127.0.0.1:{server.bound_port}", time_scale=50,
                                           **spec_kwargs))
        finally:
            await server.stop()

    return asyncio.run(asyncio.wait_for(go(), timeout=60))


def test_a_trace_is_replayed_as_is():
    trace = tuple(TraceRequest(0.2 * i, 50 + 10 * i, 4 + i % 3) for i in range(30))
    result = _against_the_twin({"trace": trace, "num_prompts": 1000, "duration_s": 600})
    assert result["requests_sent"] == 30 and result["completed"] == 30 and result["length_source"] == "trace"
    sent = sum(r.prompt_tokens for r in trace)
    assert sent <= result["total_input_tokens"] <= sent + 30  # the word rule may add one token a prompt
    assert result["total_output_tokens"] == sum(r.output_tokens for r in trace)


def test_histogram_lengths_reach_the_server(tmp_path):
    result = _against_the_twin({"prompt_lengths": CHAT, "output_lengths": CHAT, "concurrency": 8,
                                "num_prompts": 200, "duration_s": 600, "seed": 5})
    assert result["length_source"] == "histogram" and result["completed"] == 200
    mean_prompt = result["total_input_tokens"] / 200
    assert mean_prompt == pytest.approx(CHAT.bucket_mean(), rel=0.12)


def test_the_cli_refuses_a_bad_histogram_and_a_bad_trace(tmp_path, capsys):
    assert main(["loadgen", "--prompt-buckets", "100:x", "--num-prompts", "1"]) == 2
    assert "bucket '100:x' is not BOUND:COUNT" in capsys.readouterr().err
    assert main(["loadgen", "--output-buckets", "100:0", "--num-prompts", "1"]) == 2
    assert "--output-buckets: the histogram holds no request" in capsys.readouterr().err
    bad = tmp_path / "trace.jsonl"
    bad.write_text('{"offset_seconds": 0, "prompt_tokens": 1}\n')
    assert main(["loadgen", "--trace", str(bad), "--num-prompts", "1"]) == 2
    assert "trace line 1: output_tokens must be" in capsys.readouterr().err
