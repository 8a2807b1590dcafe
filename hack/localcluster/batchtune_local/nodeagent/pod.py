"""One pod on one node: its containers as processes, probes, restarts, status and deletion.

A `PodWorker` is level-based: each `tick()` looks at the latest pod object and the processes
and takes the next steps; a thread calls it a few times a second.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from batchtune_local.nodeagent.allocation import gpu_limit
from batchtune_local.nodeagent.env import EnvError, PodNetwork, expand, resolve_env
from batchtune_local.nodeagent.images import ImageMap, ImageNotMapped
from batchtune_local.nodeagent.probes import ProbeKind, ProbeSpec, ProbeTracker, run_probe
from batchtune_local.nodeagent.process import EXIT_UNKNOWN, ContainerProcess
from batchtune_local.nodeagent.state import InsufficientGpus, StateStore
from batchtune_local.nodeagent.status import (
    ContainerView,
    Terminated,
    build_pod_status,
    termination_message,
    termination_reason,
)
from batchtune_local.nodeagent.volumes import empty_dir_mounts, ensure_dirs, rewrite_path

log = logging.getLogger("batchtune_local.nodeagent")

MANAGED_CONDITIONS = ("PodReadyToStartContainers", "Initialized", "Ready", "ContainersReady")
BASE_ENV_KEYS = ("PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR", "PYTHONPATH", "VIRTUAL_ENV")
CONFIG_RETRY_S = 5.0
MAX_BACKOFF_S = 300.0


@dataclass(frozen=True)
class NodeSettings:
    """What every pod on one node shares."""

    node: str
    gpu_product: str
    gpus_per_node: int
    image_map: ImageMap
    state_dir: Path
    time_scale: float = 1.0
    host_ip: str = "127.0.0.1"
    allocatable: Mapping[str, str] = field(default_factory=dict)
    base_env: Mapping[str, str] = field(default_factory=dict)
    idle_pods: bool = False
    """Run every container at the lowest CPU priority (`process.lowest_cpu_priority`)."""


class PodApi(Protocol):
    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None: ...
    def delete_pod(self, namespace: str, name: str, uid: str) -> None: ...
    def config_map(self, namespace: str, name: str) -> Mapping[str, str] | None: ...
    def secret(self, namespace: str, name: str) -> Mapping[str, str] | None: ...
    def event(self, pod: Mapping[str, Any], container: str, kind: str, reason: str, message: str) -> None: ...


def backoff_s(crashes: int, time_scale: float) -> float:
    """The kubelet's restart back-off: the first restart at once, then 10 s doubling to 5 min."""
    if crashes <= 1:
        return 0.0
    return min(10.0 * 2 ** (crashes - 2), MAX_BACKOFF_S) / time_scale


def pod_key(pod: Mapping[str, Any]) -> str:
    meta = pod["metadata"]
    return f"{meta['namespace']}/{meta['name']}"


class ContainerRuntime:
    """The mutable run state of one container of the pod."""

    def __init__(self, spec: Mapping[str, Any], init: bool) -> None:
        self.spec = spec
        self.name = str(spec["name"])
        self.image = str(spec.get("image") or "")
        self.init = init
        self.process: ContainerProcess | None = None
        self.running_since: float | None = None
        self.terminated: Terminated | None = None
        self.last_terminated: Terminated | None = None
        self.pending_restart = False
        self.crashes = 0
        self.restart_count = 0
        self.next_start_at = 0.0
        self.waiting_reason = "ContainerCreating"
        self.waiting_message = ""
        self.probes: dict[ProbeKind, ProbeTracker] = {}
        self.env: dict[str, str] = {}
        self.stop_deadline: float | None = None
        self.log_offset = 0
        self.container_id = ""

    @property
    def started(self) -> bool:
        startup = self.probes.get(ProbeKind.STARTUP)
        return self.process is not None and (startup is None or startup.result)

    @property
    def ready(self) -> bool:
        if self.process is None or not self.started:
            return False
        readiness = self.probes.get(ProbeKind.READINESS)
        return readiness is None or readiness.result

    def view(self, now: float, pod_name: str) -> ContainerView:
        waiting_reason, waiting_message = self.waiting_reason, self.waiting_message
        if self.process is None and self.pending_restart:
            if now < self.next_start_at:
                wait = round(self.next_start_at - (self.last_terminated.finished_at if self.last_terminated else now))
                waiting_reason = "CrashLoopBackOff"
                waiting_message = f"back-off {wait}s restarting failed container={self.name} pod={pod_name}"
            elif waiting_reason == "ContainerCreating":
                waiting_reason, waiting_message = "ContainerCreating", ""
        return ContainerView(
            name=self.name,
            image=self.image,
            restart_count=self.restart_count,
            running_since=self.running_since if self.process is not None else None,
            terminated=self.terminated,
            waiting_reason=waiting_reason,
            waiting_message=waiting_message,
            last_terminated=self.last_terminated,
            ready=self.ready,
            started=self.started,
            container_id=self.container_id,
        )


