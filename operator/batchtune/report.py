"""The tuning report: trial table as CSV and JSON, and the three curves against max-num-seqs."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Mapping, Sequence
from typing import Any

CSV_COLUMNS = [
    "name", "maxNumSeqs", "gpuMemoryUtilizationPercent", "maxNumBatchedTokens", "state", "verdict",
    "requestThroughput", "outputThroughput", "ttftMs", "itlMs", "e2eMs", "gpuUtilPercent",
    "smActivePercent", "kvCacheUsagePercent", "preemptionsPerSecond", "powerWatts", "sloCapacity", "reason",
]
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


def curves_png(trials: Sequence[Mapping[str, Any]], *, chosen: str | None, knee_seqs: int | None,
               slo: Mapping[str, Any], percentile: str = "P95", title: str = "") -> bytes:
    """GPU utilization, output throughput and latency against max-num-seqs, one line per gmu."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [t for t in trials if t.get("state") == "Done" and t.get("metrics")]
    by_gmu: dict[tuple[int, int | None], list[Mapping[str, Any]]] = {}
    for t in done:
        s = t["setting"]
        by_gmu.setdefault((s.get("gpuMemoryUtilizationPercent"), s.get("maxNumBatchedTokens")), []).append(t)

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6), constrained_layout=True)
    # DCGM's GPU_UTIL reads ~100% whenever any kernel runs; SM active shows the batching curve.
    has_sm = any((t["metrics"] or {}).get("smActivePercent") is not None for t in done)
    util_key, util_label = (("smActivePercent", "SM active (%, DCGM PROF_SM_ACTIVE)") if has_sm
                            else ("gpuUtilPercent", "GPU utilization (%, DCGM GPU_UTIL)"))
    panels = [
        (axes[0], util_key, util_label, "GPU utilization"),
        (axes[1], "outputThroughput", "output throughput (tokens/s)", "Throughput"),
    ]
    for (gmu, mbt), group in sorted(by_gmu.items(), key=lambda kv: (kv[0][0] or 0, kv[0][1] or 0)):
        group = sorted(group, key=lambda t: t["setting"]["maxNumSeqs"])
        xs = [t["setting"]["maxNumSeqs"] for t in group]
        label = f"gmu {gmu}%" + (f", mbt {mbt}" if mbt else "")
        for ax, key, _, _ in panels:
            ys = [(t["metrics"].get(key)) for t in group]
            ax.plot(xs, [float("nan") if y is None else y for y in ys], marker="o", label=label)
        for key, name, _ in _LATENCIES:
            ys = [t["metrics"].get(key) for t in group]
            if any(y is not None for y in ys):
                axes[2].plot(xs, [float("nan") if y is None else y for y in ys], marker="o",
                             label=f"{name}, {label}")
    for ax, _, ylabel, heading in panels:
        ax.set_ylabel(ylabel)
        ax.set_title(heading)
    axes[0].set_ylim(0, 105)
    axes[2].set_ylabel(f"{percentile.lower()} latency (ms)")
    axes[2].set_title(f"{percentile} latency")
    axes[2].set_yscale("log")
    for _key, name, slo_field in _LATENCIES:
        target = slo.get(slo_field)
        if target:
            axes[2].axhline(target, linestyle="--", linewidth=1, color="grey")
            axes[2].annotate(f"{name} SLO {target} ms", (0.99, target), xycoords=("axes fraction", "data"),
                             fontsize=8, color="grey", va="bottom", ha="right")
    chosen_trial = next((t for t in done if t.get("name") == chosen), None)
    from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter

    seqs = sorted({t["setting"]["maxNumSeqs"] for t in done})
    for ax in axes:
        ax.set_xscale("log", base=2)
        if seqs:
            ax.xaxis.set_major_locator(FixedLocator(seqs))
            ax.xaxis.set_minor_locator(NullLocator())
            ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.set_xlabel("--max-num-seqs (log scale)")
        ax.grid(True, alpha=0.3)
        if chosen_trial:
            ax.axvline(chosen_trial["setting"]["maxNumSeqs"], color="tab:green", linewidth=6, alpha=0.25,
                       label=f"chosen ({chosen_trial['setting']['maxNumSeqs']})")
        if knee_seqs:
            ax.axvline(knee_seqs, color="tab:orange", linestyle=":", linewidth=2, zorder=5,
                       label=f"knee ({knee_seqs})")
    if chosen_trial:
        x, metrics = chosen_trial["setting"]["maxNumSeqs"], chosen_trial["metrics"]
        for ax, key in ((axes[0], util_key), (axes[1], "outputThroughput")):
            if metrics.get(key) is not None:
                ax.plot([x], [metrics[key]], marker="*", markersize=16, color="tab:green", zorder=6)
    if axes[2].get_legend_handles_labels()[0]:
        axes[2].legend(fontsize=7, loc="best")
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize=8, loc="lower right")
    if title:
        fig.suptitle(title)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def curves_png_isolated(trials: Sequence[Mapping[str, Any]], *, chosen: str | None, knee_seqs: int | None,
                        slo: Mapping[str, Any], percentile: str = "P95", title: str = "",
                        timeout_s: float = 120) -> bytes:
    """`curves_png` in a short-lived process: matplotlib's memory (~100-200 MB per render, never
    returned to the OS) and CPU stay out of the long-running operator."""
    import subprocess
    import sys

    request = json.dumps({"trials": list(trials), "chosen": chosen, "knee_seqs": knee_seqs, "slo": dict(slo),
                          "percentile": percentile, "title": title}, default=str)
    done = subprocess.run([sys.executable, "-m", "batchtune.report"], input=request.encode(),
                          capture_output=True, timeout=timeout_s, check=False)
    if done.returncode != 0 or not done.stdout.startswith(b"\x89PNG"):
        raise RuntimeError(f"rendering the curves failed: {done.stderr.decode(errors='replace')[-500:]}")
    return done.stdout


if __name__ == "__main__":
    import sys

    args = json.load(sys.stdin)
    sys.stdout.buffer.write(curves_png(args["trials"], chosen=args["chosen"], knee_seqs=args["knee_seqs"],
                                       slo=args["slo"], percentile=args["percentile"], title=args["title"]))
