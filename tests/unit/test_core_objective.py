"""Objective values: each objective reads its own figure, and reads unknown as unknown."""

from __future__ import annotations

import math

import pytest

from batchtune.core.objective import Objective, objective_value
from batchtune.core.vocabulary import M


@pytest.mark.parametrize("objective, metrics, expected", [
    pytest.param(Objective.SLO_CAPACITY, {M.SLO_CAPACITY: 12.5, M.REQUEST_THROUGHPUT: 20.0}, 12.5, id="capacity"),
    pytest.param(Objective.SLO_CAPACITY, {M.REQUEST_THROUGHPUT: 7.0}, 7.0, id="capacity-falls-back-to-throughput"),
    pytest.param(Objective.OUTPUT_THROUGHPUT, {M.OUTPUT_THROUGHPUT: 1800.0}, 1800.0, id="throughput"),
    pytest.param(Objective.GPU_UTILIZATION, {M.SM_ACTIVE_PERCENT: 61.0, M.GPU_UTIL_PERCENT: 99.0}, 61.0,
                 id="sm-active-preferred"),
    pytest.param(Objective.GPU_UTILIZATION, {M.GPU_UTIL_PERCENT: 87.0}, 87.0, id="gpu-util-without-prof-counters"),
    pytest.param(Objective.TOKENS_PER_JOULE, {M.OUTPUT_THROUGHPUT: 1500.0, M.POWER_WATTS: 600.0}, 2.5,
                 id="tokens-per-joule-over-all-gpus-watts"),
    pytest.param(Objective.GOODPUT, {M.GOODPUT: 4.2, M.SLO_CAPACITY: 5.0, M.REQUEST_THROUGHPUT: 5.0}, 4.2,
                 id="goodput-is-the-good-requests-only"),
])
def test_each_objective_reads_its_figure(objective, metrics, expected):
    assert objective_value(objective, metrics) == pytest.approx(expected)


@pytest.mark.parametrize("objective, metrics", [
    pytest.param(Objective.GPU_UTILIZATION, {}, id="no-gpu-signal"),
    pytest.param(Objective.GPU_UTILIZATION, {M.SM_ACTIVE_PERCENT: math.nan}, id="nan"),
    pytest.param(Objective.TOKENS_PER_JOULE, {M.OUTPUT_THROUGHPUT: 100.0}, id="no-power"),
    pytest.param(Objective.TOKENS_PER_JOULE, {M.OUTPUT_THROUGHPUT: 100.0, M.POWER_WATTS: 0.0}, id="zero-watts"),
    pytest.param(Objective.OUTPUT_THROUGHPUT, {M.OUTPUT_THROUGHPUT: math.inf}, id="inf"),
    pytest.param(Objective.GOODPUT, {M.SLO_CAPACITY: 5.0, M.REQUEST_THROUGHPUT: 5.0},
                 id="goodput-never-falls-back-to-throughput"),
])
def test_unknown_is_none_never_a_number(objective, metrics):
    assert objective_value(objective, metrics) is None


def test_more_tokens_per_joule_ranks_higher():
    frugal = objective_value(Objective.TOKENS_PER_JOULE, {M.OUTPUT_THROUGHPUT: 1000.0, M.POWER_WATTS: 400.0})
    hungry = objective_value(Objective.TOKENS_PER_JOULE, {M.OUTPUT_THROUGHPUT: 1200.0, M.POWER_WATTS: 700.0})
    assert frugal is not None and hungry is not None and frugal > hungry


def test_goodput_searches_capacity_as_slo_capacity_does():
    assert Objective.GOODPUT.searches_capacity and Objective.SLO_CAPACITY.searches_capacity
    assert not any(o.searches_capacity for o in (Objective.OUTPUT_THROUGHPUT, Objective.GPU_UTILIZATION,
                                                 Objective.TOKENS_PER_JOULE))
