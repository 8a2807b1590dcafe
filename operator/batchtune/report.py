"""The tuning report: trial table as CSV and JSON, and the three curves against max-num-seqs.

The curves (GPU utilization, throughput, latency) are drawn at ONE common offered load, the reading of
each trial's extra step at `status.plan.curveLoad`; SLO capacity, which each trial reaches at its own
load, has a panel of its own. Drawing each trial at its own capacity load would mix loads: latency would
fall and rise with batch size for reasons that have nothing to do with batching.
"""

from __future__ import annotations

import csv
import io
import json
import math
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from batchtune.api.models import (
    BEYOND_LAST_BUCKET_MS,
    BatchTuningSpec,
    BatchTuningStatus,
    CurveLoadRecord,
    CurveLoadType,
    LoadStepRecord,
    Setting,
    SloSpec,
    TrialRecord,
)
from batchtune.core.vocabulary import M, StepPurpose, TrialState, Verdict

CSV_COLUMNS = [
    "name", "maxNumSeqs", "gpuMemoryUtilizationPercent", "maxNumBatchedTokens", "state", "verdict",
    "requestThroughput", "outputThroughput", "ttftMs", "itlMs", "e2eMs", "gpuUtilPercent",
    "smActivePercent", "kvCacheUsagePercent", "preemptionsPerSecond", "powerWatts", "sloCapacity", "reason",
]
LATENCY_STYLES: tuple[Literal["-", "--", ":"], ...] = ("-", "--", ":")
# (metric key, words, the SloSpec field that bounds it)
_LATENCIES = (("ttftMs", "TTFT", "ttft_milliseconds"),
              ("itlMs", "inter-token", "inter_token_latency_milliseconds"),
              ("e2eMs", "end-to-end", "e2e_latency_milliseconds"))


@dataclass(frozen=True)
class Tuning:
    """What a report is drawn from: one BatchTuning's names, spec and status, parsed once at the edge (the CLI's
    view, the controller's report writer)."""

    namespace: str
    name: str
    spec: BatchTuningSpec
    status: BatchTuningStatus
    written: bool = True
    """Whether the operator has written any status yet (a fresh BatchTuning's report shows no GPU time)."""

    @classmethod
    def from_wire(cls, namespace: str, name: str, spec: Mapping[str, Any], status: Mapping[str, Any]) -> Tuning:
        """The typed parse of a spec and status as the API server holds them; InvalidBatchTuning naming each field
        that does not parse."""
        from batchtune.api import parse_spec, parse_status

        return cls(namespace, name, parse_spec(dict(spec)), parse_status(dict(status)), written=bool(status))

    def to_wire(self) -> dict[str, Any]:
        return {"namespace": self.namespace, "name": self.name, "spec": self.spec.to_wire(),
                "status": self.status.to_wire()}

    @property
    def curve_load(self) -> CurveLoadRecord | None:
        """status.plan.curveLoad: the one offered load every curve is drawn at."""
        return self.status.plan.curve_load if self.status.plan else None

    @property
    def curves_off(self) -> bool:
        return self.spec.report.curve_load.type == CurveLoadType.OFF


def _row(trial: TrialRecord) -> dict[str, Any]:
    setting, metrics = trial.setting, trial.metrics or {}
    row: dict[str, Any] = {"name": trial.name, "state": trial.state, "verdict": trial.verdict,
                           "reason": trial.verdict_reason or trial.reason or ""}
    row.update({"maxNumSeqs": setting.max_num_seqs, "gpuMemoryUtilizationPercent": setting.gpu_memory_utilization_percent,
                "maxNumBatchedTokens": setting.max_num_batched_tokens})
    row.update({k: metrics[k] for k in CSV_COLUMNS if k in metrics})
    return row


