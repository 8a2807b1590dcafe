"""Load generator statistics, prompt sizing and the loopback-only rule."""

from __future__ import annotations

import json
import math
import random
from array import array

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchtune.loadgen import (
    ClientWindow,
    LoadRun,
    RequestRecord,
    TargetRefused,
    censored_quantile,
    censored_quantiles,
    check_target,
    compact_summary,
    compute_result,
)
from batchtune.loadgen.prompts import (
    FILLER_WORDS,
    Prompts,
    count_text_tokens,
    make_prompt,
    tokens_for_words,
    words_for_tokens,
)
from batchtune.loadgen.stats import percentile_key


def _record(sent, ttft, itls, prompt=100, ok=True):
    rec = RequestRecord(sent_at=sent, prompt_tokens=prompt, success=ok, ttft_s=ttft)
    rec.itls_s = array("d", itls)
    rec.output_tokens = len(itls) + 1
    rec.e2el_s = ttft + sum(itls)
    rec.finished_at = sent + rec.e2el_s
    if not ok:
        rec.error = "HTTP 500: boom"
    return rec


def test_result_has_vllm_bench_keys_and_values():
    records = [_record(0.0, 0.1, [0.02] * 9), _record(1.0, 0.3, [0.04] * 9)]
    window = ClientWindow(start=0.0, end=2.0, output_tokens=20)
    result = compute_result(records, window)
    assert result["completed"] == 2 and result["failed"] == 0
    assert result["duration"] == pytest.approx(2.0)
    assert result["request_throughput"] == pytest.approx(1.0)
    assert result["output_throughput"] == pytest.approx(10.0)
    assert result["total_token_throughput"] == pytest.approx(110.0)
    assert result["mean_ttft_ms"] == pytest.approx(200.0)
    assert result["median_itl_ms"] == pytest.approx(30.0)
    assert result["p99_itl_ms"] == pytest.approx(40.0)
    assert result["mean_tpot_ms"] == pytest.approx(30.0)
    for key in ("std_ttft_ms", "p50_ttft_ms", "p90_tpot_ms", "p95_e2el_ms", "p99_e2el_ms"):
        assert key in result


def test_time_scale_turns_wall_times_into_simulated_times():
    records = [_record(0.0, 0.01, [0.002] * 4)]
    plain = compute_result(records, ClientWindow(0.0, 1.0, 5))
    scaled = compute_result(records, ClientWindow(0.0, 1.0, 5), time_scale=10.0)
    assert scaled["mean_ttft_ms"] == pytest.approx(10 * plain["mean_ttft_ms"])
    assert scaled["output_throughput"] == pytest.approx(plain["output_throughput"] / 10)
    assert scaled["duration"] == pytest.approx(10.0)


def test_window_excludes_warmup_from_latency_and_counts_failures():
    warm = _record(0.0, 2.0, [0.02] * 4)  # sent in warm-up, ends inside the window
    good = _record(2.0, 0.1, [0.02] * 4)
    bad = _record(2.5, 0.0, [], ok=False)
    result = compute_result([warm, good, bad], ClientWindow(start=1.0, end=4.0, output_tokens=8))
    assert result["completed"] == 2  # both ended in the window
    assert result["failed"] == 1
    assert result["mean_ttft_ms"] == pytest.approx(100.0)  # only the request sent in the window
    assert result["errors_sample"] == ["HTTP 500: boom"]


def test_an_empty_sample_gives_no_statistic_never_zero():
    # vllm bench serve reports 0 ms here; an empty window read as "0 ms" once passed an overloaded step.
    result = compute_result([], ClientWindow(0.0, 1.0, 0))
    assert result["completed"] == 0 and result["samples"] == 0
    assert result["mean_ttft_ms"] is None and result["p95_e2el_ms"] is None and result["p99_itl_ms"] is None
    assert "p95_e2el_ms" not in json.loads(compact_summary(result))


def _running(sent: float, first_token: float | None = None) -> RequestRecord:
    """A request still streaming (or queued) when the window ends."""
    r = RequestRecord(sent_at=sent, prompt_tokens=10)
    if first_token is not None:
        r.ttft_s = first_token - sent
        r.last_token_at = first_token
    return r


def test_an_overloaded_window_where_nothing_finished_reads_slow_not_fast():
    # Every request was sent inside the window and none finished: elapsed times are lower bounds.
    records = [_running(1.0 + i * 0.1) for i in range(30)]
    result = compute_result(records, ClientWindow(start=1.0, end=31.0, output_tokens=0))
    assert result["completed"] == 0 and result["in_flight"] == 30 and result["samples"] == 30
    assert result["p95_ttft_ms"] == math.inf and result["p95_e2el_ms"] == math.inf
    assert json.loads(compact_summary(result))["p95_ttft_ms"] == 1e12


