"""The far ground truth (`bench.far_reality`, `--truth far`): deterministic per scenario and seed, each structure
moves the figures it should, the strategies' twin and the perturbed truth are untouched, and the oracle cache's
key hashes the module."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import subprocess
import sys
from contextlib import redirect_stdout
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from bench_fixtures import TINY

from batchtune.bench import far_reality as far
from batchtune.bench.cache import CACHE_VERSION, _twin_fingerprint, cache_key, truth_sources
from batchtune.bench.evaluate import Judge
from batchtune.bench.far_reality import STRUCTURES, FarEngine, FarReality, FarTruth, draw, far_reality
from batchtune.bench.reality import PerturbedTruth
from batchtune.bench.scenarios import get_scenarios
from batchtune.bench.twin_truth import TwinTruth
from batchtune.bench.types import Knobs, Load
from batchtune.twin.config import ServeConfig
from batchtune.twin.memory import plan_memory
from batchtune.twin.predict import memoised

CFG = ServeConfig(model="meta-llama/Llama-3.1-8B-Instruct", gpu="H100", max_num_seqs=64, max_model_len=4096)
SCENARIOS = get_scenarios(None)
SEEDS = range(6)
# Each structure with figures that bind in the tests below (a drawn reality has them only for its own 1-3).
FIGURES: dict[str, dict[str, Any]] = {
    "kv_superlinear": {"kv_superlinear_exponent": 0.2, "kv_superlinear_from_tokens": 32_768},
    "watermark": {"watermark": 0.05},
    "admit_cap": {"admit_per_step": 2},
    "frontend_contention": {"frontend_half_in_flight": 64.0},
    "periodic_stall": {"stall_every_steps": 10, "stall_s": 0.02},
}


def with_only(structure: str) -> FarReality:
    """A drawn reality with every structure dropped but `structure`, at FIGURES' values."""
    base = far_reality(TINY, 1)
    for s in base.structures:
        base = base.without(s)
    return dataclasses.replace(base, structures=(structure,), **FIGURES[structure])


def test_a_far_reality_is_drawn_deterministically_per_scenario_and_seed() -> None:
    for scenario in SCENARIOS[:4]:
        for seed in SEEDS:
            reality = draw(scenario.name, seed)
            assert reality == draw(scenario.name, seed) == far_reality(scenario, seed)
            assert 1 <= len(reality.structures) <= 3 and set(reality.structures) <= set(STRUCTURES)
            # A structure's figures are off exactly where it is not drawn.
            for structure in STRUCTURES:
                assert (reality.without(structure) != reality) == (structure in reality.structures), structure
    realities = {draw(s.name, seed) for s in SCENARIOS for seed in SEEDS}
    assert len(realities) == len(SCENARIOS) * len(SEEDS)  # every case its own world
    # Over the suite's cases every structure, and every count of them, occurs.
    assert {s for r in realities for s in r.structures} == set(STRUCTURES)
    assert {len(r.structures) for r in realities} == {1, 2, 3}
    truth = FarTruth(truth_seed=2)
    assert truth.describe(TINY) == FarTruth(truth_seed=2).describe(TINY) != FarTruth(truth_seed=3).describe(TINY)


def test_a_far_truths_readings_are_deterministic() -> None:
    truth = FarTruth(truth_seed=1)
    knobs, load = Knobs(32, 90), Load("request_rate", 8.0)

    def reading() -> dict[str, float]:
        return truth.measure(TINY, knobs, load, duration_s=4.0, seed=5, noise=0.03).metrics

    first = reading()
    with memoised():
        assert reading() == first == reading()  # memoised or not, the same figures
    assert truth.measure(TINY, knobs, load, duration_s=4.0, seed=5, noise=0.0).metrics != first  # noise applies


def test_kv_superlinear_slows_large_kv_reads_only() -> None:
    on, off = FarEngine(CFG, with_only("kv_superlinear"))._cost, FarEngine(CFG, with_only("kv_superlinear").without(
        "kv_superlinear"))._cost
    big = (64, 64, 200_000, 200_000.0)
    assert on.step_time(*big)[0] > off.step_time(*big)[0] * 1.05
    small = (64, 64, 20_000, 20_000.0)  # below the threshold
    assert on.step_time(*small)[0] == off.step_time(*small)[0]


def test_the_watermark_holds_blocks_back_from_admission() -> None:
    def admitted(reality: FarReality) -> int:
        engine = FarEngine(CFG, reality)
        engine.add_request("a", 512, 16, now=0.0)
        need = math.ceil(512 / CFG.block_size)
        engine.free_blocks = need + int(0.05 * engine.memory.num_gpu_blocks) - 1  # enough but for the watermark
        engine.step(now=1.0)
        return engine.num_running

    reality = with_only("watermark")
    assert admitted(reality) == 0
    assert admitted(reality.without("watermark")) == 1


