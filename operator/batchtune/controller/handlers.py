"""kopf wiring: indexes fed by watches, one timer per BatchTuning that takes the next step, a finalizer.

Run with `batchtune operator` (it sets the environment this module reads at import: kopf fixes a
timer's interval and the set of watched resources when the decorators run).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any, TypeVar

import kopf

from batchtune import API_GROUP, API_VERSION, PLURAL
from batchtune.api import InvalidBatchTuning, parse_spec
from batchtune.controller import kube, retune, telemetry
from batchtune.controller import status as status_io
from batchtune.controller.guidance import TwinWorker
from batchtune.controller.kube import Indexes, KubeCluster, owner_uid, pod_digest
from batchtune.controller.ports import Cluster, Install, Ports
from batchtune.controller.reconcile import Outcome, on_delete, reconcile_outcome
from batchtune.controller.reports import ReportQueue
from batchtune.controller.tick import Tuning
from batchtune.core.gpus import is_accelerator, pod_gpus
from batchtune.core.install import install_from_environment
from batchtune.core.manifests import (
    COMPONENT_LOAD,
    LABEL_COMPONENT,
    LABEL_MANAGED_BY,
    LABEL_TRIAL,
    LABEL_TUNING,
    MANAGED_BY,
    label_value,
)
from batchtune.core.ownership import controller_owner
from batchtune.core.pods import job_outcome, load_pod_succeeded
from batchtune.core.policy import UrlCheck
from batchtune.core.vocabulary import Phase, TrialState
from batchtune.engines import ENGINES
from batchtune.prometheus import PrometheusReader

T = TypeVar("T")
TICK_SECONDS = float(os.environ.get("BATCHTUNE_TICK_SECONDS", "2"))
# Nodes and every namespace's GPU pods are watched only by a cluster-wide install (a namespaced one
# cannot list them; then GPU accounting is left to the scheduler).
CLUSTERWIDE = os.environ.get("BATCHTUNE_CLUSTERWIDE", "true") == "true"
OURS = {LABEL_MANAGED_BY: MANAGED_BY}


def install_from_env() -> Install:
    from batchtune import __version__

    return install_from_environment(os.environ, __version__)


class PrometheusMetrics:
    """`ports.Metrics`: a reader per BatchTuning and tick; each BatchTuning's readers share one gate, so its
    queries hold at most one worker at a time (a second one fails at once, the tick retries later)."""

    def __init__(self) -> None:
        self._gates: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()

    def gate(self, owner: str) -> threading.Lock:
        with self._lock:
            if len(self._gates) > 4096:  # bounded: owners are BatchTuning uids; drop the idle ones
                self._gates = {k: g for k, g in self._gates.items() if g.locked()}
            return self._gates.setdefault(owner, threading.Lock())

    def reader(self, url: UrlCheck, token: str | None, ctx: Any, engine: Any, owner: str) -> PrometheusReader:
        assert url.endpoint is not None
        return PrometheusReader(url.endpoint.url, ctx, token=token, loopback_allowed=url.loopback_allowed,
                                gate=self.gate(owner), on_query=telemetry.PROMETHEUS_QUERIES.inc,
                                on_error=telemetry.PROMETHEUS_ERRORS.inc,
                                finished_reason_label=engine.metrics.finished_reason_label,
                                error_reasons=engine.metrics.error_finish_reasons,
                                http_errors=http_errors(engine.metrics))


def http_errors(conventions: Any) -> Any:
    from batchtune.core.promql import HttpErrors

    if not conventions.http_requests:
        return None
    return HttpErrors(conventions.http_requests, conventions.http_status_label, conventions.http_error_statuses,
                      conventions.http_handler_label, conventions.inference_handlers)


TICK_LAZY_IMPORTS = ("batchtune.twin.prefilter", "batchtune.twin.guide", "batchtune.twin.fit", "batchtune.twin.steady",
                     "batchtune.controller.gitremote", "batchtune.controller.forge", "batchtune.core.gitwrite")
"""What a tick imports on first use (the twin's numpy models, the Git client); the report's matplotlib is not here:
it is imported by the report worker, off the tick, and costs memory a standby need not hold."""


def warm_up() -> None:
    """Import what a tick would import on first use: a standby does it while it waits, so the first tick of a
    takeover does not (on a starved CPU those imports took seconds of the takeover)."""
    import importlib

    for module in TICK_LAZY_IMPORTS:
        importlib.import_module(module)


INSTALL = install_from_env()
REPORTS = ReportQueue()
TWIN = TwinWorker()
METRICS = PrometheusMetrics()


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, logger: kopf.Logger, **_: Any) -> None:
    # Our finalizer and bookkeeping annotations live under our own domain, not kopf's defaults.
    settings.persistence.finalizer = "batchtune.io/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="batchtune.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="batchtune.io", key="last-handled-configuration")
    # Our own Events are explicit and on transitions; kopf posts only its warnings and errors.
    settings.posting.level = logging.WARNING
    # Long watches with a client-side timeout, so a silently broken stream is noticed.
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.networking.request_timeout = 30
    # Reconcile steps call blocking clients; enough threads for many BatchTunings at once.
    settings.execution.max_workers = int(os.environ.get("BATCHTUNE_WORKERS", "16"))
    global WORKERS
    WORKERS = settings.execution.executor
    kube.load_config()
    logger.info("Configured the operator (tick %.1fs, %s)", TICK_SECONDS,
                "cluster-wide" if CLUSTERWIDE else "namespaced")


def api_connection_limit() -> int:
    """Connections kopf may hold to the API server at once: every watch stream holds one for as long as it runs
    (BatchTunings, Deployments, Jobs and pods per watched namespace; nodes, namespaces and CRDs cluster-wide), and
    the rest carry status patches, finalizers and Events. kopf's own default is no limit: 100 BatchTunings arriving
    at once opened ~600 TLS connections, each with its own TLS buffers, and that burst set the operator's peak RSS
    (docs/benchmarks.md). Over the limit a request waits for a free connection."""
    if os.environ.get("BATCHTUNE_API_CONNECTIONS"):
        return max(8, int(os.environ["BATCHTUNE_API_CONNECTIONS"]))
    watches = 8 if CLUSTERWIDE else 4 * max(1, int(os.environ.get("BATCHTUNE_WATCHED_NAMESPACES", "1"))) + 2
    return watches + 24


@kopf.on.login()
async def login(**kwargs: Any) -> Any:
    """kopf's own login (the kubeconfig, or the in-cluster ServiceAccount), over a session with a bounded pool."""
    import aiohttp

    info = kopf.login_via_client(**kwargs)
    if info is None:
        return None
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=api_connection_limit(), ssl=info.as_ssl_context()),
        headers=info.as_http_headers(), proxy=info.proxy_url, trust_env=info.trust_env)
    return kopf.AiohttpSession(aiohttp_session=session, server=info.server, default_namespace=info.default_namespace,
                               expiration=info.expiration, priority=info.priority)


