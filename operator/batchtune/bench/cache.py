"""A JSON cache of noise-free evaluations under ~/.cache/batchtune/bench, keyed by every input that changes them
(`cache_key`), so a second full run skips the oracle's thousands of simulations."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from batchtune.bench.evaluate import Evaluation, Judge
from batchtune.bench.types import Knobs, Load, Reading

CACHE_VERSION = 4
"""4: each evaluation keeps its reading (the policy oracle reads its figures; without them a warm cache picked nothing)."""


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "batchtune" / "bench"


# Twin modules only the strategies, the CLI and the real-time server use (calibration, the guide's fast path, the
# prefilter, the HTTP server and its metrics exposition): the truth's evaluations do not depend on them, so editing
# them keeps the oracle's cache.
STRATEGY_SIDE = frozenset({"calibration.py", "cli_calibrate.py", "cli_predict.py", "cli_vllm.py", "fit.py", "guide.py",
                           "metrics.py", "observations.py", "prefilter.py", "server.py", "steady.py"})


def fingerprint_sources() -> list[Path]:
    """Every source whose code decides a noise-free evaluation: the twin (less its strategy side), the truths
    (`twin_truth.py`, `reality.py`, `recorded.py`), the judge itself (`evaluate.py`: the burst rule, the shared
    evaluations), its capacity search (`loadsearch.py`) and where each search starts (`oracle.py`: the hints), the
    scenarios' derived figures (`scenarios.py`: windows, grids) and the value
    types (`types.py`: the SLO's test)."""
    import batchtune.bench as bench
    import batchtune.twin as twin

    here = Path(bench.__file__).parent
    sources = [p for p in sorted(Path(twin.__file__).parent.glob("*.py")) if p.name not in STRATEGY_SIDE]
    return sources + [here / name for name in ("evaluate.py", "loadsearch.py", "oracle.py", "reality.py",
                                               "recorded.py", "scenarios.py", "twin_truth.py", "types.py")]


def _twin_fingerprint() -> str:
    return _digest(fingerprint_sources())


def _digest(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def truth_sources(truth: Any) -> list[Path]:
    """The batchtune modules that define the truth's class and its bases, less those `fingerprint_sources` already
    hashes: a truth in a module of its own (`far_reality.py`) is keyed by its code too, and one in the listed
    modules (the nominal and perturbed truths) adds nothing, so their keys stay what they were."""
    known = {p.resolve() for p in fingerprint_sources()}
    paths: list[Path] = []
    for cls in type(truth).__mro__:
        if not cls.__module__.startswith("batchtune."):
            continue
        file = getattr(sys.modules.get(cls.__module__), "__file__", None)
        if file is None:
            continue
        path = Path(file).resolve()
        if path not in known and path not in paths:
            paths.append(path)
    return paths


def cache_key(judge: Judge) -> str:
    """The judge's window, the scenario (every field), the truth (its class, its every field and, where it has one,
    its own description, a hidden reality's parameters; a recorded truth's `data_fingerprint`, its recording's content
    hash) and the sources that compute an evaluation (the twin's and the judge's, and a truth's own module where it is
    not among them: `truth_sources`)."""
    describe = getattr(judge.truth, "describe", None)
    truth = describe(judge.scenario) if describe is not None else ""
    kind = f"{type(judge.truth).__module__}.{type(judge.truth).__qualname__}"
    text = f"{CACHE_VERSION}|{judge.window_s}|{judge.scenario!r}|{kind}|{judge.truth!r}|{truth}|{_twin_fingerprint()}"
    own = truth_sources(judge.truth)
    if own:
        text += f"|{_digest(own)}"
    data = getattr(judge.truth, "data_fingerprint", None)
    if data is not None:
        text += f"|data:{data}"  # a recorded truth's recording: its content hash, whatever its description says
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def load_into(judge: Judge, directory: Path | None = None) -> int:
    """Pre-fill the judge from the cache; returns how many evaluations were loaded."""
    path = (directory or cache_dir()) / f"{judge.scenario.name}-{cache_key(judge)}.json"
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        return 0
    for entry in entries:
        knobs = Knobs(**entry["knobs"])
        load = Load(**entry["load"]) if entry.get("load") else None
        judge._cache.setdefault(knobs, Evaluation(knobs, entry["objective"], load, _reading(entry.get("reading")),
                                                  entry.get("failure")))
    return len(entries)


def save_from(judge: Judge, directory: Path | None = None) -> Path | None:
    directory = directory or cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{judge.scenario.name}-{cache_key(judge)}.json"
        entries = [
            {"knobs": asdict(e.knobs), "objective": e.objective,
             "load": asdict(e.load) if e.load else None, "failure": e.failure,
             "reading": _entry(e.reading)}
            for e in judge._cache.values()
        ]
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(entries))
        tmp.replace(path)
        return path
    except OSError:
        return None  # a cache that cannot be written only costs time


def _entry(reading: Reading | None) -> dict[str, Any] | None:
    if reading is None:
        return None
    return {"load": asdict(reading.load), "metrics": dict(reading.metrics),
            "failure": reading.failure, "duration_s": reading.duration_s}


def _reading(entry: dict[str, Any] | None) -> Reading | None:
    if not entry:
        return None
    return Reading(Load(**entry["load"]), dict(entry["metrics"]), entry.get("failure"), entry.get("duration_s", 0.0))