def test_requests_still_running_count_against_the_percentiles():
    # Survivorship: the 10 fast ones finished; the 10 slow ones are still running 20 s after they were sent.
    fast = [_record(1.0 + i * 0.01, 0.05, [0.01] * 4) for i in range(10)]
    slow = [_running(1.0 + i * 0.01, first_token=1.5 + i * 0.01) for i in range(10)]
    only_fast = compute_result(fast, ClientWindow(start=1.0, end=21.0, output_tokens=40))
    both = compute_result(fast + slow, ClientWindow(start=1.0, end=21.0, output_tokens=40))
    assert only_fast["p95_e2el_ms"] < 1000
    assert both["p95_e2el_ms"] == math.inf  # half the requests are past 20 s: p95 is beyond what was seen
    assert both["p95_itl_ms"] > 19000  # the gap since the slow requests' last token counts too
    assert both["samples"] == 20 and both["in_flight"] == 10


@pytest.mark.parametrize(("events", "censored", "q", "expected"), [
    pytest.param([1, 2, 3, 4], [], 0.5, 2, id="no-censoring-is-the-empirical-quantile"),
    pytest.param([1, 2, 3, 4], [10, 10], 0.5, 3, id="censored-above-push-it-up"),
    pytest.param([1, 2], [0.5, 0.5, 0.5], 0.5, 1, id="censored-below-leave-the-risk-set"),
    pytest.param([1], [5, 5, 5, 5], 0.95, math.inf, id="open-above-every-event"),
    pytest.param([], [], 0.5, math.inf, id="nothing-known"),
])
def test_censored_quantile(events, censored, q, expected):
    assert censored_quantile(events, censored, q) == expected


_latency = st.floats(min_value=0.0, max_value=30.0).map(lambda v: round(v, 2))  # ties, as whole milliseconds give


@given(st.lists(_latency, max_size=60), st.lists(_latency, max_size=30),
       st.lists(st.sampled_from([0.5, 0.9, 0.95, 0.99, 0.01, 1.0]), min_size=1, max_size=6))
def test_the_one_pass_quantiles_are_each_quantile_alone(events, censored, qs):
    # In any order, repeated or not: the walk takes them sorted and answers in the order asked (one alone is pinned
    # by test_censored_quantile's examples).
    assert censored_quantiles(events, censored, tuple(qs)) == tuple(censored_quantile(events, censored, q)
                                                                    for q in qs)


def test_the_summary_carries_the_window_in_wall_clock_seconds():
    records = [_record(2.0, 0.1, [0.02] * 4)]
    result = compute_result(records, ClientWindow(start=1.0, end=4.0, output_tokens=4), wall_offset=1_700_000_000.0)
    summary = json.loads(compact_summary(result))
    assert summary["measure_start"] == 1_700_000_001.0 and summary["measure_end"] == 1_700_000_004.0
    assert summary["samples"] == 1 and summary["in_flight"] == 0


@given(st.lists(st.floats(min_value=0.001, max_value=10.0), min_size=1, max_size=200))
def test_percentiles_are_ordered_and_bounded(values):
    rec = [_record(0.0, v, [v]) for v in values]
    result = compute_result(rec, ClientWindow(0.0, 100.0, len(values)))
    p = [result[f"p{q}_ttft_ms"] for q in (50, 90, 95, 99)]
    assert p == sorted(p)
    assert min(values) * 1000 - 1e-6 <= p[0] and p[-1] <= max(values) * 1000 + 1e-6
    assert result["median_ttft_ms"] == pytest.approx(np.median(values) * 1000)


@pytest.mark.parametrize(("p", "key"), [pytest.param(99, "p99", id="int"), pytest.param(99.9, "p99.9", id="decimal")])
def test_percentile_key(p, key):
    assert percentile_key(p) == key


def test_unknown_percentile_metric_is_named():
    with pytest.raises(ValueError, match="'foo'"):
        compute_result([], ClientWindow(0.0, 1.0, 0), percentile_metrics=("foo",))


def test_compact_summary_is_small_json():
    result = compute_result([_record(0.0, 0.1, [0.02] * 9)], ClientWindow(0.0, 1.0, 10))
    result["errors_sample"] = ["x" * 5000] * 5
    text = compact_summary(result)
    assert len(text.encode()) < 4096
    assert json.loads(text)["completed"] == 1


@given(st.integers(min_value=1, max_value=20000))
def test_prompt_sizing_is_within_one_token(tokens):
    words = words_for_tokens(tokens)
    assert tokens <= tokens_for_words(words) <= tokens + 1


def test_make_prompt_counts_and_varies():
    rng = random.Random(0)
    a, b = make_prompt(500, rng), make_prompt(500, rng)
    assert 500 <= count_text_tokens(a) <= 501
    assert a != b


