"""`batchtune status NAME [--watch]`: where a BatchTuning is, its trials, conditions and decision.

The render functions here take the BatchTuning as the API returns it (a dict) and build rich
renderables; `report` reuses them. Heavy imports stay inside functions so `batchtune --help` is fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

TERMINAL_PHASES = ("Succeeded", "Recommended", "RolledBack", "Failed")
SUCCESSFUL_PHASES = ("Succeeded", "Recommended")
_STATE_STYLE = {"Done": "green", "Infeasible": "red", "Failed": "red", "Pending": "dim",
                "Deploying": "yellow", "Warming": "yellow", "Measuring": "cyan"}
_VERDICT_STYLE = {"Met": "green", "Violated": "red", "Unknown": "magenta"}
_PHASE_STYLE = {"Succeeded": "bold green", "Recommended": "bold green", "RolledBack": "bold red",
                "Failed": "bold red"}


def add_common_arguments(p: argparse.ArgumentParser) -> None:
    """NAME, -n and the kubeconfig flags every user command shares (kubectl's names)."""
    p.add_argument("name", metavar="NAME", help="the BatchTuning")
    p.add_argument("-n", "--namespace", help="its namespace (default: the kubeconfig context's, else default)")
    p.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, else ~/.kube/config)")
    p.add_argument("--context", help="kubeconfig context (default: the current one)")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("status", help="show a BatchTuning's progress, trials and conditions",
                       description="Show a BatchTuning's progress, trials and conditions. With --watch, "
                                   "refresh until it ends; the exit status is then 0 for Succeeded or "
                                   "Recommended and 1 for Failed or RolledBack.")
    add_common_arguments(p)
    p.add_argument("-w", "--watch", action="store_true", help="refresh until a terminal phase (Ctrl-C stops)")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes with --watch")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from batchtune.client import CliError, connect

    try:
        kube = connect(args.kubeconfig, args.context)
        namespace = kube.namespace(args.namespace)
        bt = kube.get_batchtuning(namespace, args.name)
        if not args.watch:
            console().print(render_status(bt, datetime.now(UTC)))
            return 0
        return watch(lambda: kube.get_batchtuning(namespace, args.name), bt, args.interval)
    except CliError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def watch(fetch: Any, bt: Mapping[str, Any], interval: float) -> int:
    """Re-renders until the phase is terminal; a passing API outage shows as a note, not an exit."""
    import time

    from rich.console import Group
    from rich.live import Live
    from rich.text import Text

    from batchtune.client import ApiUnreachable

    out = console()
    with Live(render_status(bt, datetime.now(UTC)), console=out, refresh_per_second=4,
              transient=False, auto_refresh=True) as live:
        while phase_of(bt) not in TERMINAL_PHASES:
            time.sleep(interval)
            try:
                bt = fetch()
                live.update(render_status(bt, datetime.now(UTC)))
            except ApiUnreachable as exc:
                live.update(Group(render_status(bt, datetime.now(UTC)),
                                  Text(f"(stale: {exc}; retrying)", style="yellow")))
    return 0 if phase_of(bt) in SUCCESSFUL_PHASES else 1


def console() -> Any:
    import os

    from rich.console import Console

    # Piped or in CI, rich would assume 80 columns and fold the trial table; logs are wide.
    wide = None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 160
    return Console(highlight=False, width=wide)


# ---- pure rendering --------------------------------------------------------------------

def phase_of(bt: Mapping[str, Any]) -> str:
    return ((bt.get("status") or {}).get("phase")) or "Pending"


def fmt(value: Any, digits: int = 0) -> str:
    """A metric for a table cell: '-' when missing or not a number (NaN included)."""
    if value is None or isinstance(value, bool):
        return "-"
    try:
        number = float(value)
    except (TypeError, ValueError):
        return str(value)
    if number != number:  # NaN
        return "-"
    return f"{number:,.{digits}f}"


def setting_label(setting: Mapping[str, Any] | None) -> str:
    if not setting:
        return "-"
    text = f"max-num-seqs {setting.get('maxNumSeqs')}, gpu-memory-utilization {setting.get('gpuMemoryUtilizationPercent')}%"
    if setting.get("maxNumBatchedTokens"):
        text += f", max-num-batched-tokens {setting['maxNumBatchedTokens']}"
    return text


def age(timestamp: str | None, now: datetime) -> str:
    if not timestamp:
        return "-"
    try:
        then = datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    except ValueError:
        return timestamp
    seconds = max(0, int((now - then).total_seconds()))
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    if seconds < 172800:
        return f"{seconds // 3600}h{(seconds % 3600) // 60:02d}m"
    return f"{seconds // 86400}d"


