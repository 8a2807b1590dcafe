"""The agent's state directory: IP and GPU allocations and process IDs, so a restart keeps them."""

from __future__ import annotations

import copy
import json
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

from batchtune_local.nodeagent.allocation import allocate_gpus, allocate_ip


class StateStore:
    """`state.json` under the state dir: {"lastIP": str, "pods": {uid: record}}.

    A record: namespace, name, node, ip, gpus {container: [index]}, startTime,
    processes {container: {pid, ticks, startedAt}}, gpusReleased.
    """

    def __init__(self, state_dir: str | os.PathLike[str], pod_network: str) -> None:
        self.dir = Path(state_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "state.json"
        self.pod_network = pod_network
        self._lock = threading.RLock()
        self._data: dict[str, Any] = {"lastIP": None, "pods": {}}
        if self.path.exists():
            loaded = json.loads(self.path.read_text(encoding="utf-8"))
            if isinstance(loaded, dict) and isinstance(loaded.get("pods"), dict):
                self._data = loaded

    def pods(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return copy.deepcopy(self._data["pods"])

    def pod(self, uid: str) -> dict[str, Any] | None:
        with self._lock:
            record = self._data["pods"].get(uid)
            return copy.deepcopy(record) if record else None

    def admit(self, uid: str, namespace: str, name: str, node: str, gpu_requests: dict[str, int],
              gpus_per_node: int, now: float) -> dict[str, Any]:
        """The pod's record, allocating an IP and GPUs on first sight. Raises InsufficientGpus."""
        with self._lock:
            existing = self._data["pods"].get(uid)
            if existing:
                return copy.deepcopy(existing)
            held = self._held_gpus(node)
            gpus: dict[str, list[int]] = {}
            for container, count in gpu_requests.items():
                got = allocate_gpus(gpus_per_node, held, count)
                if got is None:
                    raise InsufficientGpus(
                        f"Pod {namespace}/{name}: container {container!r} needs {count} nvidia.com/gpu, "
                        f"node {node} has {gpus_per_node - len(held)} free"
                    )
                gpus[container] = got
                held.update(got)
            used = {r["ip"] for r in self._data["pods"].values()}
            ip = allocate_ip(self.pod_network, used, after=self._data.get("lastIP"))
            record = {
                "namespace": namespace, "name": name, "node": node, "ip": ip, "gpus": gpus,
                "startTime": now, "processes": {}, "gpusReleased": False,
            }
            self._data["pods"][uid] = record
            self._data["lastIP"] = ip
            self._save()
            return copy.deepcopy(record)

    def set_process(self, uid: str, container: str, entry: dict[str, Any] | None) -> None:
        with self._lock:
            record = self._data["pods"].get(uid)
            if record is None:
                return
            if entry is None:
                record["processes"].pop(container, None)
            else:
                record["processes"][container] = entry
            self._save()

    def release_gpus(self, uid: str) -> None:
        with self._lock:
            record = self._data["pods"].get(uid)
            if record and not record["gpusReleased"]:
                record["gpusReleased"] = True
                self._save()

    def forget(self, uid: str) -> None:
        with self._lock:
            if self._data["pods"].pop(uid, None) is not None:
                self._save()

    def gpu_holders(self, node: str) -> dict[int, tuple[str, str]]:
        """{GPU index: (pod uid, container)} of the node's GPUs held right now."""
        with self._lock:
            out: dict[int, tuple[str, str]] = {}
            for uid, record in self._data["pods"].items():
                if record["node"] != node or record["gpusReleased"]:
                    continue
                for container, indices in record["gpus"].items():
                    for index in indices:
                        out[index] = (uid, container)
            return out

    def _held_gpus(self, node: str) -> set[int]:
        return set(self.gpu_holders(node))

    def _save(self) -> None:
        fd, tmp = tempfile.mkstemp(prefix=".state.", suffix=".tmp", dir=self.dir)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(self._data, fh, indent=1, sort_keys=True)
        os.replace(tmp, self.path)


class InsufficientGpus(Exception):
    """The node has fewer free GPUs than the pod asks for (the scheduler should have prevented it)."""
