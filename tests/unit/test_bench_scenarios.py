"""The benchmark's scenario suite is well-formed and covers the cases the issue asks for."""

from __future__ import annotations

import pytest

from batchtune.bench.evaluate import slo_targets
from batchtune.bench.scenarios import SCENARIOS, KnobGrid, Scenario, get_scenarios
from batchtune.bench.types import Knobs, Load, Slo


def test_suite_has_at_least_twelve_uniquely_named_scenarios() -> None:
    names = [s.name for s in SCENARIOS]
    assert len(names) >= 12
    assert len(set(names)) == len(names)


@pytest.mark.parametrize(
    "tag",
    [
        pytest.param("tight", id="tight-slo"),
        pytest.param("loose", id="loose-slo"),
        pytest.param("long-output", id="long-output"),
        pytest.param("short-output", id="short-output"),
        pytest.param("kv-bound", id="kv-bound"),
        pytest.param("gmu-below-max", id="gmu-below-max"),
        pytest.param("throughput-objective", id="throughput-objective"),
    ],
)
def test_suite_covers(tag: str) -> None:
    assert any(tag in s.tags for s in SCENARIOS)


def test_flagged_cases_carry_their_checks() -> None:
    assert any(s.expect_best_gmu_below_max for s in SCENARIOS)
    assert all(s.expect_preemptions for s in SCENARIOS if "kv-bound" in s.tags)


@pytest.mark.parametrize("scenario", [pytest.param(s, id=s.name) for s in SCENARIOS])
def test_scenario_resolves_in_the_twin_catalog_and_the_core(scenario: Scenario) -> None:
    from batchtune.twin.catalog import get_gpu, get_model

    get_gpu(scenario.gpu)
    get_model(scenario.model)
    targets = slo_targets(scenario, headroom_pct=10)
    assert targets.latency_targets(), "every scenario has a latency target the core can check"
    assert scenario.tuner_space.size <= scenario.oracle_space.size * 2
    # The oracle's grid is at least as fine as the tuners' in every knob.
    assert len(scenario.oracle_space.max_num_seqs) >= len(scenario.tuner_space.max_num_seqs)
    assert len(scenario.oracle_space.gpu_memory_utilization_pct) >= len(scenario.tuner_space.gpu_memory_utilization_pct)


def test_quick_subset_is_small_and_named_lookup_keeps_order() -> None:
    quick = get_scenarios(quick=True)
    assert 1 <= len(quick) < len(SCENARIOS)
    picked = get_scenarios([SCENARIOS[2].name, SCENARIOS[0].name])
    assert [s.name for s in picked] == [SCENARIOS[2].name, SCENARIOS[0].name]


def test_unknown_scenario_names_are_listed() -> None:
    with pytest.raises(ValueError, match="nope"):
        get_scenarios(["nope"])


@pytest.mark.parametrize(
    ("build", "match"),
    [
        pytest.param(lambda: Knobs(0, 90), "max_num_seqs", id="knobs-seqs"),
        pytest.param(lambda: Knobs(8, 101), "gpu_memory_utilization_pct", id="knobs-gmu"),
        pytest.param(lambda: Load("request_rate", 0.0), "load value", id="load-zero"),
        pytest.param(lambda: Slo({}), "at least one", id="slo-empty"),
        pytest.param(lambda: Slo({"p95_ttft": 10.0}), "p95_ttft", id="slo-key"),
        pytest.param(lambda: KnobGrid((16, 8), (90,)), "ascending", id="space-order"),
        pytest.param(lambda: KnobGrid((8,), ()), "gpu_memory_utilization_pct", id="space-empty"),
        pytest.param(
            lambda: Scenario("x", "x", "Llama-3.1-8B", "H100", 10, 10, Slo({"p95_itl_ms": 1.0}), objective="throughput"),
            "fixed load", id="throughput-without-load",
        ),
    ],
)
def test_invalid_values_name_the_field(build, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build()


@pytest.mark.parametrize(
    ("metrics", "met"),
    [
        pytest.param({"p95_ttft_ms": 99.0, "p95_itl_ms": 10.0}, True, id="within"),
        pytest.param({"p95_ttft_ms": 101.0, "p95_itl_ms": 10.0}, False, id="ttft-over"),
        pytest.param({"p95_ttft_ms": 99.0}, False, id="missing-never-passes"),
        pytest.param({"p95_ttft_ms": float("nan"), "p95_itl_ms": 10.0}, False, id="nan-never-passes"),
        pytest.param({}, False, id="empty"),
    ],
)
def test_slo_met_by(metrics: dict, met: bool) -> None:
    assert Slo({"p95_ttft_ms": 100.0, "p95_itl_ms": 20.0}).met_by(metrics) is met
