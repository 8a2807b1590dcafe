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

from batchtune.api.models import BEYOND_LAST_BUCKET_MS
from batchtune.core.vocabulary import M

CSV_COLUMNS = [
    "name", "maxNumSeqs", "gpuMemoryUtilizationPercent", "maxNumBatchedTokens", "state", "verdict",
    "requestThroughput", "outputThroughput", "ttftMs", "itlMs", "e2eMs", "gpuUtilPercent",
    "smActivePercent", "kvCacheUsagePercent", "preemptionsPerSecond", "powerWatts", "sloCapacity", "reason",
]
LATENCY_STYLES: tuple[Literal["-", "--", ":"], ...] = ("-", "--", ":")
_LATENCIES = (("ttftMs", "TTFT", "ttftMilliseconds"), ("itlMs", "inter-token", "interTokenLatencyMilliseconds"),
              ("e2eMs", "end-to-end", "e2eLatencyMilliseconds"))


def _row(trial: Mapping[str, Any]) -> dict[str, Any]:
    setting = trial.get("setting") or {}
    metrics = trial.get("metrics") or {}
    row = {"name": trial.get("name"), "state": trial.get("state"), "verdict": trial.get("verdict"),
           "reason": trial.get("verdictReason") or trial.get("reason") or ""}
    row.update({k: setting.get(k) for k in ("maxNumSeqs", "gpuMemoryUtilizationPercent", "maxNumBatchedTokens")})
    row.update({k: metrics.get(k) for k in CSV_COLUMNS if k in metrics})
    return row


