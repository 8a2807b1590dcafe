"""`batchtune status NAME [--watch]`: where a BatchTuning is, its trials, conditions and decision.

The render functions here take the BatchTuning as the API returns it (a dict) and build rich
renderables; `report` reuses them. Every string from the object reaches the terminal through
`batchtune.terminal` (control characters escaped, never parsed as rich markup). Heavy imports
stay inside functions so `batchtune --help` is fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from batchtune.terminal import clean, safe, text

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
        print(f"error: {safe(exc)}", file=sys.stderr)
        return 1


def watch(fetch: Any, bt: Mapping[str, Any], interval: float) -> int:
    """Re-renders until the phase is terminal; a passing API outage shows as a note, not an exit.

    In a terminal: the live table. Elsewhere (CI, `tee`): one plain line per thing that happened, then
    the full status once at the end.
    """
    out = console()
    if not out.is_terminal:
        return watch_lines(fetch, bt, interval, out)
    import time

    from rich.console import Group
    from rich.live import Live
    from rich.text import Text

    from batchtune.client import ApiUnreachable

    with Live(render_status(bt, datetime.now(UTC)), console=out, refresh_per_second=4,
              transient=False, auto_refresh=True) as live:
        while phase_of(bt) not in TERMINAL_PHASES:
            time.sleep(interval)
            try:
                bt = fetch()
                live.update(render_status(bt, datetime.now(UTC)))
            except ApiUnreachable as exc:
                live.update(Group(render_status(bt, datetime.now(UTC)),
                                  Text(f"(stale: {safe(exc)}; retrying)", style="yellow")))
    return 0 if phase_of(bt) in SUCCESSFUL_PHASES else 1


def watch_lines(fetch: Any, bt: Mapping[str, Any], interval: float, out: Any) -> int:
    """`--watch` for a log: a timestamped line per transition (batchtune.cli.progress)."""
    import time

    from rich.text import Text

    from batchtune.cli.progress import changes
    from batchtune.client import ApiUnreachable

    def say(line: str) -> None:
        out.print(Text(f"{datetime.now(UTC):%H:%M:%S} {line}"), soft_wrap=True)

    for line in changes(None, bt) or [f"phase {safe(phase_of(bt))}"]:
        say(line)
    unreachable = False
    while phase_of(bt) not in TERMINAL_PHASES:
        time.sleep(interval)
        try:
            latest = fetch()
        except ApiUnreachable as exc:
            if not unreachable:
                say(f"(API unreachable: {safe(exc)}; retrying)")
            unreachable = True
            continue
        unreachable = False
        for line in changes(bt, latest):
            say(line)
        bt = latest
    out.print(render_status(bt, datetime.now(UTC)))
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
        return safe(value)
    if number != number:  # NaN
        return "-"
    return f"{number:,.{digits}f}"


def setting_label(setting: Mapping[str, Any] | None) -> str:
    if not setting:
        return "-"
    label = f"max-num-seqs {setting.get('maxNumSeqs')}, gpu-memory-utilization {setting.get('gpuMemoryUtilizationPercent')}%"
    if setting.get("maxNumBatchedTokens"):
        label += f", max-num-batched-tokens {setting['maxNumBatchedTokens']}"
    return safe(label)


def age(timestamp: str | None, now: datetime) -> str:
    if not timestamp:
        return "-"
    if not isinstance(timestamp, str):
        return safe(timestamp)
    try:
        then = datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
        seconds = max(0, int((now - then).total_seconds()))
    except (TypeError, ValueError):  # unparsable, or without a time zone
        return safe(timestamp)
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    if seconds < 172800:
        return f"{seconds // 3600}h{(seconds % 3600) // 60:02d}m"
    return f"{seconds // 86400}d"


def _why(trial: Mapping[str, Any]) -> str:
    """Why the trial ended as it did, on one line (an engine message's newlines shown as \\n)."""
    if trial.get("state") == "Done":
        return safe(trial.get("verdictReason") or trial.get("message") or "")
    reason, message = trial.get("reason"), trial.get("message")
    if reason and message:
        return safe(f"{reason}: {message}")
    return safe(reason or message or "")


def trials_table(bt: Mapping[str, Any]) -> Any:
    """One row per trial: setting, state, verdict, the measured figures, and why."""
    from rich.table import Table

    bt = clean(bt)
    status = bt.get("status") or {}
    trials = sorted(status.get("trials") or [], key=_index)
    percentile = str(((bt.get("spec") or {}).get("slo") or {}).get("percentile") or "P95").lower()
    best = status.get("bestTrial")
    knee = (status.get("knee") or {}).get("maxNumSeqs")
    with_mbt = any((t.get("setting") or {}).get("maxNumBatchedTokens") for t in trials)
    with_capacity = any((t.get("metrics") or {}).get("sloCapacity") is not None for t in trials)
    with_goodput = any((t.get("metrics") or {}).get("goodput") is not None for t in trials)

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
    percentile = safe(percentile)
    table.add_column(text(f"TTFT {percentile} ms"), justify="right")
    table.add_column(text(f"ITL {percentile} ms"), justify="right")
    table.add_column(text(f"E2E {percentile} ms"), justify="right")
    table.add_column("GPU %", justify="right")
    table.add_column("KV %", justify="right")
    if with_capacity:
        table.add_column("capacity", justify="right")
    if with_goodput:
        table.add_column("goodput", justify="right")

    for trial in trials:
        setting = trial.get("setting") or {}
        metrics = trial.get("metrics") or {}
        marks = []
        if best and trial.get("name") == best:
            marks.append("★ best")
        if knee and setting.get("maxNumSeqs") == knee:
            marks.append("◆ knee")
        if trial.get("current"):
            marks.append("● production")
        state = str(trial.get("state") or "Pending")
        verdict = str(trial.get("verdict") or "")
        cells: list[Any] = [trial.get("index", ""), " ".join(marks), setting.get("maxNumSeqs", "-"),
                            setting.get("gpuMemoryUtilizationPercent", "-")]
        if with_mbt:
            cells.append(setting.get("maxNumBatchedTokens") or "-")
        row = [text(cell) for cell in cells]
        row += [text(state, _STATE_STYLE.get(state, "")), text(verdict, _VERDICT_STYLE.get(verdict, ""))]
        figures = [fmt(metrics.get("outputThroughput")), fmt(metrics.get("requestThroughput"), 2),
                   fmt(metrics.get("ttftMs")), fmt(metrics.get("itlMs"), 1), fmt(metrics.get("e2eMs")),
                   fmt(metrics.get("gpuUtilPercent")), fmt(metrics.get("kvCacheUsagePercent"))]
        if with_capacity:
            figures.append(fmt(metrics.get("sloCapacity"), 1))
        if with_goodput:
            figures.append(fmt(metrics.get("goodput"), 2))
        row += [text(figure) for figure in figures]
        table.add_row(*row, style="bold" if best and trial.get("name") == best else None)
    if not trials:
        table.add_row(*(["", "", "(no trial yet)"] + [""] * (len(table.columns) - 3)))
    return table


def _index(trial: Mapping[str, Any]) -> int:
    """Sort key of a trial: its index, and a malformed one last rather than a crash."""
    index = trial.get("index", 0)
    return index if isinstance(index, int) and not isinstance(index, bool) else 1 << 62


def trial_notes(bt: Mapping[str, Any]) -> Any:
    """Why each trial ended as it did, one line per trial under the table (too long for a cell)."""
    from rich.text import Text

    bt = clean(bt)
    status = bt.get("status") or {}
    notes = Text()
    for trial in sorted(status.get("trials") or [], key=_index):
        why = _why(trial)
        if not why:
            continue
        if notes.plain:
            notes.append("\n")
        style = "green" if status.get("bestTrial") == trial.get("name") else (
            "red" if trial.get("state") in ("Infeasible", "Failed") else "")
        notes.append(f"  #{safe(trial.get('index', '?'))} ", style="bold")
        notes.append(why, style=style)
    return notes


def conditions_table(bt: Mapping[str, Any], now: datetime) -> Any:
    from rich.table import Table

    bt = clean(bt)
    table = Table(title="Conditions", title_justify="left", header_style="bold", pad_edge=False)
    for column in ("type", "status", "reason", "age"):
        table.add_column(column, no_wrap=True)
    table.add_column("message", overflow="fold", max_width=90)
    for cond in (bt.get("status") or {}).get("conditions") or []:
        value = cond.get("status", "")
        bad = (cond.get("type") in ("Failed", "Degraded")) == (value == "True")
        table.add_row(text(cond.get("type", "")), text(value, "red" if bad else "green"), text(cond.get("reason", "")),
                      text(age(cond.get("lastTransitionTime"), now)), text(cond.get("message", ""), multiline=True))
    return table


def header(bt: Mapping[str, Any], now: datetime) -> Any:
    """Name, target, phase, and a progress bar over the planned trials."""
    from rich.console import Group
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text

    bt = clean(bt)
    meta = bt.get("metadata") or {}
    spec = bt.get("spec") or {}
    status = bt.get("status") or {}
    phase = safe(phase_of(bt))
    progressing: dict[str, Any] = next((c for c in status.get("conditions") or [] if c.get("type") == "Progressing"), {})
    title = Text.assemble(
        ("BatchTuning ", "bold"), (safe(f"{meta.get('namespace', '')}/{meta.get('name', '')}"), "bold cyan"),
        "  target Deployment ", (safe((spec.get("targetRef") or {}).get("name", "-")), "cyan"),
        "  phase ", (phase, _PHASE_STYLE.get(phase, "bold yellow")),
        (f" ({safe(progressing['reason'])})" if progressing.get("reason") else "", "dim"),
        f"  age {age(meta.get('creationTimestamp'), now)}",
    )
    planned = _count(status.get("trialsPlanned"))
    done = _count(status.get("trialsCompleted"))
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
        lines.append(Text.assemble(("best  ", "bold"), (safe(status["bestSetting"]), "green"),
                                   f"  (trial {safe(status.get('bestTrial', '-'))})"))
    pruned = status.get("pruned") or []
    if pruned:
        sample = "; ".join(f"{setting_label(p.get('setting'))}: {p.get('message') or p.get('reason', '')}" for p in pruned[:2])
        lines.append(text(f"pruned before any GPU was used: {len(pruned)} setting(s), e.g. {sample}", "dim"))
    return Group(*lines)


def _count(value: Any) -> int:
    """A trial count from status; what is not a non-negative integer counts as 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def decision(bt: Mapping[str, Any]) -> Any:  # noqa: C901
    """The decision with its reasons: setting, knee, replicas hint, and what happened in production."""
    from rich.text import Text

    bt = clean(bt)
    status = bt.get("status") or {}
    phase = safe(phase_of(bt))
    rec = status.get("recommendation") or {}
    knee = status.get("knee") or {}
    applied = status.get("applied") or {}
    made = Text()
    if rec:
        made.append("Decision: ", style="bold")
        made.append(setting_label(rec.get("setting")), style="bold green")
        if status.get("bestTrial"):
            made.append(f"  (trial {safe(status['bestTrial'])})")
        made.append("\n  why: ", style="bold")
        made.append(safe(rec.get("reason", ""), multiline=True))
        if rec.get("workload"):
            made.append("\n  for: ", style="bold")
            made.append(safe(rec["workload"]))
        if isinstance(rec.get("args"), list) and rec["args"]:
            made.append("\n  args: ", style="bold")
            made.append(" ".join(safe(a) for a in rec["args"]))
        if rec.get("replicasHint"):
            made.append("\n  replicas: ", style="bold")
            made.append(f"{safe(rec['replicasHint'])} would serve production's observed peak at this setting")
            if rec.get("replicasBasis"):
                made.append(f" ({safe(rec['replicasBasis'])})")
        elif rec.get("replicasBasis"):
            made.append("\n  replicas: ", style="bold")
            made.append(safe(rec["replicasBasis"]))
    elif phase == "Failed":
        failed: dict[str, Any] = next((c for c in status.get("conditions") or [] if c.get("type") == "Failed"), {})
        made.append("No decision: ", style="bold red")
        made.append(safe(f"{failed.get('reason', 'Failed')}: {failed.get('message', '')}", multiline=True))
    if knee:
        made.append("\n  knee: ", style="bold")
        made.append(safe(f"max-num-seqs {knee.get('maxNumSeqs')}: {knee.get('reason', '')}"))
    if applied.get("appliedAt"):
        made.append("\n  production: ", style="bold")
        made.append(f"patched at {safe(applied['appliedAt'])}")
        if applied.get("verifiedAt"):
            made.append(f", verified at {safe(applied['verifiedAt'])}", style="green")
        if applied.get("rolledBackAt"):
            made.append(f", rolled back at {safe(applied['rolledBackAt'])}", style="red")
    elif phase == "Recommended":
        made.append("\n  production: ", style="bold")
        made.append(f"not changed (Recommend mode); apply with `batchtune recommend "
                    f"{safe((bt.get('metadata') or {}).get('name', 'NAME'))} -o patch`")
    return made


def workload_block(bt: Mapping[str, Any], now: datetime) -> Any:
    """The workload the trials drive: production's measured profile (rate, burstiness, lengths) or the spec's."""
    from rich.text import Text

    bt = clean(bt)
    workload = (bt.get("status") or {}).get("workload") or {}
    out = Text()
    if not workload:
        return out
    out.append("Workload: ", style="bold")
    if workload.get("source") != "production":
        out.append(safe(workload.get("summary") or "spec.load's fixed lengths"))
        return out
    out.append(safe(f"production over {fmt(workload.get('lookbackSeconds'))}s, {fmt(workload.get('requests'))} "
                    f"requests, measured {age(workload.get('measuredAt'), now)} ago"))
    burst = workload.get("burstiness")
    out.append("\n  arrivals: ", style="bold")
    out.append(f"{fmt(workload.get('requestsPerSecond'), 2)} req/s mean, {fmt(workload.get('peakRequestsPerSecond'), 2)} "
               f"peak ({fmt(workload.get('rateWindowSeconds'))}s windows), burstiness "
               + (fmt(burst, 2) + (" (Poisson)" if burst == 1 else " (burstier than Poisson)" if
                                   isinstance(burst, (int, float)) and burst < 1 else "")
                  if burst is not None else "not measured (Poisson assumed)"))
    for key, name in (("promptLengths", "prompt"), ("outputLengths", "output")):
        dist = workload.get(key) or {}
        out.append(f"\n  {name} tokens: ", style="bold")
        out.append("mean " + "  ".join([fmt(dist.get("mean"))] + [f"{q} {fmt(dist.get(q))}" for q in ("p50", "p90", "p99")]))
    if workload.get("prefixCacheHitPercent") is not None:
        out.append("\n  prefix cache: ", style="bold")
        out.append(f"{fmt(workload['prefixCacheHitPercent'])}% of prompt tokens hit")
    for note in workload.get("notes") or []:
        out.append("\n  note: ", style="bold yellow")
        out.append(safe(note))
    return out


def rounds_block(bt: Mapping[str, Any], now: datetime) -> Any:
    """Continuous tuning: the last rounds (why each started, production's setting against the best) and the watch."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    bt = clean(bt)
    status = bt.get("status") or {}
    rounds = [r for r in status.get("rounds") or [] if isinstance(r, dict)]
    if not rounds:
        return Group()
    table = Table(title="Rounds (spec.retune)", title_justify="left", header_style="bold", pad_edge=False)
    for column in ("#", "trigger", "started", "production's setting", "best other", "gain %", "outcome"):
        table.add_column(column, justify="right" if column in ("#", "gain %") else "left")
    for r in rounds:
        current = f"{safe(r.get('currentSetting') or '-')} ({fmt(r.get('currentObjective'), 2)})" \
            if r.get("currentTrial") else "-"
        best = f"{safe(r.get('bestSetting') or '-')} ({fmt(r.get('bestObjective'), 2)})" \
            if r.get("bestObjective") is not None else safe(r.get("bestSetting") or "-")
        outcome = safe(r.get("outcome") or ("running" if not r.get("endedAt") else "-"))
        table.add_row(text(r.get("round", "")), text(r.get("trigger", "")), text(age(r.get("startedAt"), now)),
                      text(current), text(best), text(fmt(r.get("improvementPercent"), 1)), text(outcome))
    parts: list[Any] = [table]
    for r in rounds[-1:]:
        if r.get("reason"):
            parts.append(text(f"  round {safe(r.get('round'))} started: {safe(r['reason'])}", "dim"))
    watch = status.get("retune") or {}
    if rounds[-1].get("endedAt") and watch:
        line = Text("  watching: ", style="bold")
        if watch.get("nextCheckAt"):
            line.append(f"next check at {safe(watch['nextCheckAt'])}")
        if watch.get("message"):
            line.append(f"; last check {age(watch.get('lastCheckAt'), now)} ago: {safe(watch['message'])}")
        parts.append(line)
    return Group(*parts)


def render_status(bt: Mapping[str, Any], now: datetime) -> Any:
    from rich.console import Group
    from rich.text import Text

    bt = clean(bt)
    parts: list[Any] = [header(bt, now)]
    workload = workload_block(bt, now)
    if workload.plain:
        parts += [Text(""), workload]
    parts += [Text(""), trials_table(bt)]
    notes = trial_notes(bt)
    if notes.plain:
        parts.append(notes)
    if (bt.get("status") or {}).get("conditions"):
        parts += [Text(""), conditions_table(bt, now)]
    twin = twin_table(bt)
    if twin is not None:
        parts += [Text(""), twin]
    made = decision(bt)
    if made.plain:
        parts += [Text(""), made]
    if (bt.get("status") or {}).get("rounds"):
        parts += [Text(""), rounds_block(bt, now)]
    return Group(*parts)


def twin_table(bt: Mapping[str, Any]) -> Any | None:
    """Strategy TwinGuided: the twin's verdict and, per trial it predicted, predicted against measured."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    bt = clean(bt)
    status = bt.get("status") or {}
    twin = status.get("twin")
    if not isinstance(twin, dict):
        return None
    unit = "tok/s" if ((bt.get("spec") or {}).get("objective") or {}).get("type") == "OutputThroughput" else "req/s"
    verdict = safe(twin.get("verdict") or "-")
    head = Text.assemble(("Twin ", "bold"), (verdict, "green" if verdict in ("Trusted", "Nominal") else "red"),
                         f"  next trial: {safe(twin.get('mode') or '-')}",
                         f"  calibrated on {_count(twin.get('observations'))} load step(s)",
                         f"  {_count(twin.get('ranked'))} candidates ranked in {fmt(twin.get('searchSeconds'), 1)} s")
    lines: list[Any] = [head]
    if twin.get("reason"):
        lines.append(text(f"  {twin['reason']}", "dim"))
    parameters = twin.get("parameters") or {}
    if parameters:
        lines.append(text("  fitted: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, (int, float)) else f"{k} {v}"
                                                   for k, v in parameters.items()), "dim"))
    table = Table(title="Predicted against measured", title_justify="left", header_style="bold", pad_edge=False)
    for column in ("#", "setting", f"predicted {unit}", f"measured {unit}", f"recalibrated {unit}", "predicted load",
                   "first step load", "agrees"):
        table.add_column(column, justify="left" if column in ("setting", "agrees") else "right")
    table.add_column("furthest from its prediction", overflow="fold", max_width=70)
    now_predicted = {str(p.get("setting")): p.get("objective") for p in twin.get("predictions") or []
                     if isinstance(p, dict)}
    rows = 0
    for trial in sorted(status.get("trials") or [], key=_index):
        prediction = trial.get("prediction")
        if not isinstance(prediction, dict):
            continue
        metrics = trial.get("metrics") or {}
        measured = metrics.get("sloCapacity") if unit == "req/s" else metrics.get("outputThroughput")
        steps = trial.get("steps") or []
        first = steps[0].get("load") if steps and isinstance(steps[0], dict) else None
        agrees = prediction.get("agrees")
        table.add_row(text(trial.get("index", "")), text(setting_label(trial.get("setting"))),
                      fmt(prediction.get("objective"), 2), fmt(measured, 2),
                      fmt(now_predicted.get(str(trial.get("setting"))), 2), fmt(prediction.get("capacityLoad")),
                      fmt(first), text("-" if agrees is None else ("yes" if agrees else "no"),
                                       "" if agrees is None else ("green" if agrees else "red")),
                      text(prediction.get("comparison") or ""))
        rows += 1
    if rows:
        lines.append(table)
    return Group(*lines)
