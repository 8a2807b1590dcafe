"""Leader election for `batchtune operator --leader-elect`: one of the chart's replicas runs the operator.

The decisions are `core.lease`'s; this module reads and writes the Lease (`coordination.k8s.io/v1`, in the
operator's own namespace) and keeps time. A standby calls `Elector.acquire()`, which returns once it holds the
Lease; only then does kopf start, so a standby holds no watch and no index: it reads one Lease every retry
period. The leader renews from a thread (`Elector.keep`) and, when it could not renew within the renew
deadline, exits at once (`on_lost`): as after a SIGKILL, the replica that takes over resumes from status and
the marks on production. On a clean stop the leader releases the Lease, so the standby takes over on its next
retry.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from batchtune.controller import telemetry
from batchtune.core.lease import Act, LeaseRecord, LeaseTimes, Observed, decide, leading_lost, released

log = logging.getLogger(__name__)


class LeaseConflict(Exception):
    """Someone else wrote the Lease since it was read (HTTP 409)."""


class LeaseApi(Protocol):
    def get(self) -> LeaseRecord | None: ...

    def create(self, record: LeaseRecord) -> LeaseRecord: ...

    def replace(self, record: LeaseRecord) -> LeaseRecord:
        """Write `record`, conditional on its resource_version; `LeaseConflict` when it moved."""


def identity() -> str:
    """This replica's name in the Lease: the pod's name (its hostname) and a random suffix, so a restarted
    process never mistakes its predecessor's Lease for its own."""
    return f"{os.environ.get('POD_NAME') or socket.gethostname()}_{secrets.token_hex(4)}"


