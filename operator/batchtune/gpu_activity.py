"""GPU activity reports: how a process running "on a GPU" tells the node agent what the GPU does.

The twin server writes a small JSON file at least once a second; the node agent reads it to serve
dcgm-exporter-style metrics. Writes are atomic (temp file in the same directory, then
`os.replace`) so a reader never sees half a file. A missing, unreadable or stale report reads as
"no activity" (`None`): the agent then shows the GPU idle.

File format::

    {"timestamp": 1715500000.0,
     "gpus": [{"index": 0, "gpu_util_pct": 97.0, "sm_active": 0.62, "sm_occupancy": 0.31,
               "tensor_active": 0.2, "dram_active": 0.55, "fb_used_mib": 72000, "power_w": 540.0}]}
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any

DEFAULT_MAX_AGE_S = 10.0

# Keys every GPU entry carries; the reader fills missing ones with these idle values.
IDLE_GPU: dict[str, float] = {
    "gpu_util_pct": 0.0,
    "sm_active": 0.0,
    "sm_occupancy": 0.0,
    "tensor_active": 0.0,
    "dram_active": 0.0,
    "fb_used_mib": 0.0,
    "power_w": 0.0,
}


def write_activity(path: str | os.PathLike[str], gpus: list[dict[str, Any]], *, now: float | None = None) -> None:
    """Write one activity report atomically.

    `gpus` is a list of dicts with `index` (position in NVIDIA_VISIBLE_DEVICES) and the keys of
    `IDLE_GPU`. `now` (unix seconds) defaults to `time.time()`.
    """
    target = Path(path)
    for gpu in gpus:
        if "index" not in gpu:
            raise ValueError(f"gpu activity entry {gpu!r} has no 'index'")
    payload = {"timestamp": time.time() if now is None else float(now), "gpus": [_clean(g) for g in gpus]}
    target.parent.mkdir(parents=True, exist_ok=True)
    # Same directory as the target so os.replace is a rename on one filesystem.
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(payload, fh, separators=(",", ":"))
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def read_activity(
    path: str | os.PathLike[str], max_age_s: float = DEFAULT_MAX_AGE_S, *, now: float | None = None
) -> list[dict[str, Any]] | None:
    """Read a report; `None` when the file is missing, malformed or older than `max_age_s`.

    Each returned GPU dict has `index` and every key of `IDLE_GPU` (missing keys read idle).
    """
    try:
        with open(path, encoding="utf-8") as fh:
            payload = json.load(fh)
    except (OSError, ValueError):
        return None
    if not isinstance(payload, dict):
        return None
    stamp = payload.get("timestamp")
    gpus = payload.get("gpus")
    if not isinstance(stamp, (int, float)) or not isinstance(gpus, list):
        return None
    current = time.time() if now is None else now
    if current - float(stamp) > max_age_s:
        return None
    result: list[dict[str, Any]] = []
    for gpu in gpus:
        if not isinstance(gpu, dict) or not isinstance(gpu.get("index"), int):
            return None
        entry: dict[str, Any] = {"index": gpu["index"]}
        for key, idle in IDLE_GPU.items():
            value = gpu.get(key, idle)
            entry[key] = float(value) if isinstance(value, (int, float)) and math.isfinite(value) else idle
        result.append(entry)
    return result


def _clean(gpu: dict[str, Any]) -> dict[str, Any]:
    """Round floats so the file stays small and JSON stays finite."""
    out: dict[str, Any] = {"index": int(gpu["index"])}
    for key, value in gpu.items():
        if key == "index":
            continue
        if isinstance(value, float):
            out[key] = round(value, 4) if math.isfinite(value) else 0.0
        else:
            out[key] = value
    return out