# ---- indexes ----------------------------------------------------------------------------------


@kopf.index("apps", "v1", "deployments", labels=OURS)
def owned_deployments(namespace: str | None, name: str, meta: kopf.Meta, **_: Any) -> Any:
    uid = owner_uid(meta)
    return {(namespace, uid): {"name": name, "uid": meta.get("uid")}} if uid else None


@kopf.index("apps", "v1", "deployments")
def deployment_versions(namespace: str | None, name: str, meta: kopf.Meta, **_: Any) -> Any:
    # Every Deployment's resourceVersion (kopf watches them all already, owned or not): a target is read again
    # only when it moved (kube.DeploymentCache), not on every tick.
    return {(namespace, name): meta.get("resourceVersion")}


class LoadRunEnds:
    """For each BatchTuning whose timer run waits for a load run to end, the signal that one of its load runs
    ended: its load pod succeeded, as the pod watch saw it (`batchtune_pods`), or its Job finished, as the Job watch
    saw it (`owned_jobs`): the run reconciles then rather than on the timer's next run. The pod's end comes first (the
    Job controller marks the Job Complete after it, through its own queue), and the reconcile reads the run from the
    pod (`core.pods.load_run_outcome`). A pod is traced to its BatchTuning through its controller, the Job (by uid),
    and that Job's owner, as the Job watch saw it (`owns`). Only the event loop touches it (the indexes and the timer
    are async)."""

    JOBS_KEPT = 4096
    """A bound on the Jobs remembered (a Job is forgotten once its pod succeeded or the Job finished, or when over the
    bound, oldest first: the operator deletes a Job it has read, often before the Job controller marks it Complete)."""

    def __init__(self) -> None:
        self._listening: dict[str, asyncio.Event] = {}
        self._owners: dict[str, str] = {}
        """Job uid -> the uid of the BatchTuning that owns it, for the Jobs not finished yet."""

    def owns(self, job_uid: str, tuning_uid: str, finished: bool) -> None:
        """The Job watch saw a load Job of this BatchTuning (finished or not)."""
        if finished:
            self._owners.pop(job_uid, None)
            self.ended(tuning_uid)
            return
        self._owners[job_uid] = tuning_uid
        while len(self._owners) > self.JOBS_KEPT:
            del self._owners[next(iter(self._owners))]

    def pod_ended(self, job_uid: str) -> None:
        """A pod controlled by this Job succeeded: its BatchTuning's load run ended (unknown Jobs are ignored)."""
        owner = self._owners.pop(job_uid, None)
        if owner is not None:
            self.ended(owner)

    def listen(self, uid: str) -> asyncio.Event:
        """A fresh signal for this timer run: a Job that ends from now on sets it."""
        event = self._listening[uid] = asyncio.Event()
        return event

    def ended(self, uid: str) -> None:
        event = self._listening.get(uid)
        if event is not None:
            event.set()

    def release(self, uid: str, event: asyncio.Event) -> None:
        if self._listening.get(uid) is event:
            del self._listening[uid]