def test_the_admission_cap_admits_at_most_k_requests_a_step() -> None:
    def admitted(reality: FarReality) -> int:
        engine = FarEngine(CFG, reality)
        for i in range(8):
            engine.add_request(str(i), 64, 16, now=0.0)
        engine.step(now=1.0)  # every request is past the API server by then
        return engine.num_running

    reality = with_only("admit_cap")
    assert admitted(reality) == 2
    assert admitted(reality.without("admit_cap")) == 8


def test_frontend_contention_slows_ingest_as_requests_pile_up() -> None:
    def last_ready(reality: FarReality) -> float:
        engine = FarEngine(CFG, reality)
        for i in range(200):
            engine.add_request(str(i), 256, 16, now=0.0)
        return engine.waiting[-1].ready

    reality = with_only("frontend_contention")
    plain = last_ready(reality.without("frontend_contention"))
    assert last_ready(reality) > 1.5 * plain  # 200 in flight at a half of 64: ingest ~2.5x slower on average


def test_a_periodic_stall_lengthens_every_nth_step() -> None:
    def durations(reality: FarReality) -> list[float]:
        cost = FarEngine(CFG, reality)._cost
        return [cost.step_time(32, 32, 32 * 600, 32 * 600.0)[0] for _ in range(20)]

    reality = with_only("periodic_stall")
    plain, stalled = durations(reality.without("periodic_stall")), durations(reality)
    extra = [round(s - p, 6) for s, p in zip(stalled, plain, strict=True)]
    assert extra == [0.02 if (i + 1) % 10 == 0 else 0.0 for i in range(20)]


def test_the_reparameterisation_is_not_the_twins() -> None:
    reality = with_only("watermark").without("watermark")
    cost = FarEngine(CFG, reality)._cost
    # A step carrying prompt tokens pays its own CPU time; an eager step (above the largest CUDA graph) its launches.
    decode = cost.step_time(32, 32, 32 * 600, 32 * 600.0)[0]
    assert cost.step_time(32, 32, 32 * 600, 32 * 600.0, prompt_tokens=1)[0] == pytest.approx(
        decode + reality.prefill_step_s)
    graphed, eager = cost.base.max_graph_tokens, cost.base.max_graph_tokens + 1
    gap = cost.step_time(eager, 32, 20_000, 20_000.0)[0] - cost.step_time(graphed, 32, 20_000, 20_000.0)[0]
    assert gap > CFG.model.num_layers * reality.eager_launch_per_layer_s
    # The memory outside the pool grows with the CUDA-graph pool, so with max-num-seqs: a fitted offset is one number.
    pools = {scale: [plan_memory(cfg, dataclasses.replace(reality, cudagraph_memory_scale=scale).engine_params(cfg))
                     .kv_cache_tokens for cfg in (CFG.replace(max_num_seqs=8), CFG.replace(max_num_seqs=256))]
             for scale in (1.0, 2.0)}
    assert pools[2.0][0] - pools[2.0][1] > pools[1.0][0] - pools[1.0][1] > 0


# What the strategies' twin and the perturbed truth answer, printed as JSON (run here and in a fresh process that
# never imports the far truth).
PROBE = """
import json, sys
from batchtune.bench.reality import PerturbedTruth
from batchtune.bench.scenarios import get_scenarios
from batchtune.bench.types import Knobs, Load
from batchtune.twin.config import ServeConfig
from batchtune.twin.predict import Workload, predict
cfg = ServeConfig(model="meta-llama/Llama-3.1-8B-Instruct", gpu="H100", max_num_seqs=64, max_model_len=4096)
nominal = predict(cfg, Workload(512, 64, request_rate=10.0), 4.0, seed=3).metrics
scenario = get_scenarios(["chat-8b-h100-tight"])[0]
perturbed = PerturbedTruth(truth_seed=1).measure(scenario, Knobs(32, 90), Load("request_rate", 6.0), duration_s=4.0,
                                                 seed=2, noise=0.03).metrics
print(json.dumps({"far_imported": "batchtune.bench.far_reality" in sys.modules, "nominal": nominal,
                  "perturbed": perturbed}, sort_keys=True))
"""


def test_the_strategies_twin_and_the_perturbed_truth_are_untouched_by_the_far_truth() -> None:
    operator = Path(far.__file__).resolve().parents[2]
    fresh = json.loads(subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True,
                                      env={"PYTHONPATH": str(operator), "PATH": "/usr/bin:/bin"}).stdout)
    assert fresh.pop("far_imported") is False
    # Here the far truth is imported and has run (in the bench's memo too) before the same probes.
    with memoised():
        FarTruth(truth_seed=1).measure(get_scenarios(["chat-8b-h100-tight"])[0], Knobs(32, 90),
                                       Load("request_rate", 6.0), duration_s=4.0, seed=2, noise=0.03)
        scope: dict[str, Any] = {}
        out = StringIO()
        with redirect_stdout(out):
            exec(PROBE, scope)  # the probe above, in this process
    here = json.loads(out.getvalue())
    assert here.pop("far_imported") is True
    assert here == fresh


