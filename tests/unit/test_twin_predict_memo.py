"""`twin.predict`'s memo of simulations (`PredictMemo`, what the benchmark installs): its key covers every input that
changes a prediction, so a memoised run gives the very figures an unmemoised one does."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import pytest

from batchtune.bench.runner import run_scenario
from batchtune.bench.scenarios import KnobGrid, Scenario
from batchtune.bench.twin_truth import TwinTruth
from batchtune.bench.types import Slo
from batchtune.twin import predict as twin_predict
from batchtune.twin.config import ServeConfig
from batchtune.twin.params import NOMINAL
from batchtune.twin.predict import Prediction, PredictMemo, Workload, draws_random_numbers, memoised, predict

CFG = ServeConfig(model="meta-llama/Llama-3.1-8B-Instruct", gpu="H100", max_num_seqs=32, max_model_len=4096)
OPEN = Workload(256, 32, request_rate=6.0)
CLOSED = Workload(256, 32, concurrency=8)
BASE: dict[str, Any] = {"cfg": CFG, "workload": OPEN, "duration_s": 4.0, "seed": 3, "noise": 0.0, "params": NOMINAL}

# One variant per input of `predict` (and per field of its value arguments that the simulation reads), each of which
# changes the answer: a key that dropped any of them would hand back the base run's figures.
VARIANTS: dict[str, dict[str, Any]] = {
    "max_num_seqs": {"cfg": CFG.replace(max_num_seqs=2)},
    "gpu_memory_utilization": {"cfg": CFG.replace(gpu_memory_utilization=0.5)},
    "max_num_batched_tokens": {"cfg": CFG.replace(max_num_batched_tokens=64)},
    "gpu": {"cfg": CFG.replace(gpu="L4")},
    "tensor_parallel_size": {"cfg": CFG.replace(tensor_parallel_size=2)},
    "input_len": {"workload": dataclasses.replace(OPEN, input_len=1024)},
    "output_len": {"workload": dataclasses.replace(OPEN, output_len=64)},
    "request_rate": {"workload": dataclasses.replace(OPEN, request_rate=9.0)},
    "closed_loop": {"workload": CLOSED},
    "length_dist": {"workload": dataclasses.replace(OPEN, length_dist="uniform")},
    "num_prompts": {"workload": dataclasses.replace(OPEN, num_prompts=5)},
    "warmup_s": {"workload": dataclasses.replace(OPEN, warmup_s=2.0)},
    "duration_s": {"duration_s": 6.0},
    "seed": {"seed": 4},
    "params": {"params": NOMINAL.replace(step_overhead_s=NOMINAL.step_overhead_s * 3)},
    "noise": {"noise": 0.05},
}


def _figures(prediction: Prediction) -> str:
    return json.dumps(prediction.as_dict(), sort_keys=True)


def _call(args: dict[str, Any]) -> Prediction:
    return predict(args["cfg"], args["workload"], args["duration_s"], seed=args["seed"], noise=args["noise"],
                   params=args["params"])


def _wrong_answers(key: Callable[..., Any] | None = None) -> list[str]:
    """The variants a memo (with `key`, else its own) answers differently from a fresh simulation, each variant
    asked after the base run is memoised."""
    wrong = []
    for name, change in VARIANTS.items():
        memo = PredictMemo()
        if key is not None:
            memo.key = key  # type: ignore[method-assign]
        args = {**BASE, **change}
        with memoised(memo):
            _call(BASE)
            served = _figures(_call(args))
        if served != _figures(_call(args)):
            wrong.append(name)
    return wrong


def test_every_variant_changes_the_answer() -> None:
    # Otherwise the key test below could not notice that input missing.
    base = _figures(_call(BASE))
    assert [name for name, change in VARIANTS.items() if _figures(_call({**BASE, **change})) == base] == []


def test_the_key_covers_every_input_that_changes_a_prediction() -> None:
    assert _wrong_answers() == []


@pytest.mark.parametrize("dropped", range(5))
def test_a_key_without_any_one_of_its_parts_serves_a_wrong_answer(dropped: int) -> None:
    # The test above fails for a key that leaves out any one part (the config, the workload, the window, the seed,
    # the parameters): each part decides some variant.
    def partial_key(*args: Any) -> tuple[Any, ...]:
        full = PredictMemo.key(*args)
        return full[:dropped] + full[dropped + 1:]

    assert _wrong_answers(partial_key) != []


def test_the_seed_is_left_out_only_where_the_run_never_reads_it() -> None:
    # A closed loop of fixed lengths is the same run at every seed (nothing is drawn): one memo entry serves all.
    assert not draws_random_numbers(CLOSED)
    assert _figures(predict(CFG, CLOSED, 4.0, seed=1)) == _figures(predict(CFG, CLOSED, 4.0, seed=2))
    for drawn in (OPEN, dataclasses.replace(CLOSED, length_dist="exponential"),
                  dataclasses.replace(CLOSED, output_dist="uniform")):
        assert draws_random_numbers(drawn)
        assert _figures(predict(CFG, drawn, 4.0, seed=1)) != _figures(predict(CFG, drawn, 4.0, seed=2))
    assert not draws_random_numbers(Workload(256, 32, request_rate=float("inf"), num_prompts=4))


def test_a_memoised_run_is_noised_afresh_and_the_memo_keeps_the_noise_free_figures() -> None:
    with memoised() as memo:
        noisy = [_figures(predict(CFG, CLOSED, 4.0, seed=s, noise=0.05)) for s in (1, 2, 1)]
        clean = _figures(predict(CFG, CLOSED, 4.0, seed=9))
    assert (memo.misses, memo.hits, len(memo)) == (1, 3, 1)
    assert noisy[0] == noisy[2] != noisy[1]  # each seed its own noise on the one simulation
    assert noisy == [_figures(predict(CFG, CLOSED, 4.0, seed=s, noise=0.05)) for s in (1, 2, 1)]
    assert clean == _figures(predict(CFG, CLOSED, 4.0, seed=9))


def test_the_memo_drops_the_least_recently_used_past_its_size() -> None:
    memo = PredictMemo(maxsize=2)
    with memoised(memo):
        for concurrency in (1, 2, 1, 3):  # 1 is used again before 3 arrives: 2 goes
            predict(CFG, Workload(64, 8, concurrency=concurrency), 2.0)
        predict(CFG, Workload(64, 8, concurrency=1), 2.0)
    assert (len(memo), memo.hits, memo.misses) == (2, 2, 3)


def test_no_memo_outside_a_memoised_block() -> None:
    with memoised():
        pass
    assert twin_predict._memo is None


TINY = Scenario(
    name="tiny-closed", summary="synthetic", model="Llama-3.1-8B", gpu="H100", input_len=256, output_len=32,
    slo=Slo({"p95_ttft_ms": 500.0, "p95_itl_ms": 30.0}), load_kind="concurrency",
    tuner_space=KnobGrid((8, 32), (90,)), oracle_space=KnobGrid((8, 16, 32), (90,)), sim_window_s=4.0,
)


def test_a_scenario_gives_the_same_figures_with_and_without_the_memo(monkeypatch: pytest.MonkeyPatch) -> None:
    def run() -> str:
        result = run_scenario(TINY, TwinTruth(), seed=5, noise=0.03)
        return json.dumps({**dataclasses.asdict(result), "seconds": None}, sort_keys=True)

    with memoised() as memo:
        memoised_run = run()
    assert memo.hits > 0
    monkeypatch.setattr(PredictMemo, "get", lambda self, key: None)  # every simulation run afresh
    assert run() == memoised_run