LOAD_RUN_ENDS = LoadRunEnds()


@kopf.index("batch", "v1", "jobs", labels=OURS)
async def owned_jobs(namespace: str | None, name: str, meta: kopf.Meta, status: kopf.Status, **_: Any) -> Any:
    # Async: kopf runs a synchronous index function in its worker pool, where it queued behind the reconciles.
    uid = owner_uid(meta)
    if uid and meta.get("uid"):
        LOAD_RUN_ENDS.owns(str(meta["uid"]), uid, job_outcome(status)[0])
    return {(namespace, uid): {"name": name, "uid": meta.get("uid"), "status": dict(status)}} if uid else None


@kopf.index("v1", "pods", labels=OURS)
async def batchtune_pods(namespace: str | None, body: kopf.Body, labels: kopf.Labels, **_: Any) -> Any:
    # Async, as `owned_jobs`: a load pod's end wakes its BatchTuning's timer without queueing behind the reconciles.
    digest = pod_digest(body)
    if labels.get(LABEL_COMPONENT) == COMPONENT_LOAD:
        job = labels.get("batch.kubernetes.io/job-name") or labels.get("job-name")
        owner = controller_owner(digest)
        if owner is not None and owner.kind == "Job" and owner.uid and load_pod_succeeded(digest) is not None:
            LOAD_RUN_ENDS.pod_ended(owner.uid)
        return {(namespace, "job", job): digest} if job else None
    return {(namespace, labels.get(LABEL_TUNING), labels.get(LABEL_TRIAL), labels.get(LABEL_COMPONENT)): digest}


if CLUSTERWIDE:
    @kopf.index("v1", "pods")
    def gpu_pods(body: kopf.Body, **_: Any) -> Any:
        digest = pod_digest(body)
        return {"all": digest} if pod_gpus(digest) else None

    @kopf.index("v1", "nodes")
    def nodes(name: str, labels: kopf.Labels, status: kopf.Status, **_: Any) -> Any:
        allocatable = (status.get("allocatable") or {})
        # Every accelerator resource (nvidia.com/gpu, MIG slices, amd.com/gpu, ...): trials are fitted per resource.
        return {"all": {"metadata": {"name": name, "labels": dict(labels)},
                        "status": {"allocatable": {k: v for k, v in allocatable.items() if is_accelerator(str(k))}}}}


