"""The scrape interval a tuning's windows are held to: found out from Prometheus, not assumed.

A window needs two scrapes of the engine's series to be measured (`core.measurement.window_too_short`), so the
interval decides which windows are refused and how long bracketing steps are. Where it comes from, first found:

1. the install's override (`prometheus.scrapeIntervalSeconds`, `BATCHTUNE_SCRAPE_INTERVAL_SECONDS`);
2. Prometheus' targets API: the jobs whose series carry the target's pods, and the longest `scrapeInterval` of
   their active targets (trial pods keep production's pod template, so the same jobs scrape them);
3. Prometheus' configuration (`/api/v1/status/config`): the global `scrape_interval`, when no series of the
   target's pods exist yet to name the job;
4. else 15 s, said to be assumed.

The interval and where it came from are recorded in status at planning, so every later tick uses the same one.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

DEFAULT_SCRAPE_INTERVAL_SECONDS = 15.0
PROMETHEUS_DEFAULT_INTERVAL_SECONDS = 60.0
"""Prometheus' own default when its configuration sets no global scrape_interval."""
OVERRIDE_SOURCE = "the install's prometheus.scrapeIntervalSeconds"

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|y|w|d|h|m|s)")
_UNIT_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}


@dataclass(frozen=True)
class ScrapeInterval:
    seconds: float
    source: str
    """Where it came from, as a phrase: `every 2s (<source>)`."""

    def describe(self) -> str:
        return f"{self.seconds:g}s, {self.source}"


def parse_duration(text: Any) -> float | None:
    """A Prometheus duration (`15s`, `1m30s`, `500ms`) in seconds; None when it is not one or not positive."""
    if not isinstance(text, str) or not text:
        return None
    pos, total = 0, 0.0
    for match in _DURATION.finditer(text):
        if match.start() != pos:
            return None
        total += float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
        pos = match.end()
    if pos != len(text) or total <= 0:
        return None
    return total


def from_targets(targets: Iterable[Mapping[str, Any]], jobs: Collection[str]) -> float | None:
    """The longest scrape interval among active targets of these jobs (scrape pool or `job` label); None if none."""
    found = []
    for target in targets:
        labels = target.get("labels") if isinstance(target.get("labels"), Mapping) else {}
        if target.get("scrapePool") in jobs or (labels or {}).get("job") in jobs:
            seconds = parse_duration(target.get("scrapeInterval"))
            if seconds is not None:
                found.append(seconds)
    return max(found) if found else None


def from_config(config: Mapping[str, Any], jobs: Collection[str] = ()) -> float | None:
    """The interval the configuration gives these jobs (the longest; their own `scrape_interval`, else the
    global one), or with no jobs the global one (Prometheus' 1m default when unset); None when unreadable."""
    if not isinstance(config, Mapping):
        return None
    glob = config.get("global") if isinstance(config.get("global"), Mapping) else {}
    global_s = parse_duration((glob or {}).get("scrape_interval")) if (glob or {}).get("scrape_interval") else \
        PROMETHEUS_DEFAULT_INTERVAL_SECONDS
    if global_s is None:
        return None
    if not jobs:
        return global_s
    found = []
    for job in config.get("scrape_configs") or []:
        if isinstance(job, Mapping) and job.get("job_name") in jobs:
            own = parse_duration(job.get("scrape_interval")) if job.get("scrape_interval") else global_s
            if own is not None:
                found.append(own)
    return max(found) if found else None


def assumed(why: str) -> ScrapeInterval:
    """The fallback when Prometheus did not say: 15 s, and the reason it is an assumption."""
    return ScrapeInterval(DEFAULT_SCRAPE_INTERVAL_SECONDS,
                          f"assumed: {why}; set the install's prometheus.scrapeIntervalSeconds to the real one")
