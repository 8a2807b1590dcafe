"""Pure allocation of pod loopback IPs and GPU indices."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable


class OutOfAddresses(Exception):
    """Every address of the pod network is taken."""


def allocate_ip(network: str, used: Iterable[str], after: str | None = None) -> str:
    """The next free host address of `network` after `after` (wrapping), skipping .0/.255 and 127.0.0.1.

    Next-fit rather than lowest-free, so a deleted pod's address is not handed straight to a
    new pod while scrapers and clients may still dial it.
    """
    net = ipaddress.ip_network(network)
    if not net.subnet_of(ipaddress.ip_network("127.0.0.0/8")):  # type: ignore[arg-type]  # net may be IPv6; that raises TypeError here
        raise ValueError(f"pod network {network!r} must lie inside 127.0.0.0/8")
    taken = set(used)
    hosts = int(net.num_addresses)
    base = int(net.network_address)
    start = 0 if after is None else (int(ipaddress.ip_address(after)) - base + 1) % hosts
    for step in range(hosts):
        candidate = ipaddress.ip_address(base + (start + step) % hosts)
        text = str(candidate)
        last_octet = int(candidate) & 0xFF
        if last_octet in (0, 255) or text == "127.0.0.1" or text in taken:
            continue
        return text
    raise OutOfAddresses(f"pod network {network} has no free address ({len(taken)} in use)")


def allocate_gpus(total: int, held: Iterable[int], count: int) -> list[int] | None:
    """The `count` lowest free GPU indices out of `total`, or None when too few are free."""
    if count < 0:
        raise ValueError(f"GPU count must be >= 0, got {count}")
    busy = set(held)
    free = [i for i in range(total) if i not in busy]
    return free[:count] if len(free) >= count else None


def gpu_limit(container: dict) -> int:
    """`nvidia.com/gpu` of a container: limits win, requests count when limits are absent."""
    resources = container.get("resources") or {}
    for section in ("limits", "requests"):
        value = (resources.get(section) or {}).get("nvidia.com/gpu")
        if value is not None:
            try:
                return int(str(value))
            except ValueError as exc:
                raise ValueError(
                    f"container {container.get('name')!r}: resources.{section}['nvidia.com/gpu'] "
                    f"must be an integer, got {value!r}"
                ) from exc
    return 0