@kopf.index(API_GROUP, API_VERSION, PLURAL)
def tuning_intents(namespace: str | None, name: str, uid: str, status: kopf.Status, **_: Any) -> Any:
    # Trials a BatchTuning decided to start (Deploying): until their pods exist they hold no GPU yet.
    intents = [{"namespace": namespace, "tuning": label_value(name), "index": t.get("index"), "gpus": t.get("gpus", 0)}
               for t in status.get("trials") or [] if t.get("state") == TrialState.DEPLOYING and t.get("gpus")]
    return {uid: intents} if intents else None


def _indexes(kwargs: dict[str, Any]) -> Indexes:
    return Indexes(kwargs["owned_deployments"], kwargs["owned_jobs"], kwargs["batchtune_pods"],
                   kwargs.get("gpu_pods"), kwargs.get("nodes"), kwargs.get("tuning_intents"),
                   kwargs.get("deployment_versions"))


def ports(kwargs: dict[str, Any]) -> Ports:
    return Ports(KubeCluster(_indexes(kwargs), INSTALL.secret_label), METRICS, REPORTS, INSTALL, ENGINES, TWIN)


def tuning(body: Mapping[str, Any]) -> Tuning:
    meta = body["metadata"]
    return Tuning(meta["name"], meta["namespace"], meta["uid"], int(meta.get("generation") or 0),
                  dict(body.get("spec") or {}), dict(body.get("status") or {}))


# ---- the loop ---------------------------------------------------------------------------------

EXPORTED_VERSIONS: dict[tuple[str, str], str] = {}
"""The resourceVersion each BatchTuning's decision gauges were last set from (parsed again only when it changes)."""


def export_decision(body: Mapping[str, Any]) -> None:
    """The decision gauges (`telemetry.export_decision`) from the BatchTuning as read, terminal ones included."""
    meta = body["metadata"]
    key = (str(meta["namespace"]), str(meta["name"]))
    version = str(meta.get("resourceVersion") or "")
    if version and EXPORTED_VERSIONS.get(key) == version:
        return
    try:
        spec = parse_spec(dict(body.get("spec") or {}))
    except InvalidBatchTuning:
        spec = None
    telemetry.export_decision(*key, spec, status_io.load(body.get("status")))
    EXPORTED_VERSIONS[key] = version



WAKES_PER_RUN = 4
"""How many times one timer run may wake for a step that became possible at a known moment (a bound: each wake is a
full reconcile)."""
END_WAITS_PER_RUN = 30
"""How many ticks one timer run may wait for a load run that is going to end, reconciling after each (a minute at the
chart's 2 s tick: a bound, not a cost; each reconcile is the one the timer's next run would have made)."""


def wake_delay(wake_at: datetime | None, now: datetime, horizon_seconds: float) -> float | None:
    """Seconds to wait for `wake_at` when it comes sooner than `horizon_seconds` from `now` (the timer's own next run);
    None when there is nothing to wake for or the timer comes first."""
    if wake_at is None:
        return None
    delay = (wake_at - now).total_seconds()
    return max(0.0, delay) if delay < horizon_seconds else None


