"""Leader election over a `coordination.k8s.io/v1` Lease: the decisions, without I/O.

Two replicas run; one holds the Lease and runs the operator, the other waits without starting it (no watches,
no indexes: one read of the Lease per retry period). The rules are client-go's (`tools/leaderelection`):

- a Lease nobody holds (absent, or released: no holder) is taken at once;
- another holder's Lease is taken only after it stayed unchanged for its whole `leaseDurationSeconds` *as seen
  on this replica's own monotonic clock* (from the moment this replica first saw that record), so clocks that
  disagree between nodes never shorten the wait;
- the holder renews every retry period and gives up leading (the process exits) when it has not renewed for
  `renew_deadline_s`, which is shorter than the lease duration: the old leader has stopped before a standby can
  take over;
- a holder that stops on purpose releases the Lease (no holder, duration 1 s), so the standby takes over on its
  next retry instead of waiting out the duration.

Every write is conditional on the Lease's resourceVersion, so two replicas deciding at once cannot both win.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime
from enum import StrEnum


@dataclass(frozen=True)
class LeaseTimes:
    """How long a Lease lasts, when its holder gives up, how often replicas try (seconds)."""

    duration_s: float = 15
    """A holder that stopped renewing is presumed gone this long after its last renewal was seen."""
    renew_deadline_s: float = 10
    """The holder stops leading when it has not renewed for this long; below `duration_s`."""
    retry_period_s: float = 2
    """How often the holder renews and a standby looks at the Lease."""

    def problem(self) -> str | None:
        """Why these times cannot work (a flag named by what it sets), or None."""
        if self.retry_period_s <= 0:
            return f"--leader-elect-retry-period {self.retry_period_s:g}: must be above 0"
        if not self.retry_period_s < self.renew_deadline_s < self.duration_s:
            return (f"--leader-elect-retry-period {self.retry_period_s:g} < --leader-elect-renew-deadline "
                    f"{self.renew_deadline_s:g} < --leader-elect-lease-duration {self.duration_s:g} must hold: the "
                    "leader must give up before a standby may take over, and try more than once before")
        return None

    @property
    def takeover_bound_s(self) -> float:
        """The longest a standby waits after the holder's last renewal before it holds the Lease: it sees the
        renewal up to one retry period late, then waits the duration (its last try falls on the expiry itself,
        `Decision.retry_in_s`)."""
        return self.duration_s + self.retry_period_s


@dataclass(frozen=True)
class LeaseRecord:
    """The Lease's spec as stored (`holderIdentity`, `leaseDurationSeconds`, `acquireTime`, `renewTime`,
    `leaseTransitions`) and the resourceVersion it was read at."""

    holder: str | None
    duration_s: int
    acquire_time: datetime | None
    renew_time: datetime | None
    transitions: int
    resource_version: str | None = None

    def same_record(self, other: LeaseRecord | None) -> bool:
        """The same record (what a renewal changes), whatever resourceVersion it was read at."""
        return other is not None and replace(self, resource_version=None) == replace(other, resource_version=None)


@dataclass(frozen=True)
class Observed:
    """The last record this replica saw and when it first saw it (its own monotonic clock, seconds)."""

    record: LeaseRecord
    since: float


class Act(StrEnum):
    CREATE = "Create"
    """No Lease yet: create it holding it."""
    TAKE = "Take"
    """Free or expired: write it with this replica as the holder (a new transition)."""
    RENEW = "Renew"
    """Held by this replica: write a new renewTime."""
    WAIT = "Wait"
    """Another replica holds it and it has not expired here."""


@dataclass(frozen=True)
class Decision:
    act: Act
    observed: Observed | None
    """What to remember for the next try."""
    write: LeaseRecord | None = None
    """The record to write (CREATE, TAKE, RENEW)."""
    why: str = ""
    retry_in_s: float | None = None
    """WAIT: when to try next, the retry period or sooner if the Lease expires before then here (so the take
    is not a retry period late)."""


def decide(me: str, current: LeaseRecord | None, observed: Observed | None, now_mono: float, now: datetime,
           times: LeaseTimes) -> Decision:
    """One try of `me` against the Lease as just read (`current`; None: it does not exist).

    `observed` is what the previous try remembered; `now_mono` this replica's monotonic clock and `now` the
    wall-clock time written into the Lease (informational: no replica compares its clock with another's)."""
    duration = max(1, round(times.duration_s))
    if current is None:
        record = LeaseRecord(me, duration, now, now, 0)
        return Decision(Act.CREATE, None, record, "no Lease yet")
    seen = observed if observed is not None and observed.record.same_record(current) else Observed(current, now_mono)
    if current.holder == me:
        record = replace(current, duration_s=duration, renew_time=now)
        return Decision(Act.RENEW, seen, record, "held by this replica")
    if current.holder:
        expires = seen.since + max(1, current.duration_s)
        if now_mono < expires:
            return Decision(Act.WAIT, seen, None,
                            f"held by {current.holder}; presumed gone in {expires - now_mono:.1f}s unless renewed",
                            retry_in_s=max(0.05, min(times.retry_period_s, expires - now_mono)))
        why = f"{current.holder} did not renew for {now_mono - seen.since:.1f}s (lease {current.duration_s}s)"
    else:
        why = "released by its last holder"
    record = LeaseRecord(me, duration, now, now, current.transitions + 1, current.resource_version)
    return Decision(Act.TAKE, seen, record, why)


def released(record: LeaseRecord, now: datetime) -> LeaseRecord:
    """The record a holder stopping on purpose writes: no holder, expiring at once."""
    return replace(record, holder=None, duration_s=1, renew_time=now)


def leading_lost(last_renewed_mono: float, now_mono: float, times: LeaseTimes) -> bool:
    """The holder has not renewed within the renew deadline: it must stop leading now."""
    return now_mono - last_renewed_mono >= times.renew_deadline_s