def _why(trial: Mapping[str, Any]) -> str:
    if trial.get("state") == "Done":
        return trial.get("verdictReason") or trial.get("message") or ""
    reason, message = trial.get("reason"), trial.get("message")
    if reason and message:
        return f"{reason}: {message}"
    return reason or message or ""


def trials_table(bt: Mapping[str, Any]) -> Any:
    """One row per trial: setting, state, verdict, the measured figures, and why."""
    from rich.table import Table
    from rich.text import Text

    status = bt.get("status") or {}
    trials = sorted(status.get("trials") or [], key=lambda t: t.get("index", 0))
    percentile = str(((bt.get("spec") or {}).get("slo") or {}).get("percentile") or "P95").lower()
    best = status.get("bestTrial")
    knee = (status.get("knee") or {}).get("maxNumSeqs")
    with_mbt = any((t.get("setting") or {}).get("maxNumBatchedTokens") for t in trials)
    with_capacity = any((t.get("metrics") or {}).get("sloCapacity") is not None for t in trials)

    table = Table(title="Trials", title_justify="left", header_style="bold", expand=False, pad_edge=False)
    table.add_column("#", justify="right")
    table.add_column("", no_wrap=True)
    table.add_column("max-num-seqs", justify="right")
    table.add_column("gmu %", justify="right")
    if with_mbt:
        table.add_column("batched tok", justify="right")
    table.add_column("state")
    table.add_column("SLO")
    table.add_column("out tok/s", justify="right")
    table.add_column("req/s", justify="right")
    table.add_column(f"TTFT {percentile} ms", justify="right")
    table.add_column(f"ITL {percentile} ms", justify="right")
    table.add_column(f"E2E {percentile} ms", justify="right")
    table.add_column("GPU %", justify="right")
    table.add_column("KV %", justify="right")
    if with_capacity:
        table.add_column("capacity", justify="right")

    for trial in trials:
        setting = trial.get("setting") or {}
        metrics = trial.get("metrics") or {}
        marks = []
        if best and trial.get("name") == best:
            marks.append("★ best")
        if knee and setting.get("maxNumSeqs") == knee:
            marks.append("◆ knee")
        state = trial.get("state") or "Pending"
        verdict = trial.get("verdict") or ""
        row: list[str | Text] = [str(trial.get("index", "")), " ".join(marks), str(setting.get("maxNumSeqs", "-")),
               str(setting.get("gpuMemoryUtilizationPercent", "-"))]
        if with_mbt:
            row.append(str(setting.get("maxNumBatchedTokens") or "-"))
        row += [Text(state, style=_STATE_STYLE.get(state, "")), Text(verdict, style=_VERDICT_STYLE.get(verdict, "")),
                fmt(metrics.get("outputThroughput")), fmt(metrics.get("requestThroughput"), 2),
                fmt(metrics.get("ttftMs")), fmt(metrics.get("itlMs"), 1), fmt(metrics.get("e2eMs")),
                fmt(metrics.get("gpuUtilPercent")), fmt(metrics.get("kvCacheUsagePercent"))]
        if with_capacity:
            row.append(fmt(metrics.get("sloCapacity"), 1))
        table.add_row(*row, style="bold" if best and trial.get("name") == best else None)
    if not trials:
        table.add_row(*(["", "", "(no trial yet)"] + [""] * (len(table.columns) - 3)))
    return table


def trial_notes(bt: Mapping[str, Any]) -> Any:
    """Why each trial ended as it did, one line per trial under the table (too long for a cell)."""
    from rich.text import Text

    status = bt.get("status") or {}
    text = Text()
    for trial in sorted(status.get("trials") or [], key=lambda t: t.get("index", 0)):
        why = _why(trial)
        if not why:
            continue
        if text.plain:
            text.append("\n")
        style = "green" if status.get("bestTrial") == trial.get("name") else (
            "red" if trial.get("state") in ("Infeasible", "Failed") else "")
        text.append(f"  #{trial.get('index', '?')} ", style="bold")
        text.append(why, style=style)
    return text


def conditions_table(bt: Mapping[str, Any], now: datetime) -> Any:
    from rich.table import Table
    from rich.text import Text

    table = Table(title="Conditions", title_justify="left", header_style="bold", pad_edge=False)
    for column in ("type", "status", "reason", "age"):
        table.add_column(column, no_wrap=True)
    table.add_column("message", overflow="fold", max_width=90)
    for cond in (bt.get("status") or {}).get("conditions") or []:
        value = cond.get("status", "")
        bad = (cond.get("type") in ("Failed", "Degraded")) == (value == "True")
        table.add_row(cond.get("type", ""), Text(value, style="red" if bad else "green"), cond.get("reason", ""),
                      age(cond.get("lastTransitionTime"), now), cond.get("message", ""))
    return table