def test_every_strategy_plans_with_the_nominal_twin_on_the_far_truth() -> None:
    from batchtune.bench.runner import default_strategies

    fits = [s.fits for s in default_strategies(FarTruth(truth_seed=1)) if getattr(s, "fits", None) is not None]
    assert fits and all(type(f.__self__) is TwinTruth for f in fits)  # type: ignore[attr-defined]


PERTURBED_DRAWS = "bfbf097408413b79fcfec35b95f279c32fdc4c7090747f76d596296c0f50c5a4"
"""sha256 of every scenario's perturbed reality at truth seeds 0-5 (`describe`), recorded at ce6020b before the far
truth existed: its hidden realities, and so its results, are what they were."""


def test_the_perturbed_truths_realities_are_unchanged() -> None:
    text = "\n".join(PerturbedTruth(truth_seed=s).describe(sc) for sc in SCENARIOS for s in SEEDS)
    assert hashlib.sha256(text.encode()).hexdigest() == PERTURBED_DRAWS


def test_the_cache_key_hashes_the_far_truths_module_and_leaves_the_others_keys_alone(monkeypatch) -> None:
    assert truth_sources(FarTruth()) == [Path(far.__file__).resolve()]
    assert truth_sources(PerturbedTruth()) == [] == truth_sources(TwinTruth())
    for truth in (PerturbedTruth(truth_seed=1), TwinTruth()):
        # The key as it was before truths had modules of their own: the perturbed truth's cache stays valid.
        judge = Judge(TINY, truth)
        kind = f"{type(truth).__module__}.{type(truth).__qualname__}"
        described = truth.describe(TINY)
        text = f"{CACHE_VERSION}|{judge.window_s}|{TINY!r}|{kind}|{truth!r}|{described}|{_twin_fingerprint()}"
        assert cache_key(judge) == hashlib.sha256(text.encode()).hexdigest()[:24]
    key = cache_key(Judge(TINY, FarTruth(truth_seed=1)))
    assert key != cache_key(Judge(TINY, PerturbedTruth(truth_seed=1)))
    assert key != cache_key(Judge(TINY, FarTruth(truth_seed=2)))
    read_bytes = Path.read_bytes

    def edited(path: Path) -> bytes:
        data = read_bytes(path)
        return data + b"\n# edited\n" if path.name == "far_reality.py" else data

    monkeypatch.setattr(Path, "read_bytes", edited)
    assert cache_key(Judge(TINY, FarTruth(truth_seed=1))) != key  # an edit of the far truth's code is a new key


def test_the_far_truth_answers_the_judges_questions_per_setting() -> None:
    truth = FarTruth(truth_seed=1)
    with pytest.raises(TypeError):
        truth.params(TINY)  # its memory depends on the setting: nothing may read one figure for all
    for knobs in (Knobs(8, 90), Knobs(128, 95)):
        expected = truth.setting_params(TINY, knobs)
        assert truth.startup(TINY, knobs).ok
        assert truth.fits(TINY, knobs)[0] is not False and truth.burst_failure(TINY, knobs) is None
        reading = truth.measure(TINY, knobs, Load("concurrency", 8.0), duration_s=4.0, seed=0, noise=0.0)
        assert reading.ok
        assert reading.metrics["kv_cache_tokens"] == plan_memory(truth.config(TINY, knobs), expected).kv_cache_tokens


def test_the_cli_registers_the_far_truth(monkeypatch) -> None:
    import batchtune.bench.runner as runner
    from batchtune.bench.seeds import REPORTING_TRUTH_SEEDS
    from batchtune.cli import main

    seen: list[tuple[object, str, tuple[int, ...]]] = []

    def fake_run_bench(scenarios, factory, **kwargs):  # type: ignore[no-untyped-def]
        seen.append((factory, kwargs["truth_name"], tuple(kwargs["truth_seeds"])))
        return runner.BenchResult(seed=kwargs["seed"], noise=0.0, scenarios=(), summary=(), seconds=0.0,
                                  truth=kwargs["truth_name"], truth_seeds=tuple(kwargs["truth_seeds"]))

    monkeypatch.setattr(runner, "run_bench", fake_run_bench)
    assert main(["bench", "tuning", "--quick", "--scenarios", "chat-8b-h100-tight", "-o", "json",
                 "--truth", "far"]) == 0
    assert main(["bench", "tuning", "--quick", "--scenarios", "chat-8b-h100-tight", "-o", "json"]) == 0
    assert seen == [(FarTruth, "far", REPORTING_TRUTH_SEEDS), (PerturbedTruth, "perturbed", REPORTING_TRUTH_SEEDS)]