def _terminated_from_status(state: Mapping[str, Any] | None) -> Terminated | None:
    """A terminated state read back from the API (so a restarted agent keeps finished containers)."""
    import datetime as dt

    if not state or "terminated" not in state:
        return None
    t = state["terminated"]

    def ts(key: str) -> float:
        text = t.get(key)
        if not text:
            return time.time()
        return dt.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC).timestamp()

    return Terminated(
        exit_code=int(t.get("exitCode", 0)), reason=str(t.get("reason") or ""), started_at=ts("startedAt"),
        finished_at=ts("finishedAt"), message=str(t.get("message") or ""), signal=t.get("signal"),
        container_id=str(t.get("containerID") or ""),
    )


class PodWorker:
    """Runs one pod; thread-safe `update`/`removed`/`shutdown`, and `tick` for the work."""

    def __init__(self, pod: dict[str, Any], settings: NodeSettings, store: StateStore, api: PodApi,
                 clock: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self.store = store
        self.api = api
        self.clock = clock
        self.uid = str(pod["metadata"]["uid"])
        self.key = pod_key(pod)
        self._pod = pod
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._removed = False
        self._shutdown = False
        self.done = False
        self.last_sent: dict[str, Any] | None = None
        self.terminal = False
        self.admission_error = ""
        self._last_error = ""
        self.record: dict[str, Any] | None = None
        self.thread: threading.Thread | None = None
        meta, spec = pod["metadata"], pod.get("spec") or {}
        self.dir_name = f"{meta['namespace']}_{meta['name']}_{self.uid}"
        self.pod_dir = settings.state_dir / "pods" / self.dir_name
        self.log_dir = settings.state_dir / "logs" / self.dir_name
        self.restart_policy = str(spec.get("restartPolicy") or "Always")
        self.init_containers = [ContainerRuntime(c, True) for c in spec.get("initContainers") or []]
        self.containers = [ContainerRuntime(c, False) for c in spec.get("containers") or []]
        self._setup()

    # ---- inputs from the watch and the agent -------------------------------------------------
    @property
    def pod(self) -> dict[str, Any]:
        with self._lock:
            return self._pod

    def update(self, pod: dict[str, Any]) -> None:
        with self._lock:
            self._pod = pod
        self._wake.set()

    def removed(self) -> None:
        """The pod object is gone from the API (force-deleted): stop at once."""
        self._removed = True
        self._wake.set()

    def shutdown(self) -> None:
        """The agent stops: end the processes, leave the API alone."""
        self._shutdown = True
        self._wake.set()

    def start(self) -> None:
        self.thread = threading.Thread(target=self._loop, name=f"pod-{self.key}", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.done:
            try:
                self.tick()
            except Exception:  # a bad tick must not leave the pod's processes unwatched
                log.exception("Pod %s: tick failed", self.key)
            if not self.done:
                self._wake.wait(self._interval())
                self._wake.clear()

    def _interval(self) -> float:
        return 2.0 if self.terminal else 0.2

    # ---- setup and re-adoption ---------------------------------------------------------------
    def _setup(self) -> None:
        pod = self.pod
        meta, status = pod["metadata"], pod.get("status") or {}
        if status.get("phase") in ("Succeeded", "Failed"):
            # Finished before we saw it (or before an agent restart): never run it again.
            self.terminal = True
            self.record = self.store.pod(self.uid)
            if self.record:
                self.store.release_gpus(self.uid)
            return
        requests = {c.name: gpu_limit(c.spec) for c in self.containers + self.init_containers}
        try:
            self.record = self.store.admit(
                self.uid, meta["namespace"], meta["name"], self.settings.node,
                {k: v for k, v in requests.items() if v}, self.settings.gpus_per_node, self.clock(),
            )
        except InsufficientGpus as exc:
            self.admission_error = str(exc)
            log.warning("Pod %s was rejected: %s", self.key, exc)
            return
        self.pod_dir.mkdir(parents=True, exist_ok=True)
        (self.pod_dir / ".batchtune").mkdir(exist_ok=True)
        # Keep what the API already knows (restart counts, finished containers) across agent restarts.
        known = {s.get("name"): s for s in (status.get("containerStatuses") or []) + (status.get("initContainerStatuses") or [])}
        for c in self.init_containers + self.containers:
            previous = known.get(c.name) or {}
            c.restart_count = int(previous.get("restartCount") or 0)
            c.last_terminated = _terminated_from_status(previous.get("lastState"))
            c.terminated = _terminated_from_status(previous.get("state"))
            if c.terminated and self._wants_restart(c, c.terminated.exit_code):
                c.last_terminated, c.terminated, c.pending_restart = c.terminated, None, True
            entry = self.record["processes"].get(c.name)
            if entry:
                adopted = ContainerProcess.adopt(int(entry["pid"]), int(entry["ticks"]))
                if adopted is not None:
                    c.process = adopted
                    c.running_since = float(entry["startedAt"])
                    c.container_id = str(entry.get("containerID") or "")
                    try:
                        c.env = self._env_for(c)[1]
                    except (ImageNotMapped, EnvError, ValueError):
                        c.env = {}
                    self._make_probes(c, c.running_since, already_running=True)
                    log.info("Pod %s: container %s was adopted (pid %d)", self.key, c.name, adopted.pid)
                else:
                    # Ran under an earlier agent and is gone; its exit status is lost.
                    now = self.clock()
                    self.store.set_process(self.uid, c.name, None)
                    self._record_exit(c, Terminated(
                        137, "ContainerStatusUnknown", float(entry["startedAt"]), now,
                        "The container could not be located when the node agent restarted",
                        container_id=str(entry.get("containerID") or ""),
                    ), now)

    # ---- the level-based step ----------------------------------------------------------------
    def tick(self) -> None:
        if self.done:
            return
        now = self.clock()
        pod = self.pod
        if self._shutdown:
            self._stop_all(now, grace_cap=10.0, wait=True)
            self.done = True
            return
        if self._removed:
            self._stop_all(now, grace_cap=2.0, wait=True)
            self._finish()
            return
        if pod["metadata"].get("deletionTimestamp"):
            self._delete_step(now, pod)
            return
        if self.terminal or self.admission_error:
            if self.admission_error and not self.terminal:
                self._report(now, pod)
            return
        init_done, init_failed = self._init_step(now)
        if init_done and not init_failed:
            for c in self.containers:
                self._container_step(c, now, self.restart_policy)
        self._report(now, pod, init_done=init_done, init_failed=init_failed)

    def _init_step(self, now: float) -> tuple[bool, bool]:
        policy = "Never" if self.restart_policy == "Never" else "OnFailure"
        for c in self.init_containers:
            if c.terminated is not None:
                if c.terminated.exit_code == 0:
                    continue
                return False, True
            self._container_step(c, now, policy)
            if c.terminated is not None and c.terminated.exit_code == 0:
                continue
            return False, c.terminated is not None
        return True, False

    def _wants_restart(self, c: ContainerRuntime, exit_code: int) -> bool:
        policy = self.restart_policy if not c.init else ("Never" if self.restart_policy == "Never" else "OnFailure")
        return policy == "Always" or (policy == "OnFailure" and exit_code != 0)

    def _container_step(self, c: ContainerRuntime, now: float, policy: str) -> None:
        if c.process is not None:
            code = c.process.poll()
            if code is not None:
                self._on_exit(c, code, now)
            elif c.stop_deadline is not None:
                if now >= c.stop_deadline:
                    c.process.signal(signal.SIGKILL)
            else:
                self._probe_step(c, now)
            return
        if c.terminated is not None or now < c.next_start_at:
            return
        self._start(c, now)

    def _start(self, c: ContainerRuntime, now: float) -> None:
        try:
            argv, env = self._env_for(c)
        except ImageNotMapped as exc:
            self._waiting(c, now, "ErrImagePull", str(exc))
            return
        except (EnvError, ValueError) as exc:
            self._waiting(c, now, "CreateContainerConfigError", str(exc))
            return
        term_path = Path(env["BATCHTUNE_TERMINATION_MESSAGE_PATH"])
        term_path.unlink(missing_ok=True)
        log_path = self.log_dir / f"{c.name}.log"
        c.log_offset = log_path.stat().st_size if log_path.exists() else 0
        try:
            process = ContainerProcess.start(argv, env, self.pod_dir, log_path, idle=self.settings.idle_pods)
        except OSError as exc:
            # Like a container whose entrypoint is missing: it fails to start (exit 128).
            self._record_exit(c, Terminated(128, "StartError", now, now, f"{type(exc).__name__}: {exc}"), now)
            log.warning("Pod %s: container %s failed to start: %s", self.key, c.name, exc)
            return
        if c.pending_restart:
            c.restart_count += 1
            c.pending_restart = False
        c.process, c.running_since, c.env, c.stop_deadline = process, now, env, None
        c.waiting_reason, c.waiting_message = "ContainerCreating", ""
        c.container_id = f"batchtune://{self.uid}-{c.name}-{c.restart_count}"
        self._make_probes(c, now)
        self.store.set_process(self.uid, c.name, {
            "pid": process.pid, "ticks": process.ticks, "startedAt": now, "containerID": c.container_id,
        })
        log.info("Pod %s: container %s started as pid %d: %s", self.key, c.name, process.pid, " ".join(argv))
        self._event(c, "Normal", "Started", f"Started container {c.name}")

    def _waiting(self, c: ContainerRuntime, now: float, reason: str, message: str) -> None:
        if (c.waiting_reason, c.waiting_message) != (reason, message):
            log.warning("Pod %s: container %s is waiting (%s): %s", self.key, c.name, reason, message)
            self._event(c, "Warning", "Failed", f"Error: {reason}: {message}")
        c.waiting_reason, c.waiting_message = reason, message
        c.next_start_at = now + CONFIG_RETRY_S

    def _make_probes(self, c: ContainerRuntime, started_at: float, already_running: bool = False) -> None:
        c.probes = {}
        for kind, key in ((ProbeKind.STARTUP, "startupProbe"), (ProbeKind.READINESS, "readinessProbe"),
                          (ProbeKind.LIVENESS, "livenessProbe")):
            if c.init or not c.spec.get(key):
                continue
            spec = ProbeSpec.from_spec(c.spec[key], self.settings.time_scale)
            tracker = ProbeTracker(kind, spec, started_at)
            if already_running and kind is ProbeKind.STARTUP:
                tracker.result = True  # an adopted container had started; re-running startup would be noise
            c.probes[kind] = tracker

    def _probe_step(self, c: ContainerRuntime, now: float) -> None:
        assert self.record is not None
        startup = c.probes.get(ProbeKind.STARTUP)
        order = [ProbeKind.STARTUP] if startup is not None and not startup.result else [ProbeKind.LIVENESS, ProbeKind.READINESS]
        for kind in order:
            tracker = c.probes.get(kind)
            if tracker is None or not tracker.due(now):
                continue
            ok, message = run_probe(tracker.spec, pod_ip=self.record["ip"], container=c.spec, env=c.env, cwd=str(self.pod_dir))
            before = tracker.result
            after = tracker.record(ok, self.clock(), message)
            if before != after:
                log.info("Pod %s: container %s %s probe turned %s%s", self.key, c.name, kind.value,
                         "successful" if after else "failing", f" ({message})" if message else "")
            if not ok and tracker.failures == 1:  # once per failing streak: events are API writes
                self._event(c, "Warning", "Unhealthy", f"{kind.value.capitalize()} probe failed: {message}")
            if kind in (ProbeKind.STARTUP, ProbeKind.LIVENESS) and not ok and tracker.failed_out:
                log.warning("Pod %s: container %s failed its %s probe %d times; killing it",
                            self.key, c.name, kind.value, tracker.failures)
                self._event(c, "Normal", "Killing",
                            f"Container {c.name} failed {kind.value} probe, will be restarted")
                self._signal_stop(c, now, self._grace(c, probe=c.spec.get(f"{kind.value}Probe")))
                return

    def _grace(self, c: ContainerRuntime | None = None, probe: Mapping[str, Any] | None = None) -> float:
        pod = self.pod
        if probe and probe.get("terminationGracePeriodSeconds") is not None:
            return float(probe["terminationGracePeriodSeconds"])
        meta_grace = pod["metadata"].get("deletionGracePeriodSeconds")
        if pod["metadata"].get("deletionTimestamp") and meta_grace is not None:
            return float(meta_grace)
        spec_grace = (pod.get("spec") or {}).get("terminationGracePeriodSeconds")
        return float(30 if spec_grace is None else spec_grace)

    def _signal_stop(self, c: ContainerRuntime, now: float, grace: float) -> None:
        if c.process is None or c.stop_deadline is not None:
            return
        c.stop_deadline = now + grace
        c.process.signal(signal.SIGTERM if grace > 0 else signal.SIGKILL)

    def _on_exit(self, c: ContainerRuntime, code: int, now: float) -> None:
        assert c.process is not None
        killed = c.process.killed_by_agent
        started = c.running_since or now
        if code == EXIT_UNKNOWN:
            term = Terminated(137, "ContainerStatusUnknown", started, now,
                              "The adopted process ended; its exit status is unknown", container_id=c.container_id)
        else:
            exit_code, reason, sig = termination_reason(code, killed)
            term_file = Path(c.env.get("BATCHTUNE_TERMINATION_MESSAGE_PATH", "/nonexistent"))
            file_text = term_file.read_bytes()[:4096] if term_file.is_file() else None
            log_tail = self._log_tail(c)
            policy = str(c.spec.get("terminationMessagePolicy") or "File")
            term = Terminated(exit_code, reason, started, now, termination_message(file_text, log_tail, exit_code, policy),
                              signal=sig, container_id=c.container_id)
        log.info("Pod %s: container %s exited with code %d (%s)", self.key, c.name, term.exit_code, term.reason)
        c.process = None
        c.stop_deadline = None
        c.probes = {}
        self.store.set_process(self.uid, c.name, None)
        self._record_exit(c, term, now)

    def _record_exit(self, c: ContainerRuntime, term: Terminated, now: float) -> None:
        if now - term.started_at > 2 * MAX_BACKOFF_S / self.settings.time_scale:
            c.crashes = 0  # ran long enough: the back-off starts over, as in the kubelet
        if self._wants_restart(c, term.exit_code) and not self.pod["metadata"].get("deletionTimestamp"):
            c.crashes += 1
            c.last_terminated, c.terminated, c.pending_restart = term, None, True
            c.next_start_at = now + backoff_s(c.crashes, self.settings.time_scale)
            if c.next_start_at > now:
                self._event(c, "Warning", "BackOff", f"Back-off restarting failed container {c.name} in pod "
                            f"{self.pod['metadata']['name']}_{self.pod['metadata']['namespace']}({self.uid})")
        else:
            c.terminated = term

    def _log_tail(self, c: ContainerRuntime) -> bytes | None:
        path = self.log_dir / f"{c.name}.log"
        try:
            with open(path, "rb") as fh:
                size = fh.seek(0, os.SEEK_END)
                start = max(c.log_offset, size - 16 * 1024)
                fh.seek(start)
                return fh.read()
        except OSError:
            return None

    # ---- environment ---------------------------------------------------------------------------
    def _env_for(self, c: ContainerRuntime) -> tuple[list[str], dict[str, str]]:
        assert self.record is not None
        pod = self.pod
        gpus = self.record["gpus"].get(c.name, [])
        container_env = resolve_env(
            pod, c.spec, PodNetwork(self.record["ip"], self.settings.host_ip),
            config_map=self.api.config_map, secret=self.api.secret, node_allocatable=self.settings.allocatable,
        )
        # emptyDir volumes are per-pod directories; the container's own paths under a mount point there.
        mounts = empty_dir_mounts(pod.get("spec") or {}, c.spec, self.pod_dir / "volumes")
        ensure_dirs(mounts)
        container_env = {k: rewrite_path(v, mounts) for k, v in container_env.items()}
        files = self.pod_dir / ".batchtune"
        env: dict[str, str] = {"PYTHONUNBUFFERED": "1"}
        env.update(self.settings.base_env)
        env["HOSTNAME"] = str(pod["metadata"]["name"])
        env.update(container_env)
        env.update({
            "BATCHTUNE_POD_IP": self.record["ip"],
            "BATCHTUNE_POD_NAME": str(pod["metadata"]["name"]),
            "BATCHTUNE_POD_NAMESPACE": str(pod["metadata"]["namespace"]),
            "BATCHTUNE_NODE_NAME": self.settings.node,
            "BATCHTUNE_GPU_PRODUCT": self.settings.gpu_product,
            "BATCHTUNE_GPU_COUNT": str(len(gpus)),
            "BATCHTUNE_GPU_ACTIVITY_FILE": str(files / f"{c.name}.gpu-activity.json"),
            "BATCHTUNE_TIME_SCALE": repr(self.settings.time_scale),
            "BATCHTUNE_TERMINATION_MESSAGE_PATH": str(files / f"{c.name}.termination-log"),
        })
        if "KUBECONFIG" not in env:
            # No in-cluster mount here: the pod's ServiceAccount identity comes as a kubeconfig file.
            kubeconfig = getattr(self.api, "service_account_kubeconfig", lambda _pod: None)(pod)
            if kubeconfig:
                path = files / "kubeconfig"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(kubeconfig)
                path.chmod(0o600)
                env["KUBECONFIG"] = str(path)
        if gpus:
            env["NVIDIA_VISIBLE_DEVICES"] = ",".join(str(i) for i in gpus)
        else:
            env.pop("NVIDIA_VISIBLE_DEVICES", None)
        # Kubernetes expands $(VAR) in command and args with the container's environment.
        expanded = dict(c.spec)
        for key in ("command", "args"):
            if expanded.get(key):
                # The program itself comes from the image (here: the host, e.g. a venv under /tmp), never the volume.
                expanded[key] = [expand(str(word), env) if key == "command" and i == 0 else
                                 rewrite_path(expand(str(word), env), mounts) for i, word in enumerate(expanded[key])]
        argv = self.settings.image_map.argv_for(expanded)
        return argv, env

    # ---- status --------------------------------------------------------------------------------
    def _report(self, now: float, pod: dict[str, Any], init_done: bool = True, init_failed: bool = False) -> None:
        # Conditions we manage come from what we last sent (the watch may lag); others from the API.
        api_conditions = [c for c in (pod.get("status") or {}).get("conditions") or []
                          if c.get("type") not in MANAGED_CONDITIONS]
        mine = [c for c in (self.last_sent or {}).get("conditions") or [] if c.get("type") in MANAGED_CONDITIONS]
        if not mine:
            mine = [c for c in (pod.get("status") or {}).get("conditions") or [] if c.get("type") in MANAGED_CONDITIONS]
        merged = dict(pod)
        merged["status"] = dict(pod.get("status") or {}, conditions=api_conditions + mine)
        ip = self.record["ip"] if self.record else self.settings.host_ip
        status = build_pod_status(
            pod=merged,
            containers=[c.view(now, pod["metadata"]["name"]) for c in self.containers],
            init_containers=[c.view(now, pod["metadata"]["name"]) for c in self.init_containers],
            pod_ip=ip,
            host_ip=self.settings.host_ip,
            start_time=float(self.record["startTime"]) if self.record else now,
            now=now,
            initialized=init_done,
            init_failed=init_failed,
            pod_reason="UnexpectedAdmissionError" if self.admission_error else "",
            pod_message=self.admission_error,
        )
        # Conditions owned by others (PodScheduled, DisruptionTarget, readiness gates) are kept.
        others = [c for c in api_conditions if c.get("type") != "PodScheduled"]
        status["conditions"] = status["conditions"] + others
        if status["phase"] in ("Succeeded", "Failed") and not self.terminal:
            # Free the GPUs before the scheduler can learn of the end and bind a new pod to them.
            self.store.release_gpus(self.uid)
        if status != self.last_sent:
            try:
                self.api.patch_status(pod["metadata"]["namespace"], pod["metadata"]["name"], status)
            except Exception as exc:  # retried on the next tick; logged once per distinct error
                if str(exc) != self._last_error:
                    log.warning("Pod %s: status update failed: %s", self.key, exc)
                    self._last_error = str(exc)
                return
            self._last_error = ""
            if (self.last_sent or {}).get("phase") != status["phase"]:
                log.info("Pod %s turned %s", self.key, status["phase"])
            self.last_sent = status
        if status["phase"] in ("Succeeded", "Failed") and not self.terminal:
            self.terminal = True
            self.store.release_gpus(self.uid)

    # ---- stopping ------------------------------------------------------------------------------
    def _all(self) -> list[ContainerRuntime]:
        return self.init_containers + self.containers

    def _stop_all(self, now: float, grace_cap: float, wait: bool) -> None:
        grace = min(self._grace(), grace_cap)
        for c in self._all():
            self._signal_stop(c, now, grace)
        if not wait:
            return
        deadline = time.monotonic() + grace
        for c in self._all():
            if c.process is None:
                continue
            if c.process.wait(max(0.0, deadline - time.monotonic())) is None:
                c.process.signal(signal.SIGKILL)
                c.process.wait(5.0)
            log.info("Pod %s: container %s was stopped", self.key, c.name)
            c.process = None
            self.store.set_process(self.uid, c.name, None)

    def _delete_step(self, now: float, pod: dict[str, Any]) -> None:
        """Graceful deletion: SIGTERM, the grace period, SIGKILL, then the kubelet's final delete."""
        running = [c for c in self._all() if c.process is not None]
        for c in running:
            if c.stop_deadline is None:
                log.info("Pod %s: container %s got SIGTERM (grace %gs)", self.key, c.name, self._grace())
                self._event(c, "Normal", "Killing", f"Stopping container {c.name}")
            self._signal_stop(c, now, self._grace())
            code = c.process.poll() if c.process else None
            if code is not None:
                log.info("Pod %s: container %s ended with code %d", self.key, c.name, code)
                c.process = None
                self.store.set_process(self.uid, c.name, None)
            elif c.stop_deadline is not None and now >= c.stop_deadline:
                c.process.signal(signal.SIGKILL)
        if any(c.process is not None for c in self._all()):
            return
        meta = pod["metadata"]
        try:
            self.api.delete_pod(meta["namespace"], meta["name"], self.uid)
        except Exception as exc:
            log.warning("Pod %s: final delete failed, will retry: %s", self.key, exc)
            return
        log.info("Pod %s was deleted", self.key)
        self._finish()

    def _finish(self) -> None:
        for c in self._all():
            if c.process is not None:
                c.process.signal(signal.SIGKILL)
        self.store.forget(self.uid)
        shutil.rmtree(self.pod_dir, ignore_errors=True)  # the working dir; logs stay
        self.done = True

    def _event(self, c: ContainerRuntime, kind: str, reason: str, message: str) -> None:
        try:
            self.api.event(self.pod, c.name, kind, reason, message)
        except Exception as exc:  # events are best effort, as in the kubelet
            log.debug("Pod %s: event %s was not recorded: %s", self.key, reason, exc)

    # ---- what the metrics need -----------------------------------------------------------------
    def activity_file(self, container: str) -> str:
        return str(self.pod_dir / ".batchtune" / f"{container}.gpu-activity.json")