def trials_csv(trials: Sequence[Mapping[str, Any]]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=CSV_COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for trial in trials:
        writer.writerow({k: ("" if v is None else v) for k, v in _row(trial).items()})
    return out.getvalue()


def trials_json(trials: Sequence[Mapping[str, Any]], summary: Mapping[str, Any]) -> str:
    return json.dumps({"summary": dict(summary), "trials": [dict(t) for t in trials]}, indent=2, sort_keys=True)


@dataclass(frozen=True)
class CurvePoint:
    """One trial's reading at the common curve load."""

    name: str
    setting: Mapping[str, Any]
    metrics: Mapping[str, Any]
    verdict: str | None
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


def curve_load_label(curve_load: Mapping[str, Any] | None) -> str | None:
    if not curve_load:
        return None
    if curve_load.get("requestsPerMinute"):
        return f"{curve_load['requestsPerMinute']} requests/min (open loop)"
    if curve_load.get("concurrency"):
        return f"{curve_load['concurrency']} concurrent requests (closed loop)"
    return None


def curve_picture(trials: Sequence[Mapping[str, Any]], curve_load: Mapping[str, Any] | None,
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
        if trial.get("state") != "Done":
            continue
        name = str(trial.get("name", "?"))
        steps = [s for s in trial.get("steps") or [] if isinstance(s, Mapping)]
        at = trial.get("curveStep")
        step = steps[at] if isinstance(at, int) and not isinstance(at, bool) and 0 <= at < len(steps) else None
        if step is not None and isinstance(step.get("metrics"), Mapping) and step["metrics"]:
            points.append(CurvePoint(name, trial.get("setting") or {}, step["metrics"], step.get("verdict")))
            continue
        curve = next((s for s in steps if s.get("purpose") == "Curve"), None)
        why = str(curve.get("verdictReason") or "not measured yet") if curve else "no step at the common load"
        missing.append(f"{name} ({_setting_label(trial.get('setting') or {})}): {why}")
    return CurvePicture(label, str((curve_load or {}).get("source") or ""), points, missing)


def _setting_label(setting: Mapping[str, Any]) -> str:
    out = f"seqs {setting.get('maxNumSeqs')}, gmu {setting.get('gpuMemoryUtilizationPercent')}%"
    return out + (f", mbt {setting['maxNumBatchedTokens']}" if setting.get("maxNumBatchedTokens") else "")


def _number(value: Any) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return float("nan")


def _column(setting: Mapping[str, Any]) -> tuple[int, int]:
    return (_int(setting.get("gpuMemoryUtilizationPercent")), _int(setting.get("maxNumBatchedTokens")))


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def curves_png(trials: Sequence[Mapping[str, Any]], *, chosen: str | None, knee_seqs: int | None,  # noqa: C901
               slo: Mapping[str, Any], percentile: str = "P95", title: str = "",
               curve_load: Mapping[str, Any] | None = None, curves_off: bool = False) -> bytes:
    """GPU utilization, output throughput and latency against max-num-seqs at ONE common offered load
    (`curve_load`, status.plan.curveLoad), one line per gmu; SLO capacity, each trial at its own
    highest passing load, in a panel of its own. A trial without a reading at the common load is
    left out and named under the figure, never drawn at another load."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter

    picture = curve_picture(trials, curve_load, curves_off)
    done = [t for t in trials if t.get("state") == "Done" and isinstance(t.get("setting"), Mapping)
            and isinstance(t["setting"].get("maxNumSeqs"), int)]
    fig, grid = plt.subplots(2, 2, figsize=(12, 8.2), constrained_layout=True)
    util_ax, tput_ax, lat_ax, cap_ax = grid[0][0], grid[0][1], grid[1][0], grid[1][1]
    # DCGM's GPU_UTIL reads ~100% whenever any kernel runs; SM active shows the batching curve.
    has_sm = any(not math.isnan(_number(p.metrics.get(M.SM_ACTIVE_PERCENT))) for p in picture.points)
    util_key, util_label = ((M.SM_ACTIVE_PERCENT, "SM active (%, DCGM PROF_SM_ACTIVE)") if has_sm
                            else (M.GPU_UTIL_PERCENT, "GPU utilization (%, DCGM GPU_UTIL)"))
    at = f" at {picture.load}" if picture.load else ""
    panels = [(util_ax, util_key, util_label, "GPU utilization" + at),
              (tput_ax, M.OUTPUT_THROUGHPUT, "output throughput (tokens/s)", "Throughput" + at)]
    columns: dict[tuple[int, int], list[CurvePoint]] = {}
    for point in picture.points:
        if isinstance(point.setting.get("maxNumSeqs"), int):
            columns.setdefault(_column(point.setting), []).append(point)
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    # One colour per (gmu, mbt) column in every panel, whichever panels it has points in.
    colors = {col: cycle[i % len(cycle)] for i, col in enumerate(sorted({_column(t["setting"]) for t in done}))}
    latencies_drawn = False
    # A latency beyond the histogram's last bucket (status holds +inf as BEYOND_LAST_BUCKET_MS: an overloaded
    # setting at this load) is drawn at a ceiling above every finite reading, not at 10^12 ms.
    ceiling = latency_ceiling(picture.points, slo)
    overloaded = False
    for (gmu, mbt), group in sorted(columns.items()):
        group = sorted(group, key=lambda p: p.setting["maxNumSeqs"])
        xs = [p.setting["maxNumSeqs"] for p in group]
        label = f"gmu {gmu}%" + (f", mbt {mbt}" if mbt else "")
        color = colors.get((gmu, mbt), "black")
        for ax, key, _, _ in panels:
            _line(ax, xs, [_number(p.metrics.get(key)) for p in group], group, color, "-", label)
        for (latency, name, _), style in zip(_LATENCIES, LATENCY_STYLES, strict=True):
            ys = [_number(p.metrics.get(latency)) for p in group]
            if any(not math.isnan(y) for y in ys):
                latencies_drawn = True
                beyond = [y >= BEYOND_LAST_BUCKET_MS for y in ys]
                overloaded = overloaded or any(beyond)
                _line(lat_ax, xs, [ceiling if b else y for y, b in zip(ys, beyond, strict=True)], group, color,
                      style, f"{name}, {label}", beyond)
    for ax, _, ylabel, heading in panels:
        ax.set_ylabel(ylabel)
        ax.set_title(heading, fontsize=10)
    util_ax.set_ylim(0, 105)
    lat_ax.set_ylabel(f"{percentile.lower()} latency (ms, log scale)")
    lat_ax.set_title(f"{percentile} latency" + at, fontsize=10)
    if latencies_drawn:
        lat_ax.set_yscale("log")
        for _key, name, slo_field in _LATENCIES:
            target = slo.get(slo_field)
            if isinstance(target, (int, float)) and target > 0:
                lat_ax.axhline(target, linestyle="--", linewidth=1, color="grey")
                lat_ax.annotate(f"{name} SLO {target} ms", (0.99, target), xycoords=("axes fraction", "data"),
                                fontsize=8, color="grey", va="bottom", ha="right")
        if overloaded:
            lat_ax.axhline(ceiling, linestyle=(0, (1, 3)), linewidth=1, color="firebrick")
            lat_ax.annotate("\u25b2 beyond the latency histogram's last bucket (overloaded at this load)",
                            (0.01, ceiling), xycoords=("axes fraction", "data"), fontsize=8, color="firebrick",
                            va="bottom", ha="left")
            lat_ax.set_ylim(top=ceiling * 4)
    if not picture.points:
        why = picture.why_none or "no Done trial has a reading at the common load"
        for ax in (util_ax, tput_ax, lat_ax):
            ax.text(0.5, 0.5, "\n".join(textwrap.wrap(why, 48)), transform=ax.transAxes, ha="center",
                    va="center", fontsize=9, color="dimgrey", parse_math=False)
    _capacity_panel(cap_ax, done, colors)
    seqs = sorted({t["setting"]["maxNumSeqs"] for t in done})
    chosen_trial = next((t for t in done if t.get("name") == chosen), None)
    for ax in (util_ax, tput_ax, lat_ax, cap_ax):
        ax.set_xscale("log", base=2)
        if seqs:
            ax.xaxis.set_major_locator(FixedLocator(seqs))
            ax.xaxis.set_minor_locator(NullLocator())
            ax.xaxis.set_major_formatter(ScalarFormatter())
            ax.set_xlim(seqs[0] / 1.4, seqs[-1] * 1.4)
        ax.set_xlabel("--max-num-seqs (log scale)")
        ax.grid(True, alpha=0.3)
        if chosen_trial:
            ax.axvline(chosen_trial["setting"]["maxNumSeqs"], color="tab:green", linewidth=6, alpha=0.25,
                       label=f"chosen ({chosen_trial['setting']['maxNumSeqs']})")
        if knee_seqs:
            ax.axvline(knee_seqs, color="tab:orange", linestyle=":", linewidth=2, zorder=5,
                       label=f"knee ({knee_seqs})")
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
        fig.get_layout_engine().set(rect=(0, 0.05, 1, 0.95))  # type: ignore[union-attr, call-arg]
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    plt.close(fig)
    return buf.getvalue()


def latency_ceiling(points: Sequence[CurvePoint], slo: Mapping[str, Any]) -> float:
    """Where the latency panel draws a reading beyond the histogram's last bucket: 4x above the highest
    finite latency or SLO target, so the finite curve keeps its scale."""
    finite = [y for p in points for key, _, _ in _LATENCIES
              if not math.isnan(y := _number(p.metrics.get(key))) and 0 < y < BEYOND_LAST_BUCKET_MS]
    targets = [float(t) for _, _, f in _LATENCIES if isinstance(t := slo.get(f), (int, float))
               and not isinstance(t, bool) and t > 0]
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


def _capacity_panel(ax: Any, done: list[Mapping[str, Any]], colors: Mapping[tuple[int, int], str]) -> None:
    """SLO capacity per trial: each at the highest load its own search found within the SLO."""
    ax.set_title("SLO capacity (each trial at its own highest passing load)", fontsize=10)
    ax.set_ylabel("requests/s within the SLO")
    columns: dict[tuple[int, int], list[Mapping[str, Any]]] = {}
    for trial in done:
        if not math.isnan(_number((trial.get("metrics") or {}).get(M.SLO_CAPACITY))):
            columns.setdefault(_column(trial["setting"]), []).append(trial)
    for (gmu, mbt), group in sorted(columns.items()):
        group = sorted(group, key=lambda t: t["setting"]["maxNumSeqs"])
        ax.plot([t["setting"]["maxNumSeqs"] for t in group], [t["metrics"][M.SLO_CAPACITY] for t in group],
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


def curves_png_isolated(trials: Sequence[Mapping[str, Any]], *, chosen: str | None, knee_seqs: int | None,
                        slo: Mapping[str, Any], percentile: str = "P95", title: str = "",
                        curve_load: Mapping[str, Any] | None = None, curves_off: bool = False,
                        timeout_s: float = 120) -> bytes:
    """`curves_png` in a short-lived process: matplotlib's memory (~100-200 MB per render, never
    returned to the OS) and CPU stay out of the long-running operator."""
    import subprocess
    import sys

    request = json.dumps({"trials": list(trials), "chosen": chosen, "knee_seqs": knee_seqs, "slo": dict(slo),
                          "percentile": percentile, "title": title, "curve_load": curve_load,
                          "curves_off": curves_off}, default=str)
    done = subprocess.run([sys.executable, "-m", "batchtune.report"], input=request.encode(),
                          capture_output=True, timeout=timeout_s, check=False)
    if done.returncode != 0 or not done.stdout.startswith(b"\x89PNG"):
        raise RuntimeError(f"rendering the curves failed: {done.stderr.decode(errors='replace')[-500:]}")
    return done.stdout


if __name__ == "__main__":
    import sys

    args = json.load(sys.stdin)
    sys.stdout.buffer.write(curves_png(args["trials"], chosen=args["chosen"], knee_seqs=args["knee_seqs"],
                                       slo=args["slo"], percentile=args["percentile"], title=args["title"],
                                       curve_load=args.get("curve_load"), curves_off=bool(args.get("curves_off"))))