def trials_csv(trials: Sequence[TrialRecord]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=CSV_COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for trial in trials:
        writer.writerow({k: ("" if v is None else v) for k, v in _row(trial).items()})
    return out.getvalue()


def trials_json(trials: Sequence[TrialRecord], summary: Mapping[str, Any]) -> str:
    return json.dumps({"summary": dict(summary), "trials": [t.to_wire() for t in trials]}, indent=2, sort_keys=True)


@dataclass(frozen=True)
class CurvePoint:
    """One trial's reading at the common curve load."""

    name: str
    setting: Setting
    metrics: Mapping[str, float]
    verdict: Verdict | None
    """The SLO verdict at the common load (for the picture only; the trial's own verdict is its search's)."""


@dataclass(frozen=True)
class CurvePicture:
    """What the three curves can show: every Done trial's reading at one offered load, and what is missing."""

    load: str | None
    """The common load in words ("600 requests/min"); None: the status holds none."""
    source: str
    points: list[CurvePoint]
    missing: list[str]
    """Done trials without a reading at the common load, each with why."""
    why_none: str | None = None
    """Why there is no common load at all."""


def curve_load_label(curve_load: CurveLoadRecord | None) -> str | None:
    if curve_load is None:
        return None
    if curve_load.requests_per_minute:
        return f"{curve_load.requests_per_minute} requests/min (open loop)"
    if curve_load.concurrency:
        return f"{curve_load.concurrency} concurrent requests (closed loop)"
    return None


def curve_step(trial: TrialRecord) -> LoadStepRecord | None:
    """The trial's step at the common curve load (`curveStep`), None when it has none."""
    at = trial.curve_step
    return trial.steps[at] if at is not None and at < len(trial.steps) else None


def curve_picture(trials: Sequence[TrialRecord], curve_load: CurveLoadRecord | None,
                  curves_off: bool = False) -> CurvePicture:
    """The trials' readings at the common load (`status.plan.curveLoad`), never a trial's own capacity load."""
    label = curve_load_label(curve_load)
    if label is None:
        why = ("spec.report.curveLoad.type is Off: no trial was measured at a common load" if curves_off else
               "this status holds no common curve load (written by an operator before common-load steps, "
               "or curves were off)")
        return CurvePicture(None, "", [], [], why)
    points, missing = [], []
    for trial in trials:
        if trial.state != TrialState.DONE:
            continue
        step = curve_step(trial)
        if step is not None and step.metrics:
            points.append(CurvePoint(trial.name, trial.setting, step.metrics, step.verdict))
            continue
        curve = next((s for s in trial.steps if s.purpose == StepPurpose.CURVE), None)
        why = str(curve.verdict_reason or "not measured yet") if curve else "no step at the common load"
        missing.append(f"{trial.name} ({_setting_label(trial.setting)}): {why}")
    return CurvePicture(label, curve_load.source if curve_load else "", points, missing)


def _setting_label(setting: Setting) -> str:
    out = f"seqs {setting.max_num_seqs}, gmu {setting.gpu_memory_utilization_percent}%"
    return out + (f", mbt {setting.max_num_batched_tokens}" if setting.max_num_batched_tokens else "")


def _number(value: Any) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return float("nan")


def _column(setting: Setting) -> tuple[int, int]:
    """A curve's line: one per (gmu, mbt); mbt 0 where it is not searched."""
    return (setting.gpu_memory_utilization_percent, setting.max_num_batched_tokens or 0)


def _slo_targets(slo: SloSpec) -> list[tuple[str, int | float]]:
    """(latency words, target in ms) for each latency the SLO bounds."""
    out = []
    for _key, name, field in _LATENCIES:
        target = getattr(slo, field)
        if isinstance(target, (int, float)) and not isinstance(target, bool) and target > 0:
            out.append((name, target))
    return out


def curves_png(tuning: Tuning, title: str = "") -> bytes:
    """GPU utilization, output throughput and latency against max-num-seqs at ONE common offered load
    (status.plan.curveLoad), one line per gmu; SLO capacity, each trial at its own highest passing load, in a
    panel of its own. A trial without a reading at the common load is left out and named under the figure,
    never drawn at another load."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    status, slo = tuning.status, tuning.spec.slo
    picture = curve_picture(status.trials, tuning.curve_load, tuning.curves_off)
    done = [t for t in status.trials if t.state == TrialState.DONE]
    fig, grid = plt.subplots(2, 2, figsize=(12, 8.2), constrained_layout=True)
    util_ax, tput_ax, lat_ax, cap_ax = grid[0][0], grid[0][1], grid[1][0], grid[1][1]
    at = f" at {picture.load}" if picture.load else ""
    panels = _load_panels(util_ax, tput_ax, picture, at)
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    # One colour per (gmu, mbt) column in every panel, whichever panels it has points in.
    colors = {col: cycle[i % len(cycle)] for i, col in enumerate(sorted({_column(t.setting) for t in done}))}
    # A latency beyond the histogram's last bucket (status holds +inf as BEYOND_LAST_BUCKET_MS: an overloaded
    # setting at this load) is drawn at a ceiling above every finite reading, not at 10^12 ms.
    ceiling = latency_ceiling(picture.points, slo)
    latencies_drawn, overloaded = _draw_columns(picture.points, panels, lat_ax, colors, ceiling)
    for ax, _, ylabel, heading in panels:
        ax.set_ylabel(ylabel)
        ax.set_title(heading, fontsize=10)
    util_ax.set_ylim(0, 105)
    lat_ax.set_ylabel(f"{slo.percentile.lower()} latency (ms, log scale)")
    lat_ax.set_title(f"{slo.percentile} latency" + at, fontsize=10)
    if latencies_drawn:
        _latency_scale(lat_ax, slo, ceiling, overloaded)
    if not picture.points:
        why = picture.why_none or "no Done trial has a reading at the common load"
        for ax in (util_ax, tput_ax, lat_ax):
            ax.text(0.5, 0.5, "\n".join(textwrap.wrap(why, 48)), transform=ax.transAxes, ha="center",
                    va="center", fontsize=9, color="dimgrey", parse_math=False)
    _capacity_panel(cap_ax, done, colors)
    _seqs_axes((util_ax, tput_ax, lat_ax, cap_ax), done, status.best_trial,
               status.knee.max_num_seqs if status.knee else None)
    _legends(util_ax, lat_ax, latencies_drawn)
    _headings(fig, title, picture)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    plt.close(fig)
    return buf.getvalue()


# A panel drawn at the common load: (axes, metric key, y label, heading).
_Panel = tuple[Any, str, str, str]


def _load_panels(util_ax: Any, tput_ax: Any, picture: CurvePicture, at: str) -> list[_Panel]:
    # DCGM's GPU_UTIL reads ~100% whenever any kernel runs; SM active shows the batching curve.
    has_sm = any(not math.isnan(_number(p.metrics.get(M.SM_ACTIVE_PERCENT))) for p in picture.points)
    util_key, util_label = ((M.SM_ACTIVE_PERCENT, "SM active (%, DCGM PROF_SM_ACTIVE)") if has_sm
                            else (M.GPU_UTIL_PERCENT, "GPU utilization (%, DCGM GPU_UTIL)"))
    return [(util_ax, util_key, util_label, "GPU utilization" + at),
            (tput_ax, M.OUTPUT_THROUGHPUT, "output throughput (tokens/s)", "Throughput" + at)]


def _draw_columns(points: Sequence[CurvePoint], panels: list[_Panel], lat_ax: Any,
                  colors: Mapping[tuple[int, int], str], ceiling: float) -> tuple[bool, bool]:
    """One line per (gmu, mbt) column in each panel; (whether any latency was drawn, whether any was beyond
    the histogram's last bucket)."""
    columns: dict[tuple[int, int], list[CurvePoint]] = {}
    for point in points:
        columns.setdefault(_column(point.setting), []).append(point)
    latencies_drawn = overloaded = False
    for (gmu, mbt), column in sorted(columns.items()):
        group = sorted(column, key=lambda p: p.setting.max_num_seqs)
        xs = [p.setting.max_num_seqs for p in group]
        label = f"gmu {gmu}%" + (f", mbt {mbt}" if mbt else "")
        color = colors.get((gmu, mbt), "black")
        for ax, key, _, _ in panels:
            _line(ax, xs, [_number(p.metrics.get(key)) for p in group], group, color, "-", label)
        for (latency, name, _), style in zip(_LATENCIES, LATENCY_STYLES, strict=True):
            ys = [_number(p.metrics.get(latency)) for p in group]
            if all(math.isnan(y) for y in ys):
                continue
            latencies_drawn = True
            beyond = [y >= BEYOND_LAST_BUCKET_MS for y in ys]
            overloaded = overloaded or any(beyond)
            _line(lat_ax, xs, [ceiling if b else y for y, b in zip(ys, beyond, strict=True)], group, color,
                  style, f"{name}, {label}", beyond)
    return latencies_drawn, overloaded


def _latency_scale(lat_ax: Any, slo: SloSpec, ceiling: float, overloaded: bool) -> None:
    """Log scale, a dashed line per SLO target, and the ceiling where overloaded readings are drawn."""
    lat_ax.set_yscale("log")
    for name, target in _slo_targets(slo):
        lat_ax.axhline(target, linestyle="--", linewidth=1, color="grey")
        lat_ax.annotate(f"{name} SLO {target} ms", (0.99, target), xycoords=("axes fraction", "data"),
                        fontsize=8, color="grey", va="bottom", ha="right")
    if overloaded:
        lat_ax.axhline(ceiling, linestyle=(0, (1, 3)), linewidth=1, color="firebrick")
        lat_ax.annotate("\u25b2 beyond the latency histogram's last bucket (overloaded at this load)",
                        (0.01, ceiling), xycoords=("axes fraction", "data"), fontsize=8, color="firebrick",
                        va="bottom", ha="left")
        lat_ax.set_ylim(top=ceiling * 4)


def _seqs_axes(axes: Sequence[Any], done: Sequence[TrialRecord], chosen: str | None, knee_seqs: int | None) -> None:
    """Every panel's x axis: the max-num-seqs tried, on a log scale, with the chosen setting and the knee marked."""
    from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter

    seqs = sorted({t.setting.max_num_seqs for t in done})
    chosen_trial = next((t for t in done if t.name == chosen), None)
    for ax in axes:
        ax.set_xscale("log", base=2)
        if seqs:
            ax.xaxis.set_major_locator(FixedLocator(seqs))
            ax.xaxis.set_minor_locator(NullLocator())
            ax.xaxis.set_major_formatter(ScalarFormatter())
            ax.set_xlim(seqs[0] / 1.4, seqs[-1] * 1.4)
        ax.set_xlabel("--max-num-seqs (log scale)")
        ax.grid(True, alpha=0.3)
        if chosen_trial:
            ax.axvline(chosen_trial.setting.max_num_seqs, color="tab:green", linewidth=6, alpha=0.25,
                       label=f"chosen ({chosen_trial.setting.max_num_seqs})")
        if knee_seqs:
            ax.axvline(knee_seqs, color="tab:orange", linestyle=":", linewidth=2, zorder=5,
                       label=f"knee ({knee_seqs})")


def _legends(util_ax: Any, lat_ax: Any, latencies_drawn: bool) -> None:
    from matplotlib.lines import Line2D

    hollow = Line2D([], [], marker="o", color="grey", markerfacecolor="white", linestyle="none",
                    label="SLO not met at this load")
    handles, labels = util_ax.get_legend_handles_labels()
    if handles:
        util_ax.legend([*handles, hollow], [*labels, hollow.get_label()], fontsize=8, loc="lower right")
    if latencies_drawn:
        # Colour is the gmu column (as in the panels above); the line style is which latency.
        styles = [Line2D([], [], color="dimgrey", linestyle=style, marker="o", label=name)
                  for (_, name, _), style in zip(_LATENCIES, LATENCY_STYLES, strict=True)]
        lat_ax.legend(handles=styles, fontsize=8, loc="best")


def _headings(fig: Any, title: str, picture: CurvePicture) -> None:
    """The figure's title with the common load, and under it the trials left out for want of a reading there."""
    heading = title or "BatchTuning"
    if picture.load:
        heading += f"\nGPU utilization, throughput and latency at one offered load: {picture.load}"
        if picture.source:
            heading += "\n" + _shorten(picture.source, 150)
    # Text from status is shown as written: never parsed as mathtext ("$...$" in a message must not break the image).
    fig.suptitle(heading, fontsize=11, parse_math=False)
    if picture.missing:
        note = "Not at the common load (left out, not drawn at another load): " + "; ".join(picture.missing)
        fig.text(0.01, 0.002, "\n".join(textwrap.wrap(_shorten(note, 600), 170)), fontsize=7, color="firebrick",
                 va="bottom", ha="left", parse_math=False)
        fig.get_layout_engine().set(rect=(0, 0.05, 1, 0.95))


def latency_ceiling(points: Sequence[CurvePoint], slo: SloSpec) -> float:
    """Where the latency panel draws a reading beyond the histogram's last bucket: 4x above the highest
    finite latency or SLO target, so the finite curve keeps its scale."""
    finite = [y for p in points for key, _, _ in _LATENCIES
              if not math.isnan(y := _number(p.metrics.get(key))) and 0 < y < BEYOND_LAST_BUCKET_MS]
    targets = [float(t) for _, t in _slo_targets(slo)]
    return 4 * max(finite + targets, default=1000.0)


def _line(ax: Any, xs: list[int], ys: list[float], points: list[CurvePoint], color: str, style: str,
          label: str, beyond: Sequence[bool] = ()) -> None:
    ax.plot(xs, ys, marker="o", color=color, linestyle=style, label=label)
    clipped = list(beyond) or [False] * len(xs)
    misses = [(x, y) for x, y, p, c in zip(xs, ys, points, clipped, strict=True)
              if p.verdict != "Met" and not math.isnan(y) and not c]
    if misses:
        ax.plot([m[0] for m in misses], [m[1] for m in misses], marker="o", linestyle="none", color=color,
                markerfacecolor="white", zorder=4)
    over = [(x, y) for x, y, c in zip(xs, ys, clipped, strict=True) if c]
    if over:
        ax.plot([o[0] for o in over], [o[1] for o in over], marker="^", markersize=9, linestyle="none",
                color=color, markerfacecolor="white", zorder=5)


def _capacity_panel(ax: Any, done: Sequence[TrialRecord], colors: Mapping[tuple[int, int], str]) -> None:
    """SLO capacity per trial: each at the highest load its own search found within the SLO."""
    ax.set_title("SLO capacity (each trial at its own highest passing load)", fontsize=10)
    ax.set_ylabel("requests/s within the SLO")
    columns: dict[tuple[int, int], list[tuple[int, float]]] = {}
    for trial in done:
        capacity = _number((trial.metrics or {}).get(M.SLO_CAPACITY))
        if not math.isnan(capacity):
            columns.setdefault(_column(trial.setting), []).append((trial.setting.max_num_seqs, capacity))
    for (gmu, mbt), column in sorted(columns.items()):
        group = sorted(column, key=lambda point: point[0])
        ax.plot([seqs for seqs, _ in group], [capacity for _, capacity in group],
                marker="s", color=colors.get((gmu, mbt), "black"), label=f"gmu {gmu}%" + (f", mbt {mbt}" if mbt else ""))
    if columns:
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8, loc="best")
    else:
        ax.text(0.5, 0.5, "no SLO capacity in this status\n(the objective does not search it,\n"
                "or no trial met the SLO)", transform=ax.transAxes, ha="center", va="center", fontsize=9,
                color="dimgrey")


def _shorten(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def curves_png_isolated(tuning: Tuning, title: str = "", timeout_s: float = 120) -> bytes:
    """`curves_png` in a short-lived process: matplotlib's memory (~100-200 MB per render, never
    returned to the OS) and CPU stay out of the long-running operator."""
    import subprocess
    import sys

    request = json.dumps({**tuning.to_wire(), "title": title})
    done = subprocess.run([sys.executable, "-m", "batchtune.report"], input=request.encode(),
                          capture_output=True, timeout=timeout_s, check=False)
    if done.returncode != 0 or not done.stdout.startswith(b"\x89PNG"):
        raise RuntimeError(f"rendering the curves failed: {done.stderr.decode(errors='replace')[-500:]}")
    return done.stdout


if __name__ == "__main__":
    import sys

    args = json.load(sys.stdin)
    # The request is the operator's own typed status written out: parsed again here, at this process's edge.
    sys.stdout.buffer.write(curves_png(Tuning.from_wire(args["namespace"], args["name"], args["spec"], args["status"]),
                                       title=args["title"]))
