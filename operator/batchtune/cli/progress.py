"""One plain line per thing that happened, for a log: `batchtune status --watch` without a TTY.

`changes(before, after)` compares two reads of a BatchTuning (dicts as the API returns them; each status parsed
once into the typed model, a status that does not parse refused naming the field) and says
what happened between them: a phase change, a trial started, measured, failed (with its reason), the
setting chosen, production patched (its args diff), verified or rolled back. Pure, so a CI log and
`tee` show the run, and a test pins every line. Every string from the object goes through `safe`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from batchtune.core.vocabulary import M
from batchtune.terminal import safe

if TYPE_CHECKING:
    from batchtune.api import AppliedRecord, BatchTuningStatus, ContainerArgs, Setting, TrialRecord

_RUNNING = ("Deploying", "Warming", "Measuring")
_ENDED = ("Done", "Infeasible", "Failed")


def _status(bt: Mapping[str, Any] | None) -> BatchTuningStatus:
    """The status parsed once (batchtune.cli.status.shown); InvalidBatchTuning naming the field."""
    from batchtune.api import BatchTuningStatus
    from batchtune.cli.view import shown

    return shown(bt).status if bt is not None else BatchTuningStatus()


def _setting(setting: Setting) -> str:
    label = f"max-num-seqs={setting.max_num_seqs} gpu-memory-utilization={setting.gpu_memory_utilization_percent}%"
    if setting.max_num_batched_tokens:
        label += f" max-num-batched-tokens={setting.max_num_batched_tokens}"
    return safe(label)


def _figures(metrics: Mapping[str, float] | None) -> str:
    """The few figures a reader checks first, in the status's own units."""
    shown = []
    for key, label, unit in ((M.OUTPUT_THROUGHPUT, "throughput", " tok/s"), (M.ITL_MS, "ITL", " ms"),
                             (M.TTFT_MS, "TTFT", " ms"), (M.GPU_UTIL_PERCENT, "GPU", "%")):
        value = (metrics or {}).get(key)
        if value is not None:
            shown.append(f"{label} {value:,.0f}{unit}" if value < 1e12 else f"{label} overloaded")
    return ", ".join(shown)


def _trial_line(trial: TrialRecord) -> str:
    name, state, setting = safe(trial.name), str(trial.state), _setting(trial.setting)
    if state == "Done":
        verdict = safe(trial.verdict or "Unknown")
        why = safe(trial.verdict_reason or "")
        figures = _figures(trial.metrics)
        return (f"trial {name} measured ({setting}): SLO {verdict}" + (f", {figures}" if figures else "")
                + (f" - {why}" if why else ""))
    if state in ("Infeasible", "Failed"):
        reason = safe(trial.reason or state)
        message = safe(trial.message or "")
        return f"trial {name} {state.lower()} ({setting}): {reason}" + (f": {message[:200]}" if message else "")
    return f"trial {name} {state.lower()} ({setting})"


def _args_diff(applied: AppliedRecord) -> str:
    """`--max-num-seqs 8 -> 64`: each changed run of words, after the flag it belongs to."""
    import difflib

    before, after = _argv_of(applied.previous), _argv_of(applied.new)
    parts = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=before, b=after, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        old, new = " ".join(before[i1:i2]), " ".join(after[j1:j2])
        if tag == "replace":
            # A bare value (`8`) is named by the flag before it; `--x=8` names itself.
            flag = before[i1 - 1] if i1 and before[i1 - 1].startswith("-") and not old.startswith("-") else ""
            parts.append(f"{flag} {old} -> {new}".strip())
        else:
            parts.append(f"added {new}" if tag == "insert" else f"removed {old}")
    return safe("args " + "; ".join(parts)) if parts else ""


def changes(before: Mapping[str, Any] | None, after: Mapping[str, Any]) -> list[str]:
    """What happened between two reads of one BatchTuning, one line each, oldest first."""
    from batchtune.api import AppliedRecord
    from batchtune.cli.view import when

    lines: list[str] = []
    old, new = _status(before), _status(after)
    old_states = {t.name: t.state for t in old.trials}
    for trial in new.trials:
        state, was = trial.state, old_states.get(trial.name)
        if state == was:
            continue
        # A trial that went from nothing (or Pending) straight to its end still gets its start line.
        started = state in _RUNNING or (state in _ENDED and was in (None, "Pending") and trial.started_at)
        if started and was not in _RUNNING:
            lines.append(f"trial {safe(trial.name)} started ({_setting(trial.setting)})")
        if state in _ENDED:
            lines.append(_trial_line(trial))
    phase, was_phase = new.phase, old.phase
    if phase != was_phase and phase:
        progressing = new.condition("Failed" if phase == "Failed" else "Progressing")
        detail = safe(progressing.message if progressing else "")
        reason = safe(progressing.reason if progressing else "")
        line = f"phase {safe(phase)}" + (f" ({reason})" if reason else "") + (f": {detail[:300]}" if detail else "")
        lines.append(line)
    if new.best_setting and new.best_setting != old.best_setting:
        lines.append(f"chose {safe(new.best_setting)} (trial {safe(new.best_trial or '?')})")
    applied, was_applied = new.applied or AppliedRecord(), old.applied or AppliedRecord()
    if applied.applied_at and applied.applied_at != was_applied.applied_at:
        diff = _args_diff(applied)
        lines.append(f"production {safe(applied.target or '')} patched" + (f": {diff}" if diff else ""))
    if applied.verified_at and not was_applied.verified_at:
        lines.append(f"production verified at {when(applied.verified_at)}")
    if applied.rolled_back_at and not was_applied.rolled_back_at:
        lines.append(f"production rolled back at {when(applied.rolled_back_at)} to: "
                     + " ".join(safe(a) for a in _argv_of(applied.previous)))
    return lines


def _argv_of(side: ContainerArgs | None) -> list[str]:
    return [*(side.command or []), *(side.args or [])] if side else []
