"""Leader election: the Lease decisions (`core.lease`) and the elector (`controller.leader`) on an in-memory Lease
that writes conditionally on resourceVersion, as the API server does, with clocks in the test's hands."""

from __future__ import annotations

import threading
import time
import urllib.request
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from batchtune.controller import leader, telemetry
from batchtune.controller.leader import Elector, LeaseConflict
from batchtune.core.lease import Act, LeaseRecord, LeaseTimes, Observed, decide, leading_lost, released

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
TIMES = LeaseTimes(duration_s=15, renew_deadline_s=10, retry_period_s=2)


def held(by: str | None, transitions: int = 0, rv: str = "1") -> LeaseRecord:
    return LeaseRecord(by, 15, T0, T0, transitions, rv)


# ---- core.lease ------------------------------------------------------------------------------------


def test_no_lease_is_created_holding_it():
    d = decide("a", None, None, 100.0, T0, TIMES)
    assert d.act is Act.CREATE and d.write == LeaseRecord("a", 15, T0, T0, 0)


def test_a_released_lease_is_taken_at_once_as_a_new_transition():
    d = decide("b", replace(held(None, 3), duration_s=1), None, 100.0, T0, TIMES)
    assert d.act is Act.TAKE and d.write is not None
    assert (d.write.holder, d.write.transitions, d.write.resource_version) == ("b", 4, "1")


def test_anothers_lease_is_taken_only_after_it_stayed_unchanged_a_whole_duration_here():
    lease = held("a")
    first = decide("b", lease, None, 100.0, T0, TIMES)
    assert first.act is Act.WAIT and first.observed == Observed(lease, 100.0)
    # Its renewTime says 12:00 and this replica's wall clock says much later: that never counts, only how long
    # this replica has seen the same record.
    late = T0 + timedelta(hours=1)
    assert decide("b", lease, first.observed, 114.9, late, TIMES).act is Act.WAIT
    taken = decide("b", replace(lease, resource_version="9"), first.observed, 115.0, late, TIMES)
    assert taken.act is Act.TAKE and taken.write is not None and taken.write.holder == "b"
    assert taken.write.transitions == 1 and "did not renew for 15.0s" in taken.why


def test_a_renewal_restarts_the_standbys_wait():
    lease = held("a")
    seen = decide("b", lease, None, 100.0, T0, TIMES).observed
    renewed = replace(lease, renew_time=T0 + timedelta(seconds=2), resource_version="2")
    again = decide("b", renewed, seen, 102.0, T0, TIMES)
    assert again.act is Act.WAIT and again.observed == Observed(renewed, 102.0)
    assert decide("b", renewed, again.observed, 116.0, T0, TIMES).act is Act.WAIT
    assert decide("b", renewed, again.observed, 117.0, T0, TIMES).act is Act.TAKE


def test_the_holder_renews():
    d = decide("a", held("a", 2), None, 100.0, T0 + timedelta(seconds=4), TIMES)
    assert d.act is Act.RENEW and d.write is not None
    assert d.write.renew_time == T0 + timedelta(seconds=4) and d.write.acquire_time == T0
    assert d.write.transitions == 2 and d.write.resource_version == "1"


def test_release_expires_at_once_and_names_no_holder():
    r = released(held("a", 2), T0)
    assert r.holder is None and r.duration_s == 1 and r.transitions == 2


def test_leading_is_lost_at_the_renew_deadline():
    assert not leading_lost(100.0, 109.9, TIMES)
    assert leading_lost(100.0, 110.0, TIMES)


@pytest.mark.parametrize("times, flag", [
    pytest.param(LeaseTimes(15, 15, 2), "--leader-elect-renew-deadline 15", id="deadline-not-below-duration"),
    pytest.param(LeaseTimes(15, 10, 10), "--leader-elect-retry-period 10", id="retry-not-below-deadline"),
    pytest.param(LeaseTimes(15, 10, 0), "--leader-elect-retry-period 0", id="no-retry-period"),
])
def test_times_that_cannot_work_are_refused_naming_the_flag(times, flag):
    problem = times.problem()
    assert problem is not None and flag in problem


def test_the_default_takeover_bound_is_within_30_seconds():
    assert LeaseTimes().problem() is None
    assert LeaseTimes().takeover_bound_s == 17 <= 30


