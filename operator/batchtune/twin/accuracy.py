"""How far the calibrated twin is from every measured curve the project holds (docs/twin.md, "Accuracy").

A `Curve` is one deployment's measured load steps (public reference runs, `twin.calibration`, or the real vLLM
on CPU recorded in tests/data/real-vllm-curve). `evaluate(curve)` calibrates the twin (`twin.fit.calibrate`) on
the curve's training points only, predicts every point with the event simulation, and gives each point's error
per figure (throughput, TPOT, TTFT, E2E) and the mean absolute percentage error per figure, on the held-out
points and on all of them, beside the nominal (uncalibrated) twin's. Shared by tests/unit/test_twin_accuracy.py,
tests/unit/test_twin_real_engine.py and hack/twin-accuracy.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from batchtune.twin.config import ServeConfig
from batchtune.twin.fit import Calibration, Observation, calibrate, simulate
from batchtune.twin.params import NOMINAL, TwinParams
from batchtune.twin.steady import Shape

T = TypeVar("T", bound=Any)

FIGURES = ("throughput", "tpot", "ttft", "e2el")
"""The figures compared, in the order the tables give them."""
# The statistic of each figure compared, in order of preference (the first one a point measured).
FIGURE_KEYS: Mapping[str, tuple[str, ...]] = {
    "throughput": ("output_throughput", "request_throughput"),
    "tpot": ("median_tpot_ms", "mean_tpot_ms"),
    "ttft": ("median_ttft_ms", "mean_ttft_ms"),
    "e2el": ("median_e2el_ms", "mean_e2el_ms"),
}


@dataclass(frozen=True)
class Point:
    """One measured load step of a curve: the observation the twin simulates and the figures it is held to."""

    label: str
    observation: Observation
    measured: Mapping[str, float]
    """`vllm bench serve` keys, as measured (medians of the repeats where there were several)."""
    saturated: bool = False
    """The load is past what the setting's batch holds (streams above max-num-seqs): queueing decides TTFT."""


@dataclass(frozen=True)
class Curve:
    name: str
    source: str
    """Where the measurements come from (a reference id, a recording and its command)."""
    points: tuple[Point, ...]
    train: tuple[int, ...]
    """Indices of the points the twin is calibrated on."""
    training: tuple[Observation, ...] = ()
    """The observations calibrated on (default: the training points' own; a recording gives every repeat)."""

    def training_observations(self) -> list[Observation]:
        return list(self.training) or [self.points[i].observation for i in self.train]


@dataclass(frozen=True)
class Row:
    point: Point
    held_out: bool
    figure: str
    key: str
    measured: float
    calibrated: float | None
    nominal: float | None

    @staticmethod
    def _error(predicted: float | None, measured: float) -> float:
        if predicted is None or not math.isfinite(predicted) or measured <= 0:
            return math.inf
        return predicted / measured - 1

    @property
    def error(self) -> float:
        return self._error(self.calibrated, self.measured)

    @property
    def nominal_error(self) -> float:
        return self._error(self.nominal, self.measured)


@dataclass(frozen=True)
class CurveResult:
    curve: Curve
    calibration: Calibration
    rows: tuple[Row, ...]
    seconds: float = 0.0
    notes: tuple[str, ...] = field(default_factory=tuple)

    def mape(self, figure: str, held_out: bool | None = True, nominal: bool = False) -> float | None:
        """Mean absolute percentage error of one figure (held-out points, all with None), or None without any."""
        errors = [abs(r.nominal_error if nominal else r.error) for r in self.rows
                  if r.figure == figure and (held_out is None or r.held_out == held_out)]
        errors = [e for e in errors if math.isfinite(e)]
        return 100 * statistics.fmean(errors) if errors else None


def figure_key(measured: Mapping[str, float], figure: str) -> str | None:
    return next((k for k in FIGURE_KEYS[figure] if _positive(measured.get(k))), None)


def evaluate(curve: Curve, seed: int = 0) -> CurveResult:
    """Calibrate on the curve's training points, predict every point, compare."""
    import time

    started = time.monotonic()
    calibration = calibrate(curve.training_observations(), seed=seed)
    rows = []
    for i, point in enumerate(curve.points):
        calibrated = simulate(point.observation, calibration.params, seed)
        nominal = simulate(point.observation, NOMINAL, seed)
        for figure in FIGURES:
            key = figure_key(point.measured, figure)
            if key is None:
                continue
            rows.append(Row(point, i not in curve.train, figure, key, float(point.measured[key]),
                            calibrated.get(key), nominal.get(key)))
    return CurveResult(curve, calibration, tuple(rows), time.monotonic() - started)


