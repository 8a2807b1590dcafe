"""Status conditions in the Kubernetes API convention, set without touching unchanged timestamps."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

CONDITION_TYPES = ("Progressing", "Succeeded", "Failed", "Degraded")


def now_iso(now: datetime | None = None) -> str:
    return (now or datetime.now(timezone.utc)).strftime("%Y-%m-%dT%H:%M:%SZ")


def set_condition(conditions: list[dict[str, Any]], type_: str, status: bool, reason: str, message: str,
                  generation: int | None, now: datetime) -> list[dict[str, Any]]:
    """A new condition list with `type_` set; lastTransitionTime moves only when status flips."""
    value = "True" if status else "False"
    out = [dict(c) for c in conditions if c.get("type") != type_]
    old = next((c for c in conditions if c.get("type") == type_), None)
    changed = old is None or old.get("status") != value
    out.append({
        "type": type_, "status": value, "reason": reason, "message": message[:2000],
        "lastTransitionTime": now_iso(now) if changed else old.get("lastTransitionTime", now_iso(now)),
        "observedGeneration": generation,
    })
    return sorted(out, key=lambda c: CONDITION_TYPES.index(c["type"]) if c["type"] in CONDITION_TYPES else 99)


def get_condition(conditions: list[dict[str, Any]], type_: str) -> dict[str, Any] | None:
    return next((c for c in conditions if c.get("type") == type_), None)
