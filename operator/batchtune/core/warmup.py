"""When a load run's warm-up may end early: the steady-state test, and which runs use it.

A fixed warm-up pays its full length on every load step. Once a server is warm (caches filled, graphs
compiled by an earlier run on the same pod), a new load step only has to wait for its queue to settle at
the new load; the steady-state test ends the warm-up there, never later than the fixed time.

The test is deliberately conservative. The load generator samples its own counters every
`STEADY_CHECK_S` simulated seconds from the start (where they are all 0); at a check the load has settled when, comparing the last
`STEADY_SPAN_CHECKS` intervals with the `STEADY_SPAN_CHECKS` before them:
- a request has completed, and in a closed loop every stream has issued its first request;
- the output-token rate of the two spans differs by at most `RATE_TOLERANCE` of the larger (a ramp, the
  first requests' prefills or a queue still filling fail it);
- the number of requests in flight has grown by at most `GROWTH_TOLERANCE` of the requests issued over
  both spans (at least one): a load above capacity keeps adding (arrivals - completions) to the queue, a
  share of the arrivals whatever the time, so it never settles and runs the whole warm-up.
The first possible end is therefore 2 * STEADY_SPAN_CHECKS * STEADY_CHECK_S (8 s) into the run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

STEADY_CHECK_S = 1.0
"""Simulated seconds between two samples of the load generator's counters."""
STEADY_SPAN_CHECKS = 4
"""Intervals per compared span."""
RATE_TOLERANCE = 0.10
"""Largest relative difference of the two spans' output-token rates."""
GROWTH_TOLERANCE = 0.10
"""Largest growth of the requests in flight, as a share of the requests issued over both spans."""
STEADY_MIN_S = 2 * STEADY_SPAN_CHECKS * STEADY_CHECK_S
"""The earliest a steady warm-up can end."""


class WarmupMode(StrEnum):
    """How a trial's load runs end their warm-up (spec.trial.warmup)."""

    FIXED = "Fixed"
    """Every load run warms up for the full trial.warmupSeconds."""
    STEADY = "Steady"
    """The first load run on a trial pod warms up for the full trial.warmupSeconds (it fills caches and compiles
    graphs); later ones end it at the steady-state test, at most at trial.warmupSeconds (Builtin generator only)."""


class WarmupEnd(StrEnum):
    """How a load run's warm-up ended, as its summary says (`warmup_ended`)."""

    TIME = "time"
    """At the fixed warm-up time (no steady test asked, or the load never settled)."""
    STEADY = "steady"
    """At the steady-state test, before the fixed time."""


@dataclass(frozen=True)
class LoadSample:
    """The load generator's counters at one check (cumulative since the load started)."""

    at_s: float
    """Simulated seconds since the load started."""
    issued: int
    """Requests sent."""
    finished: int
    """Requests ended (completed or failed)."""
    in_flight: int
    """Requests sent and not ended."""
    output_tokens: int
    """Output tokens received."""


def settled(samples: Sequence[LoadSample], streams: int | None = None) -> bool:
    """Whether the load has reached its steady state at the last sample (the module's test).

    `samples` are taken every STEADY_CHECK_S in order; `streams` is a closed loop's concurrency (None: open loop).
    """
    span = STEADY_SPAN_CHECKS
    if len(samples) < 2 * span + 1:
        return False
    first, middle, last = samples[-2 * span - 1], samples[-span - 1], samples[-1]
    if last.finished < 1 or (streams is not None and last.issued < streams):
        return False
    if not (last.at_s > middle.at_s > first.at_s):
        return False
    before = (middle.output_tokens - first.output_tokens) / (middle.at_s - first.at_s)
    recent = (last.output_tokens - middle.output_tokens) / (last.at_s - middle.at_s)
    if before <= 0 or recent <= 0 or abs(recent - before) > RATE_TOLERANCE * max(recent, before):
        return False
    growth = last.in_flight - first.in_flight
    return growth <= max(1.0, GROWTH_TOLERANCE * (last.issued - first.issued))


def steady_warmup(mode: WarmupMode, builtin_generator: bool, runs_before: int, trace: bool) -> bool:
    """Whether a trial's load run may end its warm-up at the steady-state test.

    Only with the Builtin generator (`vllm bench serve` has no such test), never for a trace replay (its
    load is not stationary), and never for the first run on a trial pod (`runs_before` 0): that warm-up also
    fills caches and compiles graphs, which the test cannot see.
    """
    return mode is WarmupMode.STEADY and builtin_generator and not trace and runs_before > 0