class Elector:
    def __init__(self, api: LeaseApi, me: str, times: LeaseTimes, *, monotonic: Callable[[], float] = time.monotonic,
                 now: Callable[[], datetime] = lambda: datetime.now(UTC), where: str = "") -> None:
        self.api, self.me, self.times, self.where = api, me, times, where
        self._monotonic, self._now = monotonic, now
        self._observed: Observed | None = None
        self._held: LeaseRecord | None = None
        self._renewed_at: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._waiting_logged: str | None = None
        self._retry_in_s = times.retry_period_s

    @property
    def leading(self) -> bool:
        return self._held is not None

    @property
    def next_try_in_s(self) -> float:
        """How long `acquire()` waits before its next try: the retry period, or less when the Lease it waits on
        expires sooner."""
        return self._retry_in_s

    def try_once(self) -> bool:
        """Read the Lease and take the step `core.lease.decide` says; True when this replica holds it after."""
        self._retry_in_s = self.times.retry_period_s  # unless a wait on an expiring Lease says sooner
        try:
            current = self.api.get()
            decision = decide(self.me, current, self._observed, self._monotonic(), self._now(), self.times)
            self._observed = decision.observed
            self._retry_in_s = decision.retry_in_s or self._retry_in_s
            if decision.act is Act.WAIT:
                if self._waiting_logged != (current.holder if current else None):
                    self._waiting_logged = current.holder if current else None
                    log.info("Standing by: the Lease %s is %s", self.where, decision.why)
                self._held = None
                return False
            assert decision.write is not None
            started = self._monotonic()
            written = self.api.create(decision.write) if decision.act is Act.CREATE else self.api.replace(decision.write)
        except LeaseConflict:
            self._held = None
            return False
        except Exception as exc:  # noqa: BLE001  # the API server may be away for a moment: try again next period
            log.warning("Leader election: the Lease %s could not be read or written: %s", self.where, exc)
            self._held = None
            return False
        if decision.act is not Act.RENEW:
            log.info("Leading: took the Lease %s (%s)", self.where, decision.why)
        self._held, self._renewed_at = written, started
        self._observed = Observed(written, started)
        return True

    def acquire(self) -> None:
        """Block until this replica holds the Lease (or `stop()` was called: then raise `SystemExit`)."""
        telemetry.LEADER.set(0)
        while not self._stop.is_set():
            if self.try_once():
                telemetry.LEADER.set(1)
                telemetry.LEADER_TRANSITIONS.inc()
                return
            self._stop.wait(self.next_try_in_s)
        raise SystemExit(0)

    def renew(self) -> bool:
        """One renewal; False once the renew deadline has passed without one (leading is lost)."""
        if self.try_once():
            return True
        assert self._renewed_at is not None, "renew() before acquire()"
        return not leading_lost(self._renewed_at, self._monotonic(), self.times)

    def keep(self, on_lost: Callable[[], None]) -> None:
        """Renew every retry period in a thread; `on_lost()` when the renew deadline passes without renewal."""
        def loop() -> None:
            while not self._stop.wait(self.times.retry_period_s):
                if not self.renew():
                    telemetry.LEADER.set(0)
                    log.error("Lost the Lease %s: not renewed for %gs (renew deadline); stopping at once so the "
                              "standby takes over", self.where, self.times.renew_deadline_s)
                    on_lost()
                    return

        self._thread = threading.Thread(target=loop, name="batchtune-lease", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(self.times.retry_period_s + 5)

    def release(self) -> None:
        """Stop renewing and hand the Lease back (the operator has stopped): the standby takes over at once."""
        self.stop()
        held, self._held = self._held, None
        telemetry.LEADER.set(0)
        if held is None:
            return
        try:
            current = self.api.get()
            if current is not None and current.holder == self.me:
                self.api.replace(released(current, self._now()))
                log.info("Released the Lease %s", self.where)
        except Exception as exc:  # noqa: BLE001  # not released: the standby waits out the lease duration instead
            log.warning("The Lease %s was not released (%s); the standby takes over when it expires", self.where, exc)


# ---- the Lease on a real API server ------------------------------------------------------------


def _micro(value: datetime | None) -> str | None:
    # MicroTime: RFC 3339 with exactly six fractional digits.
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ") if value else None


def _time(value: Any) -> datetime | None:
    # MicroTime as the API server writes it (RFC 3339, "Z"), read into an aware datetime as the typed client did.
    return datetime.fromisoformat(str(value).replace("Z", "+00:00")) if value else None


def _record(lease: Any) -> LeaseRecord:
    spec, meta = lease.get("spec") or {}, lease.get("metadata") or {}
    return LeaseRecord(holder=spec.get("holderIdentity") or None, duration_s=int(spec.get("leaseDurationSeconds") or 0),
                       acquire_time=_time(spec.get("acquireTime")), renew_time=_time(spec.get("renewTime")),
                       transitions=int(spec.get("leaseTransitions") or 0), resource_version=meta.get("resourceVersion"))


LEASES = "/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"


class KubeLease:
    """`LeaseApi` over `coordination.k8s.io/v1` Leases, read and written as JSON through `kube.request` (the typed
    `CoordinationV1Api` would load its model modules into the active replica: ~1 MB)."""

    def __init__(self, namespace: str, name: str, api_client: Any = None) -> None:
        from batchtune.controller import kube

        self.namespace, self.name = namespace, name
        self._client = api_client if api_client is not None else kube.api()

    def _call(self, method: str, path: str, body: Any = None) -> LeaseRecord:
        from batchtune.controller import kube

        params = {"namespace": self.namespace, "name": self.name}
        return _record(kube.read_json(kube.request(method, path, params, body=body, timeout=5, via=self._client)))

    def _body(self, record: LeaseRecord) -> Any:
        """The Lease as a plain dict (the client's signatures name its model classes; it takes dicts too)."""
        metadata: dict[str, Any] = {"name": self.name, "namespace": self.namespace,
                                    "labels": {"app.kubernetes.io/managed-by": "batchtune"}}
        if record.resource_version:
            metadata["resourceVersion"] = record.resource_version
        return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": metadata,
                "spec": {"holderIdentity": record.holder, "leaseDurationSeconds": record.duration_s,
                         "acquireTime": _micro(record.acquire_time), "renewTime": _micro(record.renew_time),
                         "leaseTransitions": record.transitions}}

    def get(self) -> LeaseRecord | None:
        from kubernetes.client.exceptions import ApiException

        try:
            return self._call("GET", LEASES + "/{name}")
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def create(self, record: LeaseRecord) -> LeaseRecord:
        from kubernetes.client.exceptions import ApiException

        try:
            return self._call("POST", LEASES, self._body(record))
        except ApiException as exc:
            if exc.status == 409:
                raise LeaseConflict(str(exc.reason)) from None
            raise

    def replace(self, record: LeaseRecord) -> LeaseRecord:
        from kubernetes.client.exceptions import ApiException

        try:
            return self._call("PUT", LEASES + "/{name}", self._body(record))
        except ApiException as exc:
            if exc.status == 409:
                raise LeaseConflict(str(exc.reason)) from None
            raise


# ---- /healthz while standing by ------------------------------------------------------------------


@contextmanager
def standby_health(address: str) -> Iterator[None]:
    """Answer /healthz on the liveness address while standing by (a standby is healthy and Ready, so a rolling
    update can go on); closed before kopf serves its own endpoint on the same address."""
    if not address:
        yield
        return
    host, _, port = address.rpartition(":")

    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802  # http.server's name
            ok = self.path.split("?")[0] == "/healthz"
            self.send_response(200 if ok else 404)
            self.send_header("Content-Type", "text/plain")
            self.end_headers()
            self.wfile.write(b"standby\n" if ok else b"not found\n")

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002  # http.server's signature
            return

    server = ThreadingHTTPServer((host or "127.0.0.1", int(port)), Health)
    thread = threading.Thread(target=server.serve_forever, name="batchtune-standby-health", daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()