def test_a_standbys_last_wait_ends_on_the_expiry_not_a_retry_period_later():
    lease = held("a")
    seen = decide("b", lease, None, 100.0, T0, TIMES).observed
    assert decide("b", lease, None, 100.0, T0, TIMES).retry_in_s == TIMES.retry_period_s
    near = decide("b", lease, seen, 113.5, T0, TIMES)
    assert near.act is Act.WAIT and near.retry_in_s == pytest.approx(1.5)
    assert decide("b", lease, seen, 113.5 + near.retry_in_s, T0, TIMES).act is Act.TAKE


# ---- controller.leader on an in-memory Lease -------------------------------------------------------


class MemoryLease:
    """One Lease, written only at the resourceVersion it was read at (else LeaseConflict), like the API server."""

    def __init__(self) -> None:
        self.record: LeaseRecord | None = None
        self.version = 0
        self.down = False
        self.writes: list[str | None] = []

    def get(self) -> LeaseRecord | None:
        if self.down:
            raise OSError("connection refused")
        return self.record

    def _store(self, record: LeaseRecord) -> LeaseRecord:
        self.version += 1
        self.record = replace(record, resource_version=str(self.version))
        self.writes.append(record.holder)
        return self.record

    def create(self, record: LeaseRecord) -> LeaseRecord:
        if self.down:
            raise OSError("connection refused")
        if self.record is not None:
            raise LeaseConflict("exists")
        return self._store(record)

    def replace(self, record: LeaseRecord) -> LeaseRecord:
        if self.down:
            raise OSError("connection refused")
        if self.record is None or record.resource_version != self.record.resource_version:
            raise LeaseConflict("moved")
        return self._store(record)


class Clock:
    def __init__(self) -> None:
        self.mono = 1000.0

    def now(self) -> datetime:
        return T0 + timedelta(seconds=self.mono - 1000.0)


def pair() -> tuple[MemoryLease, Clock, Elector, Elector]:
    lease, clock = MemoryLease(), Clock()
    a = Elector(lease, "a", TIMES, monotonic=lambda: clock.mono, now=clock.now)
    b = Elector(lease, "b", TIMES, monotonic=lambda: clock.mono, now=clock.now)
    return lease, clock, a, b


def test_one_of_two_replicas_leads_and_the_other_stands_by():
    lease, clock, a, b = pair()
    assert a.try_once() and a.leading
    assert not b.try_once() and not b.leading
    for _ in range(20):  # the leader renews every retry period; the standby never takes over
        clock.mono += 2
        assert a.renew()
        assert not b.try_once()
    assert lease.writes == ["a"] * 21


def test_the_standby_takes_over_a_killed_leader_within_the_bound():
    lease, clock, a, b = pair()
    assert a.try_once()
    assert not b.try_once()
    clock.mono += 1.5  # the standby's tries fall between the leader's renewals
    assert not b.try_once()
    next_try = clock.mono + b.next_try_in_s
    clock.mono += 0.4
    assert a.renew()
    killed = clock.mono  # a is SIGKILLed right after renewing: it never writes again
    clock.mono = next_try
    while not b.try_once():
        clock.mono += b.next_try_in_s  # as acquire() waits
        assert clock.mono - killed <= TIMES.takeover_bound_s
    # b saw the last renewal 1.6 s after it was written and took it exactly a duration later.
    assert clock.mono - killed == pytest.approx(1.6 + TIMES.duration_s)
    assert TIMES.duration_s <= clock.mono - killed <= TIMES.takeover_bound_s
    assert lease.record is not None and lease.record.holder == "b" and lease.record.transitions == 1


def test_a_leader_that_cannot_renew_gives_up_before_a_standby_may_take_over():
    lease, clock, a, b = pair()
    assert a.try_once()
    assert not b.try_once()
    lease.down = True  # the leader cannot reach the API server (the standby can't either, for now)
    lost_at = None
    while lost_at is None:
        clock.mono += TIMES.retry_period_s
        if not a.renew():
            lost_at = clock.mono
    lease.down = False
    assert lost_at - 1000.0 == TIMES.renew_deadline_s
    # At the moment the leader gave up, the standby still waits: the two never lead together.
    assert not b.try_once()
    clock.mono = 1000.0 + TIMES.duration_s
    assert b.try_once()


