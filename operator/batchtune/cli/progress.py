"""One plain line per thing that happened, for a log: `batchtune status --watch` without a TTY.

`changes(before, after)` compares two reads of a BatchTuning (dicts as the API returns them) and says
what happened between them: a phase change, a trial started, measured, failed (with its reason), the
setting chosen, production patched (its args diff), verified or rolled back. Pure, so a CI log and
`tee` show the run, and a test pins every line. Every string from the object goes through `safe`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from batchtune.core.vocabulary import M
from batchtune.terminal import safe

_RUNNING = ("Deploying", "Warming", "Measuring")
_ENDED = ("Done", "Infeasible", "Failed")


def _status(bt: Mapping[str, Any] | None) -> Mapping[str, Any]:
    status = (bt or {}).get("status")
    return status if isinstance(status, Mapping) else {}


def _trials(bt: Mapping[str, Any] | None) -> dict[str, Mapping[str, Any]]:
    trials = _status(bt).get("trials")
    if not isinstance(trials, list):
        return {}
    return {str(t.get("name")): t for t in trials if isinstance(t, Mapping) and t.get("name")}


def _setting(setting: Any) -> str:
    if not isinstance(setting, Mapping):
        return "?"
    label = f"max-num-seqs={setting.get('maxNumSeqs')} gpu-memory-utilization={setting.get('gpuMemoryUtilizationPercent')}%"
    if setting.get("maxNumBatchedTokens"):
        label += f" max-num-batched-tokens={setting['maxNumBatchedTokens']}"
    return safe(label)


def _figures(metrics: Any) -> str:
    """The few figures a reader checks first, in the status's own units."""
    if not isinstance(metrics, Mapping):
        return ""
    shown = []
    for key, label, unit in ((M.OUTPUT_THROUGHPUT, "throughput", " tok/s"), (M.ITL_MS, "ITL", " ms"),
                             (M.TTFT_MS, "TTFT", " ms"), (M.GPU_UTIL_PERCENT, "GPU", "%")):
        value = metrics.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value:
            shown.append(f"{label} {value:,.0f}{unit}" if value < 1e12 else f"{label} overloaded")
    return ", ".join(shown)


def _trial_line(name: str, trial: Mapping[str, Any]) -> str:
    state = safe(trial.get("state"))
    setting = _setting(trial.get("setting"))
    if state == "Done":
        verdict = safe(trial.get("verdict") or "Unknown")
        why = safe(trial.get("verdictReason") or "")
        figures = _figures(trial.get("metrics"))
        return (f"trial {safe(name)} measured ({setting}): SLO {verdict}" + (f", {figures}" if figures else "")
                + (f" - {why}" if why else ""))
    if state in ("Infeasible", "Failed"):
        reason = safe(trial.get("reason") or state)
        message = safe(trial.get("message") or "")
        return f"trial {safe(name)} {state.lower()} ({setting}): {reason}" + (f": {message[:200]}" if message else "")
    return f"trial {safe(name)} {state.lower()} ({setting})"


def _args_diff(applied: Mapping[str, Any]) -> str:
    """`--max-num-seqs 8 -> 64`: each changed run of words, after the flag it belongs to."""
    import difflib

    before, after = _argv_of(applied.get("previous")), _argv_of(applied.get("new"))
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
    lines: list[str] = []
    old, new = _status(before), _status(after)
    old_trials, new_trials = _trials(before), _trials(after)
    for name, trial in new_trials.items():
        state, was = trial.get("state"), (old_trials.get(name) or {}).get("state")
        if state == was:
            continue
        # A trial that went from nothing (or Pending) straight to its end still gets its start line.
        started = state in _RUNNING or (state in _ENDED and was in (None, "Pending") and trial.get("startedAt"))
        if started and was not in _RUNNING:
            lines.append(f"trial {safe(name)} started ({_setting(trial.get('setting'))})")
        if state in _ENDED:
            lines.append(_trial_line(name, trial))
    phase, was_phase = new.get("phase"), old.get("phase")
    if phase != was_phase and phase:
        progressing = next((c for c in new.get("conditions") or [] if isinstance(c, Mapping)
                            and c.get("type") == ("Failed" if phase == "Failed" else "Progressing")), {})
        detail = safe(progressing.get("message") or "")
        reason = safe(progressing.get("reason") or "")
        line = f"phase {safe(phase)}" + (f" ({reason})" if reason else "") + (f": {detail[:300]}" if detail else "")
        lines.append(line)
    if new.get("bestSetting") and new.get("bestSetting") != old.get("bestSetting"):
        lines.append(f"chose {safe(new['bestSetting'])} (trial {safe(new.get('bestTrial', '?'))})")
    applied, was_applied = new.get("applied") or {}, old.get("applied") or {}
    if isinstance(applied, Mapping) and isinstance(was_applied, Mapping):
        if applied.get("appliedAt") and applied.get("appliedAt") != was_applied.get("appliedAt"):
            diff = _args_diff(applied)
            lines.append(f"production {safe(applied.get('target', ''))} patched" + (f": {diff}" if diff else ""))
        if applied.get("verifiedAt") and not was_applied.get("verifiedAt"):
            lines.append(f"production verified at {safe(applied['verifiedAt'])}")
        if applied.get("rolledBackAt") and not was_applied.get("rolledBackAt"):
            lines.append(f"production rolled back at {safe(applied['rolledBackAt'])} to: "
                         + " ".join(safe(a) for a in _argv_of(applied.get("previous"))))
    return lines


def _argv_of(side: Any) -> list[str]:
    if not isinstance(side, Mapping):
        return []
    out: list[str] = []
    for part in ("command", "args"):
        values = side.get(part)
        if isinstance(values, list):
            out += [str(v) for v in values]
    return out