@pytest.mark.parametrize(
    ("url", "allowed"),
    [
        pytest.param("http://127.0.0.1:8000", True, id="loopback"),
        pytest.param("http://127.3.4.5:8000", True, id="pod-ip"),
        pytest.param("http://localhost:8000", True, id="localhost"),
        pytest.param("http://[::1]:8000", True, id="ipv6-loopback"),
        pytest.param("http://10.0.0.1:8000", False, id="private"),
        pytest.param("http://vllm.default.svc:8000", False, id="dns-name"),
        pytest.param("http://0.0.0.0:8000", False, id="any"),
    ],
)
def test_loopback_only_by_default(url, allowed):
    if allowed:
        check_target(url, allow_non_loopback=False)
    else:
        with pytest.raises(TargetRefused, match="--allow-non-loopback"):
            check_target(url, allow_non_loopback=False)
        check_target(url, allow_non_loopback=True)


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"duration_s": 0}, id="duration"),
        pytest.param({"warmup_s": 700.0}, id="warmup-longer-than-duration"),
        pytest.param({"concurrency": 0}, id="concurrency"),
        pytest.param({"endpoint": "/v1/embeddings"}, id="endpoint"),
        pytest.param({"time_scale": 0}, id="time-scale"),
    ],
)
def test_invalid_spec_names_field(kwargs):
    field = next(iter(kwargs)).split("_s")[0]
    with pytest.raises(ValueError, match=field):
        LoadRun(**kwargs)


def test_goodput_counts_the_completed_requests_that_met_every_target():
    records = [_record(0.0, 0.1, [0.02] * 9),    # ttft 100, tpot 20, e2el 280: good
               _record(0.5, 0.6, [0.02] * 9),    # ttft 600: too slow to start
               _record(1.0, 0.1, [0.08] * 9),    # tpot 80: too slow to stream
               _record(1.5, 0.1, [], ok=True)]   # one token: no TPOT, judged on TTFT and E2E
    window = ClientWindow(start=0.0, end=4.0, output_tokens=40)
    result = compute_result(records, window, goodput_ms=(("ttft", 500.0), ("tpot", 50.0), ("e2el", 2000.0)))
    assert result["request_goodput"] == pytest.approx(2 / 4.0)
    assert result["request_throughput"] == pytest.approx(4 / 4.0)
    assert compute_result(records, window)["request_goodput"] is None  # no targets: not measured, never 0
    # At a time scale, the targets are in the simulated GPU's time, as every other figure.
    scaled = compute_result(records[:1], window, time_scale=10.0, goodput_ms=(("ttft", 500.0),))
    assert scaled["request_goodput"] == 0.0
    assert '"request_goodput"' in compact_summary(result)


def test_goodput_keys_are_vllms():
    from batchtune.cli.loadgen import parse_goodput

    assert parse_goodput("tpot:50") == ("tpot", 50.0)
    with pytest.raises(ValueError, match="'itl:50'"):
        parse_goodput("itl:50")
    with pytest.raises(ValueError, match="goodput_ms"):
        LoadRun(goodput_ms=(("ttft", -1.0),))


def test_prompts_sized_by_the_engines_word_costs_sum_to_the_request():
    costs = {w: (1 if len(w) <= 3 else 3) for w in FILLER_WORDS}
    prompts = Prompts(costs, first_word_tokens=2)  # "the" at a text's start costs 2 on this tokenizer

    def cost(prompt: str) -> int:
        words = prompt.split()
        return (2 if words[0] == FILLER_WORDS[0] else costs[words[0]]) + sum(costs[w] for w in words[1:])

    rng = random.Random(1)
    drawn = [prompts.make(n, rng) for n in (1, 2, 7, 300, 300)]
    assert prompts.exact and [cost(p) for p in drawn] == [1, 2, 7, 300, 300]
    assert all(p.startswith(FILLER_WORDS[0] + " ") for p in drawn[2:])  # the measured first word
    assert drawn[3][:40] != drawn[4][:40]  # a seeded draw: no shared prefix for the cache


@pytest.mark.parametrize("costs", [
    {}, {"the": 1}, {w: 2 for w in FILLER_WORDS}, {w: (0 if w == "the" else 1) for w in FILLER_WORDS},
    {w: (True if w == "the" else 1) for w in FILLER_WORDS},
], ids=["none", "some-words-unmeasured", "no-one-token-word-to-end-on", "a-free-word", "a-bool-is-no-count"])
def test_without_a_full_measurement_the_twin_rule_sizes_prompts(costs):
    prompts = Prompts(costs)
    text = prompts.make(50, random.Random(1))
    assert not prompts.exact and count_text_tokens(text) in (50, 51)
