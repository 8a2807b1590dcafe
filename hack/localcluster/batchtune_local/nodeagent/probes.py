"""Container probes: the kubelet's threshold logic (pure) and the three ways to run a probe."""

from __future__ import annotations

import http.client
import os
import socket
import ssl
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class ProbeKind(StrEnum):
    STARTUP = "startup"
    READINESS = "readiness"
    LIVENESS = "liveness"


@dataclass(frozen=True)
class ProbeSpec:
    """A container probe's handler and timing, with delays already divided by the time scale."""

    handler: Mapping[str, Any]
    """The raw spec: has one of `httpGet`, `tcpSocket`, `exec`, `grpc`."""
    initial_delay_s: float = 0.0
    period_s: float = 10.0
    timeout_s: float = 1.0
    success_threshold: int = 1
    failure_threshold: int = 3

    @classmethod
    def from_spec(cls, probe: Mapping[str, Any], time_scale: float = 1.0) -> ProbeSpec:
        # Delays and periods are simulated waits (like model loading); the timeout is real I/O.
        return cls(
            handler=probe,
            initial_delay_s=float(probe.get("initialDelaySeconds") or 0) / time_scale,
            period_s=max(float(probe.get("periodSeconds") or 10) / time_scale, 0.1),
            timeout_s=float(probe.get("timeoutSeconds") or 1),
            success_threshold=int(probe.get("successThreshold") or 1),
            failure_threshold=int(probe.get("failureThreshold") or 3),
        )


class ProbeTracker:
    """Consecutive-result counting for one probe of one container run."""

    def __init__(self, kind: ProbeKind, spec: ProbeSpec, started_at: float) -> None:
        self.kind = kind
        self.spec = spec
        self.started_at = started_at
        # The kubelet starts readiness and startup at failure, liveness at success.
        self.result = kind is ProbeKind.LIVENESS
        self.successes = 0
        self.failures = 0
        self.last_run: float | None = None
        self.last_message = ""

    def due(self, now: float) -> bool:
        if self.last_run is None:
            return now >= self.started_at + self.spec.initial_delay_s
        return now >= self.last_run + self.spec.period_s

    def record(self, success: bool, now: float, message: str = "") -> bool:
        """Count one probe result; return the (possibly flipped) probe result."""
        self.last_run = now
        self.last_message = message
        if success:
            self.successes += 1
            self.failures = 0
            # Liveness and startup probes need exactly one success (the API enforces threshold 1).
            threshold = self.spec.success_threshold if self.kind is ProbeKind.READINESS else 1
            if self.successes >= threshold:
                self.result = True
        else:
            self.failures += 1
            self.successes = 0
            if self.failures >= self.spec.failure_threshold:
                self.result = False
        return self.result

    @property
    def failed_out(self) -> bool:
        """Liveness/startup verdict: the container must be killed."""
        return self.failures >= self.spec.failure_threshold


def resolve_port(port: Any, container: Mapping[str, Any]) -> int:
    """A probe port: a number, or the name of one of the container's ports."""
    if isinstance(port, int) or (isinstance(port, str) and port.isdigit()):
        return int(port)
    for entry in container.get("ports") or []:
        if entry.get("name") == port:
            return int(entry["containerPort"])
    raise ValueError(f"container {container.get('name')!r} has no port named {port!r}")


def run_probe(
    spec: ProbeSpec,
    *,
    pod_ip: str,
    container: Mapping[str, Any],
    env: Mapping[str, str],
    cwd: str,
) -> tuple[bool, str]:
    """Run a probe once; (success, message). `exec` runs the command locally with the container's env."""
    handler = spec.handler
    try:
        if "httpGet" in handler:
            return _http_get(handler["httpGet"], pod_ip, container, spec.timeout_s)
        if "tcpSocket" in handler:
            tcp = handler["tcpSocket"]
            host = tcp.get("host") or pod_ip
            with socket.create_connection((host, resolve_port(tcp.get("port"), container)), timeout=spec.timeout_s):
                return True, ""
        if "exec" in handler:
            return _exec(handler["exec"].get("command") or [], env, cwd, spec.timeout_s)
        if "grpc" in handler:
            # No gRPC health client here: treat as TCP reachability of the port.
            port = int(handler["grpc"].get("port"))
            with socket.create_connection((pod_ip, port), timeout=spec.timeout_s):
                return True, ""
    except (OSError, ValueError, http.client.HTTPException) as exc:
        return False, f"{type(exc).__name__}: {exc}"
    return False, f"probe has no supported handler: {sorted(handler)}"


def _http_get(get: Mapping[str, Any], pod_ip: str, container: Mapping[str, Any], timeout: float) -> tuple[bool, str]:
    host = get.get("host") or pod_ip
    port = resolve_port(get.get("port"), container)
    path = get.get("path") or "/"
    if not path.startswith("/"):
        path = "/" + path
    if str(get.get("scheme", "HTTP")).upper() == "HTTPS":
        conn: http.client.HTTPConnection = http.client.HTTPSConnection(
            host, port, timeout=timeout, context=ssl._create_unverified_context()  # the kubelet skips verification too
        )
    else:
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        headers = {"User-Agent": "kube-probe/batchtune", "Accept": "*/*"}
        for header in get.get("httpHeaders") or []:
            headers[str(header.get("name"))] = str(header.get("value"))
        conn.request("GET", path, headers=headers)
        response = conn.getresponse()
        response.read(10 * 1024)
        ok = 200 <= response.status < 400
        return ok, "" if ok else f"HTTP probe failed with statuscode: {response.status}"
    finally:
        conn.close()


def _exec(command: Sequence[str], env: Mapping[str, str], cwd: str, timeout: float) -> tuple[bool, str]:
    if not command:
        return False, "exec probe has no command"
    try:
        done = subprocess.run(
            list(command), env=dict(env), cwd=cwd if os.path.isdir(cwd) else None,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout, check=False,
        )
    except subprocess.TimeoutExpired:
        return False, f"command timed out after {timeout:g}s"
    output = done.stdout.decode("utf-8", "replace")[-1024:]
    return done.returncode == 0, output if done.returncode else ""