# ---- the curves the project holds ------------------------------------------------------------------


def public_curves() -> list[Curve]:
    """The public reference runs (`twin.calibration`), one curve per reference: calibrated on its lowest, middle
    and highest load (its first point where it has two), predicting the others."""
    from batchtune.twin.calibration import reference_points

    by_case: dict[str, list[Point]] = {}
    names: dict[str, str] = {}
    for ref in reference_points():
        wl = ref.workload
        shape = simulated_shape(Shape(float(wl.input_len), float(wl.output_len), wl.length_dist, wl.range_ratio,
                                      wl.output_dist), closed=wl.concurrency is not None)
        obs = Observation(ref.cfg, shape, dict(ref.measured), concurrency=wl.concurrency, rate=wl.request_rate,
                          num_prompts=wl.num_prompts, window_s=ref.duration_s, source=ref.label)
        by_case.setdefault(ref.case, []).append(Point(ref.label, obs, dict(ref.measured)))
        names[ref.case] = ref.label.rsplit(" ", 1)[0]
    curves = []
    for case, points in by_case.items():
        n = len(points)
        train = (0,) if n < 3 else tuple(sorted({0, n // 2, n - 1}))
        curves.append(Curve(f"{case} {names[case]}", f"{case} (shared/reference/vllm-gpu-facts.md)", tuple(points),
                            train))
    return curves


def simulated_shape(shape: Shape, closed: bool) -> Shape:
    """The shape `batchtune twin calibrate` would simulate for a public run of this shape: the public runs state
    no measured spread of their fixed lengths (prompts, and outputs under --ignore-eos), so a closed loop's get the
    default spread (`observations.CLOSED_LOOP_DEFAULT_SPREAD`), where this twin has one."""
    from batchtune.twin import observations

    # an older twin (the docs' "before" column) names it a floor, or has none
    floor = getattr(observations, "CLOSED_LOOP_DEFAULT_SPREAD", getattr(observations, "CLOSED_LOOP_MIN_SPREAD", None))
    if not closed or floor is None:
        return shape
    if shape.length_dist == "fixed" and (shape.output_dist in (None, "fixed")):
        return replace(shape, length_dist="uniform", range_ratio=floor, output_range_ratio=floor, output_dist=None)
    if shape.length_dist == "fixed":  # outputs spread already (uniform or EOS), prompts fixed
        return replace(shape, length_dist="uniform", range_ratio=floor, output_dist=shape.output_dist,
                       output_range_ratio=shape.range_ratio if shape.output_dist == "uniform" else None)
    return shape


RECORDED_CURVE = "tests/data/real-vllm-curve-long"
"""The real-engine check's recording (7 Dec: three long repeats per point, the engine core pinned); the bench's
recorded truth still reads the first one, tests/data/real-vllm-curve (`bench.recorded`)."""
TRAIN_SETTING = 8
TRAIN_LOADS = (1, 4, 16)
"""The real-engine check: calibrated on max-num-seqs 8 at 1, 4 and 16 streams (below, inside and past its
batch), predicting the other loads and settings of the curve."""


def recorded_curve(folder: str | Path, cfg: ServeConfig | None = None, train_setting: int = TRAIN_SETTING,
                   train_loads: Sequence[int] = TRAIN_LOADS) -> Curve:
    """A curve recorded by hack/real-vllm/measure-curve --save-dir: every run file read as `batchtune twin
    calibrate` reads it; a point is one of its repeats, chosen by recording.json's "point" (`representative`);
    the twin is calibrated on every repeat of the training points (`Curve.training`)."""
    from batchtune.twin import observations as reading

    folder = Path(folder)
    meta = json.loads((folder / "recording.json").read_text())
    cfg = cfg or ServeConfig(model=meta["model"], gpu=meta["gpu"], max_model_len=int(meta["max_model_len"]),
                             gpu_memory_utilization=float(meta["gpu_memory_utilization"]),
                             enforce_eager=bool(meta.get("enforce_eager", True)))
    files = sorted((folder / "runs").glob("*.json"))
    if hasattr(reading, "load_all"):
        observations = reading.load_all(files, cfg)
    else:  # a twin before load_all (the docs' "before" column)
        observations = [o for f in files for o in reading.load_observations(f, cfg)]
    statistic = recording_statistic(folder)
    groups: dict[tuple[int, float], list[Observation]] = {}
    for obs in observations:
        assert obs.concurrency is not None, obs.source
        groups.setdefault((obs.cfg.max_num_seqs, obs.concurrency), []).append(obs)
    points: list[Point] = []
    train: list[int] = []
    training: list[Observation] = []
    for (mns, conc), found in sorted(groups.items()):
        chosen = representative(found, statistic)
        obs = replace(chosen, source=f"{chosen.source} ({statistic} of {len(found)})")
        if mns == train_setting and int(conc) in train_loads:
            train.append(len(points))
            # Calibrated on every repeat of the training points, as `batchtune twin calibrate runs/*.json` would
            # be: on the quiet machine the repeats scatter both ways (one point's fastest repeat decodes 8
            # sequences faster than another's 4), and one repeat per point would fit that scatter as physics.
            training.extend(found)
        points.append(Point(f"mns={mns} c={conc:g}", obs, dict(obs.metrics), saturated=conc > mns))
    return Curve(f"real vLLM on CPU ({meta['model']})", meta.get("command", str(folder)), tuple(points),
                 tuple(train), tuple(training))


REPRESENTATIVE = ("fastest", "median")
"""How a recording's point is chosen among its repeats (recording.json "point"; "fastest" where it says none):
"fastest" for the first recording (two short repeats; on a shared machine other work only ever slows a run),
"median" for one of at least three long repeats, whose scatter goes both ways."""


def recording_statistic(folder: str | Path) -> str:
    """How the recording in `folder` picks a point among its repeats: its recording.json "point"."""
    path = Path(folder) / "recording.json"
    statistic = json.loads(path.read_text()).get("point", "fastest")
    if statistic not in REPRESENTATIVE:
        raise ValueError(f"{path}: point {statistic!r} is not one of {list(REPRESENTATIVE)}")
    return str(statistic)


def representative(found: Sequence[T], statistic: str,
                   throughput: Callable[[T], float] = lambda o: o.metrics.get("output_throughput", 0.0)) -> T:
    """The repeat that stands for a point: the fastest, or the median one by output throughput (the lower middle
    of an even count): a real run, whose figures belong together, unlike a median taken figure by figure.
    `found`: Observations, or anything with a `throughput` function (a live run's summary dict)."""
    ranked = sorted(found, key=throughput)
    if statistic == "fastest":
        return ranked[-1]
    if statistic == "median":
        return ranked[(len(ranked) - 1) // 2]
    raise ValueError(f"point statistic {statistic!r} is not one of {list(REPRESENTATIVE)}")


# ---- tables ----------------------------------------------------------------------------------------


def _positive(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _pct(error: float) -> str:
    return f"{100 * error:+.1f}%" if math.isfinite(error) else "-"


def _num(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    return f"{value:.4g}" if abs(value) < 1000 else f"{value:,.0f}"


def point_table(result: CurveResult) -> str:
    """Point by point, markdown: measured, calibrated and nominal twin, errors; training points marked."""
    lines = ["| point | figure | measured | calibrated twin | error | nominal twin | error |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in result.rows:
        mark = "" if r.held_out else " (fit)"
        sat = " (saturated)" if r.point.saturated else ""
        lines.append(f"| {r.point.label}{mark}{sat} | {r.key} | {_num(r.measured)} | {_num(r.calibrated)} | "
                     f"{_pct(r.error)} | {_num(r.nominal)} | {_pct(r.nominal_error)} |")
    return "\n".join(lines)


def mape_table(results: Sequence[CurveResult]) -> str:
    """MAPE per figure and curve, markdown: held-out points (all points), calibrated and nominal twin."""
    head = "| curve | verdict | " + " | ".join(f"{f} MAPE held-out (all) | nominal" for f in FIGURES) + " |"
    lines = [head, "|---|---|" + "---:|---:|" * len(FIGURES)]
    for res in results:
        cells = []
        for figure in FIGURES:
            held, every, nominal = (res.mape(figure, True), res.mape(figure, None),
                                    res.mape(figure, None, nominal=True))
            cells.append("-" if every is None else f"{_m(held)} ({_m(every)})")
            cells.append(_m(nominal))
        lines.append(f"| {res.curve.name} | {res.calibration.verdict} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _m(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}%"


def params_line(params: TwinParams, cfg: ServeConfig) -> str:
    g = cfg.gpu
    return (f"bandwidth {g.eta_bw * params.bw_scale:.0%} of peak, compute {g.eta_flops * params.flops_scale:.0%}, "
            f"step {params.step_overhead_s * 1e3:.3g} ms, per sequence {params.seq_overhead_s * 1e6:.3g} us, layer floor "
            f"{params.layer_floor_s * 1e6:.3g} us, response path {params.response_path_s * 1e3:.3g} ms"
            + (f", per prompt token {params.prefill_token_overhead_s * 1e6:.3g} us" if params.prefill_token_overhead_s
               else ""))
