"""One load run's figures: client percentiles decide, histograms are kept, the two are cross-checked."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

import pytest

from batchtune.core.measurement import Window, measurement_window, missing, run_result
from batchtune.core.vocabulary import M

PROM = {M.ITL_MS: 48.85, M.REQUEST_THROUGHPUT: 2.0, M.OUTPUT_THROUGHPUT: 146.0}


def test_client_percentiles_decide_and_histograms_are_kept():
    result = run_result(PROM, {"completed": 99, "failed": 1, "p95_itl_ms": 28.7, "request_throughput": 2.0}, 95)
    metrics = result.metrics
    assert metrics[M.ITL_MS] == 28.7 and metrics[M.ITL_HISTOGRAM_MS] == 48.85
    assert metrics[M.ERROR_RATE_PERCENT] == pytest.approx(1.0)
    assert metrics[M.OUTPUT_THROUGHPUT] == 146.0
    assert result.cross_check is not None and "itlHistogramMs" in result.cross_check
    assert "requestThroughput" not in result.cross_check  # 2.0 vs 2.0 agree


@pytest.mark.parametrize("summary, expected", [
    pytest.param(None, {}, id="no-summary"),
    pytest.param({"completed": 0, "failed": 0}, {}, id="nothing-finished"),
    pytest.param({"completed": 90, "failed": 10}, {M.ERROR_RATE_PERCENT: 10.0}, id="errors"),
    pytest.param({"completed": 90}, {}, id="failed-count-missing"),
    pytest.param({"completed": 90, "failed": -1}, {}, id="negative-count"),
    pytest.param({"completed": 90, "failed": True}, {}, id="bool-is-no-count"),
    pytest.param({"samples": 120, "in_flight": 7, "offered_request_rate": 2.5},
                 {M.SAMPLES: 120.0, M.IN_FLIGHT: 7.0, M.OFFERED_REQUEST_RATE: 2.5}, id="samples-and-in-flight"),
    pytest.param({"samples": math.inf, "in_flight": math.nan}, {}, id="non-finite-dropped"),
    pytest.param({"p95_ttft_ms": 120.0, "p95_e2el_ms": 900.0, "p99_itl_ms": 50.0},
                 {M.TTFT_MS: 120.0, M.E2E_MS: 900.0}, id="only-the-slo-percentile"),
])
def test_summary_figures(summary, expected):
    metrics = run_result({M.REQUEST_THROUGHPUT: 2.0}, summary, 95).metrics
    extra = {k: v for k, v in metrics.items() if k != M.REQUEST_THROUGHPUT}
    assert extra == expected


def test_without_a_summary_the_error_rate_stays_unknown_and_prometheus_decides():
    result = run_result({M.ITL_MS: 20.0, M.REQUEST_THROUGHPUT: 1.0, M.OUTPUT_THROUGHPUT: 9.0, M.TTFT_MS: None}, None, 95)
    assert M.ERROR_RATE_PERCENT not in result.metrics and M.TTFT_MS not in result.metrics
    assert result.metrics[M.ITL_MS] == 20.0 and M.ITL_HISTOGRAM_MS not in result.metrics
    assert result.cross_check is None


@pytest.mark.parametrize("prom, summary, noted", [
    pytest.param({M.REQUEST_THROUGHPUT: 2.0}, {"request_throughput": 1.0}, "requestThroughput", id="throughput-apart"),
    pytest.param({M.REQUEST_THROUGHPUT: 2.0}, {"request_throughput": 1.6}, None, id="within-25-percent"),
    pytest.param({M.TTFT_MS: 300.0}, {"p95_ttft_ms": 100.0}, "ttftHistogramMs", id="ttft-apart"),
    pytest.param({M.E2E_MS: math.inf}, {"p95_e2el_ms": 100.0}, None, id="histogram-inf-is-not-compared"),
])
def test_cross_check(prom, summary, noted):
    note = run_result(prom, summary, 95).cross_check
    assert (note is None) if noted is None else (note is not None and noted in note)


def test_histogram_inf_is_replaced_by_the_client_percentile():
    metrics = run_result({M.E2E_MS: math.inf}, {"p95_e2el_ms": 100.0}, 95).metrics
    assert metrics[M.E2E_MS] == 100.0 and metrics[M.E2E_HISTOGRAM_MS] == math.inf


def test_histogram_inf_stays_without_a_client_percentile():
    assert run_result({M.E2E_MS: math.inf}, {"completed": 10, "failed": 0}, 95).metrics[M.E2E_MS] == math.inf


T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


@pytest.mark.parametrize("summary, started, finished, expected", [
    pytest.param({"measure_start": T0.timestamp() + 40, "measure_end": T0.timestamp() + 100}, T0, T0 + timedelta(seconds=200),
                 Window(T0 + timedelta(seconds=40), T0 + timedelta(seconds=100)), id="generator-window-wins"),
    pytest.param({"measure_start": T0.timestamp() + 100, "measure_end": T0.timestamp() + 40}, T0, T0 + timedelta(seconds=200),
                 Window(T0 + timedelta(seconds=30), T0 + timedelta(seconds=200)), id="backwards-window-falls-back"),
    pytest.param(None, T0, T0 + timedelta(seconds=200), Window(T0 + timedelta(seconds=30), T0 + timedelta(seconds=200)),
                 id="job-times-less-warmup"),
    pytest.param(None, T0, T0 + timedelta(seconds=20), None, id="job-ended-in-warmup"),
    pytest.param(None, None, T0, None, id="job-times-unknown"),
])
def test_measurement_window(summary, started, finished, expected):
    assert measurement_window(summary, started, finished, 30) == expected


def test_window_seconds_is_at_least_one():
    assert Window(T0, T0 + timedelta(seconds=59.9)).seconds == 59
    assert Window(T0, T0).seconds == 1


def test_missing_names_the_figures_a_decision_needs():
    assert missing({M.REQUEST_THROUGHPUT: 1.0, M.OUTPUT_THROUGHPUT: None, M.ITL_MS: 3.0}, (M.ITL_MS, M.TTFT_MS)) == \
        [M.OUTPUT_THROUGHPUT, M.TTFT_MS]