def test_two_standbys_taking_an_expired_lease_at_once_cannot_both_win():
    lease, clock = MemoryLease(), Clock()
    dead = Elector(lease, "dead", TIMES, monotonic=lambda: clock.mono, now=clock.now)
    assert dead.try_once()
    b = Elector(lease, "b", TIMES, monotonic=lambda: clock.mono, now=clock.now)
    c = Elector(lease, "c", TIMES, monotonic=lambda: clock.mono, now=clock.now)
    assert not b.try_once() and not c.try_once()
    clock.mono += 15
    # Both read the same record, then write: the second write carries a stale resourceVersion.
    read = lease.get()
    d_b = decide("b", read, b._observed, clock.mono, clock.now(), TIMES)
    d_c = decide("c", read, c._observed, clock.mono, clock.now(), TIMES)
    assert d_b.act is d_c.act is Act.TAKE
    lease.replace(d_b.write)
    with pytest.raises(LeaseConflict):
        lease.replace(d_c.write)
    assert lease.record.holder == "b"


def test_release_hands_over_on_the_standbys_next_retry():
    lease, clock, a, b = pair()
    assert a.try_once()
    assert not b.try_once()
    a.release()
    assert lease.record is not None and lease.record.holder is None
    clock.mono += TIMES.retry_period_s
    assert b.try_once()


def test_release_by_a_replica_that_lost_the_lease_leaves_the_new_holder_alone():
    lease, clock, a, b = pair()
    assert a.try_once()
    clock.mono += 20
    assert not b.try_once()
    clock.mono += 15
    assert b.try_once()
    a.release()
    assert lease.record.holder == "b"


def test_acquire_blocks_until_leading_and_keep_reports_a_lost_lease():
    lease = MemoryLease()
    fast = LeaseTimes(duration_s=0.6, renew_deadline_s=0.3, retry_period_s=0.05)
    a = Elector(lease, "a", fast)
    a.acquire()
    assert a.leading and telemetry.LEADER._value.get() == 1
    lost = threading.Event()
    a.keep(on_lost=lost.set)
    time.sleep(0.3)
    assert not lost.is_set()
    lease.down = True
    assert lost.wait(3), "on_lost was not called after the renew deadline"
    assert telemetry.LEADER._value.get() == 0
    a.stop()


def test_acquire_gives_up_when_stopped():
    lease = MemoryLease()
    lease.record = LeaseRecord("other", 15, T0, T0, 0, "1")
    b = Elector(lease, "b", LeaseTimes(15, 10, 0.05))
    threading.Timer(0.2, b.stop).start()
    with pytest.raises(SystemExit):
        b.acquire()
    assert not b.leading


def test_a_standby_answers_healthz():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with leader.standby_health(f"127.0.0.1:{port}"):
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5).read()
        assert body == b"standby\n"
    # Closed afterwards, so kopf can serve its own endpoint on the same port (asyncio's servers reuse the address,
    # which the connection just closed leaves in TIME_WAIT).
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()


def test_operator_flags_that_cannot_work_stop_it_naming_the_flag():
    import argparse

    from batchtune.controller import main

    parser = argparse.ArgumentParser()
    main.add_parser(parser.add_subparsers())
    args = parser.parse_args(["operator", "--leader-elect", "--leader-elect-namespace", "ops",
                              "--leader-elect-renew-deadline", "20"])
    with pytest.raises(SystemExit, match="--leader-elect-renew-deadline 20"):
        main.elector(args)
    args = parser.parse_args(["operator", "--leader-elect", "--leader-elect-namespace", ""])
    with pytest.raises(SystemExit, match="--leader-elect-namespace"):
        main.elector(args)


def test_a_standby_says_it_is_not_leading_before_it_warms_up(monkeypatch):
    # Its /metrics is served before the warm-up: a scrape then must not read `batchtune_leader 1` (the failover
    # test picked such a replica as the leader to kill).
    import argparse

    from batchtune.controller import handlers, main

    seen: list[float] = []

    class Stopped(Exception):
        pass

    def warm_up() -> None:
        seen.append(telemetry.LEADER._value.get())
        raise Stopped

    monkeypatch.setattr(handlers, "warm_up", warm_up)
    monkeypatch.setattr(main, "elector", lambda args: type("E", (), {"me": "b", "where": "ops/lease",
                                                                     "stop": lambda self: None})())
    telemetry.LEADER.set(1)
    parser = argparse.ArgumentParser()
    main.add_parser(parser.add_subparsers())
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = parser.parse_args(["operator", "--leader-elect", "--leader-elect-namespace", "ops",
                              "--liveness-address", f"127.0.0.1:{port}", "--metrics-address", ""])
    with pytest.raises(Stopped):
        main.run(args)
    assert seen == [0]
