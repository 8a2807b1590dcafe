"""Health probes for each component, over loopback HTTP(S), with only the standard library."""

from __future__ import annotations

import json
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


class GiveUp(Exception):
    """Raised by a predicate to end a wait at once (e.g. the awaited process died)."""


class Timeout(TimeoutError):
    """A wait ran out; the message names what was awaited and the last thing seen."""


def wait_for(predicate: Callable[[], T], timeout: float = 30.0, interval: float = 0.25,
             what: str | None = None) -> T:
    """Poll `predicate` until it returns something truthy and return that; raise `Timeout` otherwise.

    Exceptions from the predicate count as "not yet" (the last one is quoted in the timeout message),
    except `GiveUp`, which ends the wait at once.
    """
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            result = predicate()
            if result:
                return result
            last = result
        except GiveUp:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure is "not yet" until the deadline
            last = exc
        if time.monotonic() >= deadline:
            name = what or getattr(predicate, "__name__", "condition")
            raise Timeout(f"{name} not met within {timeout:g}s (last seen: {last!r})")
        time.sleep(interval)


def _context(ca_file: Path | None) -> ssl.SSLContext:
    if ca_file is None:
        # Controller-manager and scheduler serve self-signed certs on loopback; nothing to verify against.
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        return ctx
    return ssl.create_default_context(cafile=str(ca_file))


def http_get(url: str, *, token: str | None = None, ca_file: Path | None = None,
             timeout: float = 2.0) -> tuple[int, bytes]:
    """Status and body of a GET; HTTP errors come back as their status, connection errors raise."""
    request = urllib.request.Request(url)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    context = _context(ca_file) if url.startswith("https") else None
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def is_ok(url: str, **kwargs: Any) -> bool:
    try:
        return http_get(url, **kwargs)[0] == 200
    except OSError:
        return False


def api_json(api_server: str, path: str, *, token: str, ca_file: Path, method: str = "GET",
             body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
    """Call the API server with a bearer token; returns the status and the decoded JSON body."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(api_server + path, data=data, method=method)
    request.add_header("Authorization", f"Bearer {token}")
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=5, context=_context(ca_file)) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def ready_nodes(api_server: str, *, token: str, ca_file: Path) -> list[str]:
    """Names of the nodes whose Ready condition is True."""
    status, body = api_json(api_server, "/api/v1/nodes", token=token, ca_file=ca_file)
    if status != 200:
        return []
    return [
        node["metadata"]["name"]
        for node in body.get("items", [])
        if any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in node.get("status", {}).get("conditions", []))
    ]