def header(bt: Mapping[str, Any], now: datetime) -> Any:
    """Name, target, phase, and a progress bar over the planned trials."""
    from rich.console import Group
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text

    meta = bt.get("metadata") or {}
    spec = bt.get("spec") or {}
    status = bt.get("status") or {}
    phase = phase_of(bt)
    progressing: dict[str, Any] = next((c for c in status.get("conditions") or [] if c.get("type") == "Progressing"), {})
    title = Text.assemble(
        ("BatchTuning ", "bold"), (f"{meta.get('namespace', '')}/{meta.get('name', '')}", "bold cyan"),
        "  target Deployment ", (str((spec.get("targetRef") or {}).get("name", "-")), "cyan"),
        "  phase ", (phase, _PHASE_STYLE.get(phase, "bold yellow")),
        (f" ({progressing['reason']})" if progressing.get("reason") else "", "dim"),
        f"  age {age(meta.get('creationTimestamp'), now)}",
    )
    planned = int(status.get("trialsPlanned") or 0)
    done = int(status.get("trialsCompleted") or 0)
    running = sum(1 for t in status.get("trials") or [] if t.get("state") in ("Deploying", "Warming", "Measuring"))
    grid = Table.grid(padding=(0, 1))
    grid.add_row(Text("trials", style="bold"), ProgressBar(total=max(planned, 1), completed=min(done, planned or 1),
                                                            width=30),
                 Text(f"{done}/{planned} done" + (f", {running} running" if running else "")))
    lines: list[Any] = [title, grid]
    if not status:
        lines.append(Text("no status yet: the operator has not picked this BatchTuning up (is it running? "
                          "kubectl get pods -A -l app.kubernetes.io/name=batchtune)", style="yellow"))
    if status.get("bestSetting"):
        lines.append(Text.assemble(("best  ", "bold"), (str(status["bestSetting"]), "green"),
                                   f"  (trial {status.get('bestTrial', '-')})"))
    pruned = status.get("pruned") or []
    if pruned:
        sample = "; ".join(f"{setting_label(p.get('setting'))}: {p.get('message') or p.get('reason', '')}" for p in pruned[:2])
        lines.append(Text(f"pruned before any GPU was used: {len(pruned)} setting(s), e.g. {sample}", style="dim"))
    return Group(*lines)


def decision(bt: Mapping[str, Any]) -> Any:
    """The decision with its reasons: setting, knee, replicas hint, and what happened in production."""
    from rich.text import Text

    status = bt.get("status") or {}
    phase = phase_of(bt)
    rec = status.get("recommendation") or {}
    knee = status.get("knee") or {}
    applied = status.get("applied") or {}
    text = Text()
    if rec:
        text.append("Decision: ", style="bold")
        text.append(setting_label(rec.get("setting")), style="bold green")
        if status.get("bestTrial"):
            text.append(f"  (trial {status['bestTrial']})")
        text.append("\n  why: ", style="bold")
        text.append(str(rec.get("reason", "")))
        if rec.get("args"):
            text.append("\n  args: ", style="bold")
            text.append(" ".join(str(a) for a in rec["args"]))
        if rec.get("replicasHint"):
            text.append("\n  replicas: ", style="bold")
            text.append(f"{rec['replicasHint']} would serve production's current load at this setting")
    elif phase == "Failed":
        failed: dict[str, Any] = next((c for c in status.get("conditions") or [] if c.get("type") == "Failed"), {})
        text.append("No decision: ", style="bold red")
        text.append(f"{failed.get('reason', 'Failed')}: {failed.get('message', '')}")
    if knee:
        text.append("\n  knee: ", style="bold")
        text.append(f"max-num-seqs {knee.get('maxNumSeqs')}: {knee.get('reason', '')}")
    if applied.get("appliedAt"):
        text.append("\n  production: ", style="bold")
        text.append(f"patched at {applied['appliedAt']}")
        if applied.get("verifiedAt"):
            text.append(f", verified at {applied['verifiedAt']}", style="green")
        if applied.get("rolledBackAt"):
            text.append(f", rolled back at {applied['rolledBackAt']}", style="red")
    elif phase == "Recommended":
        text.append("\n  production: ", style="bold")
        text.append(f"not changed (Recommend mode); apply with `batchtune recommend {(bt.get('metadata') or {}).get('name', 'NAME')} -o patch`")
    return text


def render_status(bt: Mapping[str, Any], now: datetime) -> Any:
    from rich.console import Group
    from rich.text import Text

    parts: list[Any] = [header(bt, now), Text(""), trials_table(bt)]
    notes = trial_notes(bt)
    if notes.plain:
        parts.append(notes)
    if (bt.get("status") or {}).get("conditions"):
        parts += [Text(""), conditions_table(bt, now)]
    made = decision(bt)
    if made.plain:
        parts += [Text(""), made]
    return Group(*parts)
