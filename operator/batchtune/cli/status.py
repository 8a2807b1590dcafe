"""`batchtune status NAME [--watch]`: where a BatchTuning is, its trials, conditions and decision.

The render functions here take the BatchTuning as the API returns it (a dict), parse its status once into the
typed model (`shown`; a status that does not parse is refused naming the field) and build rich renderables;
`report` reuses them. Every string from the object reaches the terminal through
`batchtune.terminal` (control characters escaped, never parsed as rich markup). Heavy imports
stay inside functions so `batchtune --help` is fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from batchtune.cli.view import Shown, shown, status_error, typed, when
from batchtune.terminal import safe, text

if TYPE_CHECKING:
    from batchtune.api.models import BatchTuningStatus, Recommendation, Setting, TrialRecord

__all__ = ["Shown", "shown", "status_error", "typed", "when"]  # the typed view, with the renderers here

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
    from batchtune.api import InvalidBatchTuning
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
    except InvalidBatchTuning as exc:
        print(status_error(bt, exc), file=sys.stderr)
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


def phase_of(bt: Mapping[str, Any] | Shown) -> str:
    phase = shown(bt).status.phase
    return str(phase) if phase else "Pending"


def fmt(value: Any, digits: int = 0) -> str:
    """A metric for a table cell: '-' when missing or not a number (NaN included)."""
    if value is None or isinstance(value, bool):
        return "-"
    try:
        number = float(value)
    except (TypeError, ValueError):
        return safe(value)
    except OverflowError:  # an integer past the largest float
        return "(too large)"
    if number != number:  # NaN
        return "-"
    return f"{number:,.{digits}f}"


def setting_label(setting: Setting | Mapping[str, Any] | None) -> str:
    from batchtune.api.models import Setting

    if not setting:
        return "-"
    if not isinstance(setting, Setting):
        setting = Setting.model_validate(setting)
    label = f"max-num-seqs {setting.max_num_seqs}, gpu-memory-utilization {setting.gpu_memory_utilization_percent}%"
    if setting.max_num_batched_tokens:
        label += f", max-num-batched-tokens {setting.max_num_batched_tokens}"
    return safe(label)


def age(timestamp: datetime | str | None, now: datetime) -> str:
    if not timestamp:
        return "-"
    if isinstance(timestamp, datetime):
        then = timestamp
    elif not isinstance(timestamp, str):
        return safe(timestamp)
    else:
        try:
            then = datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
        except ValueError:
            return safe(timestamp)
    try:
        seconds = max(0, int((now - then).total_seconds()))
    except TypeError:  # without a time zone
        return safe(timestamp)
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    if seconds < 172800:
        return f"{seconds // 3600}h{(seconds % 3600) // 60:02d}m"
    return f"{seconds // 86400}d"


def _why(trial: TrialRecord) -> str:
    """Why the trial ended as it did, on one line (an engine message's newlines shown as \\n)."""
    if trial.state == "Done":
        return safe(trial.verdict_reason or trial.message or "")
    if trial.reason and trial.message:
        return safe(f"{trial.reason}: {trial.message}")
    return safe(trial.reason or trial.message or "")


def _trials(status: BatchTuningStatus) -> list[TrialRecord]:
    return sorted(status.trials, key=lambda t: t.index)


def trials_table(bt: Mapping[str, Any] | Shown) -> Any:
    """One row per trial: setting, state, verdict, the measured figures, and why."""
    from rich.table import Table

    view = shown(bt)
    status = view.status
    trials = _trials(status)
    percentile = view.percentile.lower()
    best = status.best_trial
    knee = status.knee.max_num_seqs if status.knee else None
    with_mbt = any(t.setting.max_num_batched_tokens for t in trials)
    with_capacity = any((t.metrics or {}).get("sloCapacity") is not None for t in trials)
    with_goodput = any((t.metrics or {}).get("goodput") is not None for t in trials)

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
        setting = trial.setting
        metrics = trial.metrics or {}
        marks = []
        if best and trial.name == best:
            marks.append("★ best")
        if knee and setting.max_num_seqs == knee:
            marks.append("◆ knee")
        if trial.current:
            marks.append("● production")
        state = str(trial.state)
        verdict = str(trial.verdict or "")
        cells: list[Any] = [trial.index, " ".join(marks), setting.max_num_seqs, setting.gpu_memory_utilization_percent]
        if with_mbt:
            cells.append(setting.max_num_batched_tokens or "-")
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
        table.add_row(*row, style="bold" if best and trial.name == best else None)
    if not trials:
        table.add_row(*(["", "", "(no trial yet)"] + [""] * (len(table.columns) - 3)))
    return table


def trial_notes(bt: Mapping[str, Any] | Shown) -> Any:
    """Why each trial ended as it did, one line per trial under the table (too long for a cell)."""
    from rich.text import Text

    status = shown(bt).status
    notes = Text()
    for trial in _trials(status):
        why = _why(trial)
        if not why:
            continue
        if notes.plain:
            notes.append("\n")
        style = "green" if status.best_trial == trial.name else (
            "red" if trial.state in ("Infeasible", "Failed") else "")
        notes.append(f"  #{trial.index} ", style="bold")
        notes.append(why, style=style)
    return notes


def conditions_table(bt: Mapping[str, Any] | Shown, now: datetime) -> Any:
    from rich.table import Table

    table = Table(title="Conditions", title_justify="left", header_style="bold", pad_edge=False)
    for column in ("type", "status", "reason", "age"):
        table.add_column(column, no_wrap=True)
    table.add_column("message", overflow="fold", max_width=90)
    for cond in shown(bt).status.conditions:
        value = str(cond.status)
        bad = (cond.type in ("Failed", "Degraded")) == (value == "True")
        table.add_row(text(cond.type), text(value, "red" if bad else "green"), text(cond.reason),
                      text(age(cond.last_transition_time, now)), text(cond.message, multiline=True))
    return table


def header(bt: Mapping[str, Any] | Shown, now: datetime) -> Any:
    """Name, target, phase, and a progress bar over the planned trials."""
    from rich.console import Group
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text

    view = shown(bt)
    status = view.status
    phase = safe(phase_of(view))
    progressing = status.condition("Progressing")
    title = Text.assemble(
        ("BatchTuning ", "bold"), (safe(f"{view.namespace}/{view.name}"), "bold cyan"),
        "  target Deployment ", (view.target or "-", "cyan"),
        "  phase ", (phase, _PHASE_STYLE.get(phase, "bold yellow")),
        (f" ({safe(progressing.reason)})" if progressing else "", "dim"),
        f"  age {age(view.created, now)}",
    )
    planned = _count(status.trials_planned)
    done = _count(status.trials_completed)
    running = sum(1 for t in status.trials if t.state in ("Deploying", "Warming", "Measuring"))
    grid = Table.grid(padding=(0, 1))
    grid.add_row(Text("trials", style="bold"), ProgressBar(total=max(planned, 1), completed=min(done, planned or 1),
                                                            width=30),
                 Text(f"{done}/{planned} done" + (f", {running} running" if running else "")))
    lines: list[Any] = [title, grid]
    if not view.written:
        lines.append(Text("no status yet: the operator has not picked this BatchTuning up (is it running? "
                          "kubectl get pods -A -l app.kubernetes.io/name=batchtune)", style="yellow"))
    if status.best_setting:
        lines.append(Text.assemble(("best  ", "bold"), (safe(status.best_setting), "green"),
                                   f"  (trial {safe(status.best_trial or '-')})"))
    pruned = status.pruned
    if pruned:
        sample = "; ".join(f"{setting_label(p.setting)}: {p.message or p.reason}" for p in pruned[:2])
        lines.append(text(f"pruned before any GPU was used: {len(pruned)} setting(s), e.g. {sample}", "dim"))
    return Group(*lines)


MAX_SHOWN_COUNT = 1 << 31
"""A trial count past this is shown as this (a forged status may say anything; a tuning runs a few dozen)."""


def _count(value: int) -> int:
    return min(value, MAX_SHOWN_COUNT)


def decision(bt: Mapping[str, Any] | Shown) -> Any:
    """The decision with its reasons: setting, knee, replicas hint, and what happened in production."""
    from rich.text import Text

    view = shown(bt)
    status = view.status
    phase = safe(phase_of(view))
    rec, knee, applied = status.recommendation, status.knee, status.applied
    made = Text()
    if rec:
        _recommendation(made, rec, status.best_trial)
    elif phase == "Failed":
        failed = status.condition("Failed")
        made.append("No decision: ", style="bold red")
        made.append(safe(f"{failed.reason if failed else 'Failed'}: {failed.message if failed else ''}",
                         multiline=True))
    if knee:
        made.append("\n  knee: ", style="bold")
        made.append(safe(f"max-num-seqs {knee.max_num_seqs}: {knee.reason}"))
    if applied and applied.applied_at:
        made.append("\n  production: ", style="bold")
        made.append(f"patched at {when(applied.applied_at)}")
        if applied.verified_at:
            made.append(f", verified at {when(applied.verified_at)}", style="green")
        if applied.rolled_back_at:
            made.append(f", rolled back at {when(applied.rolled_back_at)}", style="red")
    elif phase == "Recommended":
        made.append("\n  production: ", style="bold")
        made.append(f"not changed (Recommend mode); apply with `batchtune recommend "
                    f"{safe(view.name or 'NAME')} -o patch`")
    return made


def _recommendation(made: Any, rec: Recommendation, best_trial: str | None) -> None:
    """The recommended setting, why, for which workload, its args and the replicas hint, appended to `made`."""
    made.append("Decision: ", style="bold")
    made.append(setting_label(rec.setting), style="bold green")
    if best_trial:
        made.append(f"  (trial {safe(best_trial)})")
    made.append("\n  why: ", style="bold")
    made.append(safe(rec.reason, multiline=True))
    if rec.workload:
        made.append("\n  for: ", style="bold")
        made.append(safe(rec.workload))
    if rec.args:
        made.append("\n  args: ", style="bold")
        made.append(" ".join(safe(a) for a in rec.args))
    if rec.replicas_hint:
        made.append("\n  replicas: ", style="bold")
        made.append(f"{rec.replicas_hint} would serve production's observed peak at this setting")
        if rec.replicas_basis:
            made.append(f" ({safe(rec.replicas_basis)})")
    elif rec.replicas_basis:
        made.append("\n  replicas: ", style="bold")
        made.append(safe(rec.replicas_basis))


def workload_block(bt: Mapping[str, Any] | Shown, now: datetime) -> Any:
    """The workload the trials drive: production's measured profile (rate, burstiness, lengths) or the spec's."""
    from rich.text import Text

    workload = shown(bt).status.workload
    out = Text()
    if workload is None:
        return out
    out.append("Workload: ", style="bold")
    if workload.source != "production":
        out.append(safe(workload.summary or "spec.load's fixed lengths"))
        return out
    out.append(safe(f"production over {fmt(workload.lookback_seconds)}s, {fmt(workload.requests)} "
                    f"requests, measured {age(workload.measured_at, now)} ago"))
    burst = workload.burstiness
    out.append("\n  arrivals: ", style="bold")
    out.append(f"{fmt(workload.requests_per_second, 2)} req/s mean, {fmt(workload.peak_requests_per_second, 2)} "
               f"peak ({fmt(workload.rate_window_seconds)}s windows), burstiness "
               + (fmt(burst, 2) + (" (Poisson)" if burst == 1 else " (burstier than Poisson)" if burst < 1 else "")
                  if burst is not None else "not measured (Poisson assumed)"))
    for dist, name in ((workload.prompt_lengths, "prompt"), (workload.output_lengths, "output")):
        quantiles = {"p50": dist.p50, "p90": dist.p90, "p99": dist.p99} if dist else {}
        out.append(f"\n  {name} tokens: ", style="bold")
        out.append("mean " + "  ".join([fmt(dist.mean if dist else None)]
                                       + [f"{q} {fmt(quantiles.get(q))}" for q in ("p50", "p90", "p99")]))
    if workload.prefix_cache_hit_percent is not None:
        out.append("\n  prefix cache: ", style="bold")
        out.append(f"{fmt(workload.prefix_cache_hit_percent)}% of prompt tokens hit")
    for note in workload.notes:
        out.append("\n  note: ", style="bold yellow")
        out.append(safe(note))
    return out


def rounds_block(bt: Mapping[str, Any] | Shown, now: datetime) -> Any:
    """Continuous tuning: the last rounds (why each started, production's setting against the best) and the watch."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    status = shown(bt).status
    rounds = status.rounds
    if not rounds:
        return Group()
    table = Table(title="Rounds (spec.retune)", title_justify="left", header_style="bold", pad_edge=False)
    for column in ("#", "trigger", "started", "production's setting", "best other", "gain %", "outcome"):
        table.add_column(column, justify="right" if column in ("#", "gain %") else "left")
    for r in rounds:
        current = f"{safe(r.current_setting or '-')} ({fmt(r.current_objective, 2)})" if r.current_trial else "-"
        best = f"{safe(r.best_setting or '-')} ({fmt(r.best_objective, 2)})" \
            if r.best_objective is not None else safe(r.best_setting or "-")
        outcome = safe(r.outcome or ("running" if not r.ended_at else "-"))
        table.add_row(text(r.round), text(r.trigger), text(age(r.started_at, now)),
                      text(current), text(best), text(fmt(r.improvement_percent, 1)), text(outcome))
    parts: list[Any] = [table]
    last = rounds[-1]
    if last.reason:
        parts.append(text(f"  round {last.round} started: {safe(last.reason)}", "dim"))
    watch = status.retune
    if last.ended_at and watch:
        line = Text("  watching: ", style="bold")
        if watch.next_check_at:
            line.append(f"next check at {when(watch.next_check_at)}")
        if watch.message:
            line.append(f"; last check {age(watch.last_check_at, now)} ago: {safe(watch.message)}")
        parts.append(line)
    return Group(*parts)


def render_status(bt: Mapping[str, Any] | Shown, now: datetime) -> Any:
    """Everything `batchtune status` shows; InvalidBatchTuning naming the field of a status that does not parse."""
    from rich.console import Group
    from rich.text import Text

    view = shown(bt)
    parts: list[Any] = [header(view, now)]
    workload = workload_block(view, now)
    if workload.plain:
        parts += [Text(""), workload]
    parts += [Text(""), trials_table(view)]
    notes = trial_notes(view)
    if notes.plain:
        parts.append(notes)
    if view.status.conditions:
        parts += [Text(""), conditions_table(view, now)]
    twin = twin_table(view)
    if twin is not None:
        parts += [Text(""), twin]
    made = decision(view)
    if made.plain:
        parts += [Text(""), made]
    if view.status.rounds:
        parts += [Text(""), rounds_block(view, now)]
    return Group(*parts)


def twin_table(bt: Mapping[str, Any] | Shown) -> Any | None:
    """Strategy TwinGuided: the twin's verdict and, per trial it predicted, predicted against measured."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    view = shown(bt)
    status = view.status
    twin = status.twin
    if twin is None:
        return None
    unit = "tok/s" if view.objective == "OutputThroughput" else "req/s"
    verdict = safe(twin.verdict or "-")
    head = Text.assemble(("Twin ", "bold"), (verdict, "green" if verdict in ("Trusted", "Nominal") else "red"),
                         f"  next trial: {safe(twin.mode or '-')}",
                         f"  calibrated on {_count(twin.observations)} load step(s)",
                         f"  {_count(twin.ranked)} candidates ranked in {fmt(twin.search_seconds, 1)} s")
    lines: list[Any] = [head]
    if twin.mode == "measure" and verdict == "Untrusted":
        lines.append(text("  The calibration is Untrusted: the twin does not steer, trials are chosen by measuring "
                          "(Adaptive) until a recalibration is Trusted", "red"))
    if twin.reason:
        lines.append(text(f"  {twin.reason}", "dim"))
    if twin.parameters:
        lines.append(text("  fitted: " + ", ".join(f"{k} {v:.4g}" for k, v in twin.parameters.items()), "dim"))
    table = Table(title="Predicted against measured", title_justify="left", header_style="bold", pad_edge=False)
    for column in ("#", "setting", f"predicted {unit}", f"measured {unit}", f"recalibrated {unit}", "predicted load",
                   "first step load", "agrees"):
        table.add_column(column, justify="left" if column in ("setting", "agrees") else "right")
    table.add_column("furthest from its prediction", overflow="fold", max_width=70)
    now_predicted = {p.setting: p.objective for p in twin.predictions}
    rows = 0
    for trial in _trials(status):
        prediction = trial.prediction
        if prediction is None:
            continue
        metrics = trial.metrics or {}
        measured = metrics.get("sloCapacity") if unit == "req/s" else metrics.get("outputThroughput")
        first = trial.steps[0].load if trial.steps else None
        agrees = prediction.agrees
        table.add_row(text(trial.index), text(setting_label(trial.setting)),
                      fmt(prediction.objective, 2), fmt(measured, 2),
                      fmt(now_predicted.get(trial.setting), 2), fmt(prediction.capacity_load),
                      fmt(first), text("-" if agrees is None else ("yes" if agrees else "no"),
                                       "" if agrees is None else ("green" if agrees else "red")),
                      text(prediction.comparison or ""))
        rows += 1
    if rows:
        lines.append(table)
    return Group(*lines)