@kopf.timer(API_GROUP, API_VERSION, PLURAL, interval=TICK_SECONDS, id="reconcile")
async def tick(body: kopf.Body, patch: kopf.Patch, logger: kopf.Logger, stopped: Any = None, **kwargs: Any) -> None:
    """The timer: one reconcile in a worker thread; when it changed nothing but waits for a step that becomes possible
    before the timer's next run, it waits here, holding no worker, and reconciles again: for a known moment (a load
    run's window complete in Prometheus), or for a load run still going to end (its pod's success or its Job's end,
    seen by the pod and Job watches, `LoadRunEnds`). A load run that does not end within a tick gets the reconcile the
    timer's next run would have made, taken here, and the run goes on waiting for its end (up to `END_WAITS_PER_RUN`
    ticks): an end that comes between two of the timer's runs is not left waiting for the next one. The verdict
    is written when its data is complete, not up to a tick later. kopf counts the interval from the end of a run, so a
    run reconciles at least once a tick, as the timer would; each reconcile after a wait decides on kopf's body as it
    is then (it is live: a change to the BatchTuning meanwhile is seen, `tick_current`)."""
    uid = body["metadata"]["uid"]
    ended = LOAD_RUN_ENDS.listen(uid)
    try:
        current, outcome = await in_worker(tick_current, body, logger, kwargs)
        wakes = end_waits = 0
        while outcome is not None and not outcome.patch:
            delay = wake_delay(outcome.wake_at, datetime.now(UTC), TICK_SECONDS)
            pool: concurrent.futures.Executor | None = WAKE_WORKERS
            if delay is not None and wakes < WAKES_PER_RUN:
                wakes += 1
                await wait_for(delay, stopped)
            elif delay is None and outcome.load_run_going and end_waits < END_WAITS_PER_RUN:
                end_waits += 1
                if not await wait_for(TICK_SECONDS, stopped, ended):
                    pool = WORKERS  # no end within a tick: the timer's next run, taken here
            else:
                break
            if stopped:
                return
            ended.clear()
            current, outcome = await in_worker(tick_current, body, logger, kwargs, pool=pool)
    finally:
        LOAD_RUN_ENDS.release(uid, ended)
    for key, value in (outcome.patch if outcome else {}).items():
        patch.status[key] = value
    if outcome is not None and outcome.patch and current is not None:
        WRITTEN.wrote(uid, version(body), version(current))


async def wait_for(seconds: float, stopped: Any = None, event: asyncio.Event | None = None) -> bool:
    """Wait `seconds`, or less when `event` comes or kopf stops the timer (`stopped`); True when the event came."""
    waits = [asyncio.ensure_future(w) for w in (stopped.wait() if stopped is not None else None,
                                                event.wait() if event is not None else None) if w is not None]
    try:
        if waits:
            await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        else:
            await asyncio.sleep(seconds)
    finally:
        for waiting in waits:
            waiting.cancel()
    return event is not None and event.is_set()


def version(body: Mapping[str, Any]) -> str | None:
    return (body.get("metadata") or {}).get("resourceVersion")


class WrittenVersions:
    """For each BatchTuning (by uid), the resourceVersions its last status write followed: a body at one of them
    does not hold that write yet.

    kopf refreshes a timer's body only from watch events, and kopf writes a run's status patch after the run, so on a
    loaded control plane the next run (a tick later) can be handed the object from before the write: deciding on it
    repeated the write's step (a trial concluded twice, with a second verdict, `finishedAt` and TrialCompleted Event;
    docs/benchmarks.md, "Operator scale"). Such a body is read again from the API server instead."""

    def __init__(self) -> None:
        self._before: dict[str, frozenset[str]] = {}
        self._lock = threading.Lock()

    def wrote(self, uid: str, *versions: str | None) -> None:
        """A run decided on the object at these versions (kopf's body, the one read again) and wrote status."""
        with self._lock:
            self._before[uid] = frozenset(v for v in versions if v)

    def precedes_write(self, uid: str, version: str | None) -> bool:
        with self._lock:
            return version is not None and version in self._before.get(uid, ())

    def forget(self, uid: str) -> None:
        with self._lock:
            self._before.pop(uid, None)


WRITTEN = WrittenVersions()


def current_body(body: Mapping[str, Any], logger: kopf.Logger, cluster: Cluster) -> Mapping[str, Any] | None:
    """The BatchTuning to decide on: kopf's body, or the object read again when kopf's predates this process's last
    status write to it (`WrittenVersions`); None when it is gone or cannot be read now (the next run tries again:
    deciding on the older body could repeat a step)."""
    meta = body["metadata"]
    uid = meta["uid"]
    if not WRITTEN.precedes_write(uid, version(body)):
        WRITTEN.forget(uid)  # the watch brought the write (or a later object): kopf's body is current
        return body
    try:
        fresh = cluster.batchtuning(meta["namespace"], meta["name"])
    except Exception as exc:  # noqa: BLE001 - any failure to read: skip this run, never decide on the old body
        logger.warning("Skipped a run of tuning %s: its last status write was not in the watch yet and reading it "
                       "again failed: %s", meta["name"], exc)
        return None
    if fresh is not None and WRITTEN.precedes_write(uid, version(fresh)):
        WRITTEN.forget(uid)  # the object did not change since: the write never landed, and this is what holds
    return fresh


