"""Services of type LoadBalancer on loopback: what kube-proxy and a cloud load balancer do, for the local cluster.

Loopback pod IPs can never be in Endpoints (the API server refuses 127.0.0.0/8 there), so no real
kube-proxy could route to them. This process does the same job the plain way: it gives each
`type: LoadBalancer` Service an address from a loopback pool (written to `status.loadBalancer`, as
MetalLB or a cloud controller would), listens on it for each Service port, and forwards every new TCP
connection to a ready, non-terminating pod the Service's selector picks, round-robin. A rollout
therefore moves new connections to the new pods, as on a real cluster.

    python -m batchtune_local.servicelb --kubeconfig admin.kubeconfig --network 127.1.255.0/24
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import itertools
import logging
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("servicelb")

POLL_SECONDS = 1.0
CONNECT_TIMEOUT_SECONDS = 5.0


# ---- pure: which pods a Service routes to, and which address it gets ---------------------------------

@dataclass(frozen=True)
class Endpoint:
    ip: str
    port: int


def ready(pod: Mapping[str, Any]) -> bool:
    """Serving: Running, Ready, not being deleted (EndpointSlice's `serving and not terminating`)."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    if meta.get("deletionTimestamp") or status.get("phase") != "Running" or not status.get("podIP"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def selects(selector: Mapping[str, str] | None, pod: Mapping[str, Any]) -> bool:
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return bool(selector) and all(labels.get(k) == v for k, v in (selector or {}).items())


def target_port(port: Mapping[str, Any], pod: Mapping[str, Any]) -> int | None:
    """The pod port a Service port forwards to: a number, or a container port's name."""
    target = port.get("targetPort", port.get("port"))
    if isinstance(target, int):
        return target
    if isinstance(target, str) and target.isdigit():
        return int(target)
    for container in (pod.get("spec") or {}).get("containers") or []:
        for cport in container.get("ports") or []:
            if cport.get("name") == target:
                return int(cport["containerPort"])
    return None


def endpoints(service: Mapping[str, Any], port: Mapping[str, Any], pods: Sequence[Mapping[str, Any]]) -> list[Endpoint]:
    selector = (service.get("spec") or {}).get("selector")
    out = []
    for pod in pods:
        if selects(selector, pod) and ready(pod):
            number = target_port(port, pod)
            if number is not None:
                out.append(Endpoint(str(pod["status"]["podIP"]), number))
    return sorted(out, key=lambda e: (e.ip, e.port))


def pick_address(network: str, taken: set[str], current: str | None) -> str | None:
    """The Service's address: the one it has if it is in the pool, else the lowest free one."""
    pool = ipaddress.ip_network(network)
    if current and ipaddress.ip_address(current) in pool:
        return current
    return next((str(ip) for ip in pool.hosts() if str(ip) not in taken), None)


# ---- the proxy --------------------------------------------------------------------------------------

@dataclass
class Listener:
    server: asyncio.base_events.Server
    backends: list[Endpoint] = field(default_factory=list)
    turn: itertools.count[int] = field(default_factory=itertools.count)

    def next_backend(self) -> Endpoint | None:
        if not self.backends:
            return None
        return self.backends[next(self.turn) % len(self.backends)]


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while chunk := await reader.read(65536):
            writer.write(chunk)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        with contextlib.suppress(RuntimeError):
            writer.close()


async def _forward(listener: Listener, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
    backend = listener.next_backend()
    if backend is None:  # no ready pod: refuse, as kube-proxy rejects a Service without endpoints
        client_w.close()
        return
    try:
        up_r, up_w = await asyncio.wait_for(asyncio.open_connection(backend.ip, backend.port),
                                            CONNECT_TIMEOUT_SECONDS)
    except (TimeoutError, OSError):
        client_w.close()
        return
    await asyncio.gather(_pipe(client_r, up_w), _pipe(up_r, client_w))


class ServiceLB:
    def __init__(self, kubeconfig: str, network: str) -> None:
        from kubernetes import client, config

        if not ipaddress.ip_network(network).subnet_of(ipaddress.ip_network("127.0.0.0/8")):
            raise SystemExit(f"--network {network}: must lie inside 127.0.0.0/8 (traffic stays on loopback)")
        self.network = network
        self.api = config.new_client_from_config(config_file=kubeconfig)
        self.core = client.CoreV1Api(self.api)
        self.listeners: dict[tuple[str, int], Listener] = {}

    def _read(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        services = self.api.sanitize_for_serialization(self.core.list_service_for_all_namespaces().items)
        pods = self.api.sanitize_for_serialization(self.core.list_pod_for_all_namespaces().items)
        return ([s for s in services if (s.get("spec") or {}).get("type") == "LoadBalancer"], pods)

    def _publish(self, service: Mapping[str, Any], address: str) -> None:
        meta = service["metadata"]
        self.core.patch_namespaced_service_status(meta["name"], meta["namespace"], {
            "status": {"loadBalancer": {"ingress": [{"ip": address, "ipMode": "Proxy"}]}}})

    async def sync(self) -> None:
        loop = asyncio.get_running_loop()
        services, pods = await loop.run_in_executor(None, self._read)
        wanted: set[tuple[str, int]] = set()
        taken = {ing.get("ip") for s in services for ing in ((s.get("status") or {}).get("loadBalancer") or {})
                 .get("ingress") or [] if ing.get("ip")}
        for service in services:
            ingress = ((service.get("status") or {}).get("loadBalancer") or {}).get("ingress") or []
            current = ingress[0].get("ip") if ingress else None
            address = pick_address(self.network, taken - {current}, current)
            if address is None:
                log.warning("no free address in %s for %s", self.network, service["metadata"]["name"])
                continue
            taken.add(address)
            if address != current:
                await loop.run_in_executor(None, self._publish, service, address)
                log.info("%s/%s -> %s", service["metadata"]["namespace"], service["metadata"]["name"], address)
            ns_pods = [p for p in pods if (p.get("metadata") or {}).get("namespace") == service["metadata"]["namespace"]]
            for port in (service.get("spec") or {}).get("ports") or []:
                if port.get("protocol", "TCP") != "TCP":
                    continue
                key = (address, int(port["port"]))
                wanted.add(key)
                if key not in self.listeners:
                    server = await asyncio.start_server(
                        lambda r, w, key=key: _forward(self.listeners[key], r, w), host=address, port=key[1])
                    self.listeners[key] = Listener(server)
                self.listeners[key].backends = endpoints(service, port, ns_pods)
        for key in set(self.listeners) - wanted:
            self.listeners.pop(key).server.close()

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.sync()
            except Exception as exc:  # a passing API error: the next poll retries
                log.warning("sync failed: %s", exc)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), POLL_SECONDS)
        for listener in self.listeners.values():
            listener.server.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m batchtune_local.servicelb", description=__doc__.split("\n")[0])
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--network", default="127.1.255.0/24", help="loopback pool of Service addresses")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    lb = ServiceLB(args.kubeconfig, args.network)

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await lb.run(stop)

    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
