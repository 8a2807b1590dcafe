"""The oracle cache's key covers every input that changes a noise-free evaluation."""

from __future__ import annotations

from dataclasses import replace

from batchtune.bench.cache import cache_key, fingerprint_sources, load_into, save_from
from batchtune.bench.evaluate import Judge
from batchtune.bench.reality import PerturbedTruth
from batchtune.bench.scenarios import KnobGrid, Scenario
from batchtune.bench.synthetic import SyntheticTruth
from batchtune.bench.twin_truth import TwinTruth
from batchtune.bench.types import Knobs, Slo

TINY = Scenario(
    name="tiny", summary="synthetic", model="Llama-3.1-8B", gpu="H100", input_len=512, output_len=128,
    slo=Slo({"p95_ttft_ms": 500.0}), tuner_space=KnobGrid((8, 32), (90,)), oracle_space=KnobGrid((8, 32), (90,)),
    sim_window_s=10.0,
)


def test_a_truth_without_a_description_is_keyed_by_its_fields() -> None:
    # A smaller GPU holds less: its evaluations must not be read from the larger one's cache.
    assert cache_key(Judge(TINY, SyntheticTruth())) != cache_key(Judge(TINY, SyntheticTruth(memory_gib=40.0)))
    assert cache_key(Judge(TINY, SyntheticTruth())) == cache_key(Judge(TINY, SyntheticTruth()))


def test_the_reality_the_scenario_the_slo_and_the_window_are_in_the_key() -> None:
    base = cache_key(Judge(TINY, PerturbedTruth(truth_seed=1)))
    assert base != cache_key(Judge(TINY, PerturbedTruth(truth_seed=2)))
    assert base != cache_key(Judge(TINY, TwinTruth()))
    assert base != cache_key(Judge(replace(TINY, slo=Slo({"p95_ttft_ms": 450.0})), PerturbedTruth(truth_seed=1)))
    assert base != cache_key(Judge(TINY, PerturbedTruth(truth_seed=1), window_s=30.0))


def test_the_judges_own_code_is_in_the_fingerprint() -> None:
    names = {p.name for p in fingerprint_sources()}
    # The judge (burst rule, shared evaluations), the truths' measurement code and the scenarios' derived figures
    # decide an evaluation as much as the twin does, and so does where the oracle starts each search (its hints).
    assert {"evaluate.py", "twin_truth.py", "reality.py", "loadsearch.py", "oracle.py", "scenarios.py", "types.py",
            "predict.py", "memory.py"} <= names
    assert "guide.py" not in names  # the strategies' side keeps the cache
    assert all(p.is_file() for p in fingerprint_sources())


def test_a_cached_evaluation_comes_back_only_to_the_same_truth(tmp_path) -> None:
    judge = Judge(TINY, SyntheticTruth())
    judge.objective(Knobs(8, 90))
    assert save_from(judge, tmp_path) is not None
    assert load_into(Judge(TINY, SyntheticTruth()), tmp_path) == 1
    assert load_into(Judge(TINY, SyntheticTruth(memory_gib=40.0)), tmp_path) == 0


def test_the_policy_oracle_picks_the_same_from_a_warm_cache(tmp_path) -> None:
    # The policy judges each setting's figures (latencies at its capacity), not only its objective: a cache that
    # dropped the readings made every warm run's policy pick nothing, and every policy regret 0.
    from batchtune.bench.policy import policy_pick, tightened

    scenario = replace(TINY, load_kind="request_rate")
    truth = SyntheticTruth()
    cold_tight = Judge(tightened(scenario, 10), truth)
    cold = policy_pick(Judge(scenario, truth), truth, tight_judge=cold_tight)
    assert cold.knobs is not None
    assert save_from(cold_tight, tmp_path) is not None
    warm_tight = Judge(tightened(scenario, 10), truth)
    assert load_into(warm_tight, tmp_path) == len(scenario.tuner_space.grid())
    warm = policy_pick(Judge(scenario, truth), truth, tight_judge=warm_tight)
    assert warm_tight.evaluations == 0  # every evaluation came from the cache
    assert (warm.knobs, warm.objective) == (cold.knobs, cold.objective)