def tick_current(body: kopf.Body, logger: kopf.Logger, kwargs: dict[str, Any]) \
        -> tuple[Mapping[str, Any] | None, Outcome | None]:
    """The body decided on (`current_body`) and one reconcile of it (`tick_once`)."""
    current = current_body(body, logger, ports(kwargs).cluster)
    return current, (tick_once(current, logger, kwargs) if current is not None else None)


def tick_once(body: Mapping[str, Any], logger: kopf.Logger, kwargs: dict[str, Any]) -> Outcome | None:
    """One reconcile of the BatchTuning as last seen (`current_body`); None: nothing to do."""
    status = body.get("status") or {}
    export_decision(body)
    terminal = status.get("phase") in {p.value for p in Phase if p.terminal} and \
        status.get("observedGeneration") == body["metadata"].get("generation")
    the_ports = ports(kwargs)
    now = datetime.now(UTC)
    if terminal and not retune.watch_due(body.get("spec") or {}, status, now) \
            and not the_ports.cluster.owned(body["metadata"]["namespace"], body["metadata"]["uid"]).deployments \
            and not the_ports.cluster.owned(body["metadata"]["namespace"], body["metadata"]["uid"]).jobs:
        return None  # nothing left to do, to clean up or to watch yet
    started = time.perf_counter()
    try:
        return reconcile_outcome(tuning(body), the_ports, now, logger)
    finally:
        telemetry.RECONCILE_SECONDS.observe(time.perf_counter() - started)


WORKERS: concurrent.futures.Executor | None = None
"""kopf's own pool for synchronous handlers (`configure`), so the timers' reconciles share its bound of threads."""
WAKE_WORKERS = concurrent.futures.ThreadPoolExecutor(int(os.environ.get("BATCHTUNE_WAKE_WORKERS", "2")),
                                                     thread_name_prefix="batchtune-wake")
"""The woken reconciles' own few threads (made on first use): a verdict whose data just became complete does not
queue behind the routine ticks of every other BatchTuning in `WORKERS`. One tuning's runs stay one at a time: a wake
is inside its timer run."""


async def in_worker(fn: Callable[..., T], *args: Any, pool: concurrent.futures.Executor | None = None) -> T:
    """`fn(*args)` in a worker thread as kopf runs a synchronous handler: in `pool` (kopf's, `WORKERS`, unless
    given), with the handler's context (`kopf.event` needs it), and not abandoned when the run is cancelled (the thread
    finishes first)."""
    context = contextvars.copy_context()
    future = asyncio.get_running_loop().run_in_executor(pool or WORKERS, functools.partial(context.run, fn, *args))
    cancelled: asyncio.CancelledError | None = None
    while not future.done():
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError as exc:
            cancelled = exc
    if cancelled is not None:
        raise cancelled
    return future.result()


@kopf.on.delete(API_GROUP, API_VERSION, PLURAL, id="cleanup")
def cleanup(body: kopf.Body, logger: kopf.Logger, **kwargs: Any) -> None:
    from batchtune.controller.ports import Conflict

    EXPORTED_VERSIONS.pop((body["metadata"]["namespace"], body["metadata"]["name"]), None)
    WRITTEN.forget(body["metadata"]["uid"])
    telemetry.forget(body["metadata"]["namespace"], body["metadata"]["name"])
    try:
        on_delete(tuning(body), ports(kwargs), datetime.now(UTC), logger)
    except Conflict as exc:
        raise kopf.TemporaryError(f"production changed while restoring it: {exc}", delay=2) from None
