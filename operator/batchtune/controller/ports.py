"""What the reconcile loop asks of the world: Kubernetes, Prometheus, the report renderer, the install.

The loop (`reconcile.py`) only sequences these and the core's decisions. `kube.py` and
`prometheus.py` implement them for a real cluster; the unit tests implement them in memory.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from batchtune.core.install import Install as Install  # the install's bounds live in the core (validate reads them too)
from batchtune.core.measurement import Window
from batchtune.core.policy import UrlCheck
from batchtune.core.promql import QueryContext
from batchtune.core.scrape import ScrapeInterval
from batchtune.core.workload import WorkloadObservation
from batchtune.engines import Engine
from batchtune.prometheus import Production


class Conflict(Exception):
    """The object changed since it was read (HTTP 409 on a precondition): read again, decide again."""


class NotAllowed(Exception):
    """The install does not allow what the spec asks (an image, a URL, a Secret)."""


@dataclass(frozen=True)
class JobRun:
    """A load Job as the loop needs it."""

    finished: bool
    failed: bool
    started: datetime | None = None
    ended: datetime | None = None
    pods: tuple[Mapping[str, Any], ...] = ()
    """The pods labelled as its own (digests with ownerReferences): only those it controls are its
    (`core.pods.load_message`)."""


@dataclass(frozen=True)
class Owned:
    """The Deployments and Jobs a BatchTuning owns, by name (each with its `uid`)."""

    deployments: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    jobs: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)


class Cluster(Protocol):
    def deployment(self, namespace: str, name: str) -> dict[str, Any] | None: ...

    def batchtuning(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The BatchTuning as the API server holds it now (read, not the watch's copy); None when it is gone."""

    def owned(self, namespace: str, tuning_uid: str) -> Owned: ...

    def trial_pods(self, namespace: str, tuning: str, index: int) -> list[dict[str, Any]]:
        """Pods labelled as the trial's (with their ownerReferences): labels alone prove nothing
        (`core.pods.owned_trial_pods`)."""

    def replica_set_controller(self, namespace: str, name: str, uid: str) -> str | None:
        """The uid of ReplicaSet `name`'s controller when that ReplicaSet has `uid`; else None."""

    def job_run(self, namespace: str, job: Mapping[str, Any]) -> JobRun: ...

    def production_pods(self, namespace: str, selector: Mapping[str, Any]) -> list[dict[str, Any]]: ...

    def nodes(self) -> list[dict[str, Any]] | None:
        """All nodes, or None when this install may not list them (namespaced)."""

    def gpu_pods(self) -> list[dict[str, Any]] | None:
        """Every pod that requests GPUs, or None when this install may not list them."""

    def gpu_intents(self, exclude_uid: str) -> list[int]:
        """GPUs per trial other BatchTunings decided to start but whose pods do not exist yet."""

    def services(self, namespace: str) -> list[dict[str, Any]]: ...

    def container_log(self, namespace: str, pod: str, container: str, previous: bool) -> str | None:
        """The end of a trial container's log (the last run's when `previous`); None when it cannot be read."""

    def create(self, obj: Mapping[str, Any]) -> bool:
        """Creates the object unless one of that name exists; True when created."""

    def delete(self, kind: str, namespace: str, name: str) -> None: ...

    def patch_deployment(self, namespace: str, name: str, patch: Mapping[str, Any], resource_version: str) -> dict[str, Any]:
        """A strategic-merge patch that applies only if the Deployment is still at `resource_version`."""

    def secret_value(self, namespace: str, name: str, key: str, label: str | None = None,
                     field: str = "spec.prometheus.authSecretRef") -> str:
        """A key of a Secret that opted in to batchtune (`label`: "true"; None: the Prometheus label); `NotAllowed`
        otherwise, naming `field`."""

    def event(self, namespace: str, name: str, uid: str, type_: str, reason: str, message: str) -> None: ...


class MetricsReader(Protocol):
    def ping(self) -> None: ...

    def trial_run(self, namespace: str, pod: str, model: str | None, window: Window) -> dict[str, float | None]: ...

    def production_window(self, production: Production, start: datetime, end: datetime) -> dict[str, float | None]: ...

    def production_workload(self, production: Production, lookback_s: int, window_s: int) -> WorkloadObservation | None:
        """Production's length histograms, request counts per window and prefix-cache counters; None: no pods."""

    def production_peak_rate(self, production: Production, lookback_s: int) -> float | None: ...

    def production_gpu_model(self, production: Production) -> str | None: ...

    def scrape_interval(self, production: Production, where: str) -> ScrapeInterval | None:
        """How often Prometheus scrapes the engine's series of production's pods (`where` names them), from its
        targets API or configuration; None when it reports neither."""


class Metrics(Protocol):
    def reader(self, url: UrlCheck, token: str | None, ctx: QueryContext, engine: Engine, owner: str) -> MetricsReader:
        """A reader for one tick of the BatchTuning `owner` (its uid) at the URL the policy allowed."""


class Reports(Protocol):
    def submit(self, namespace: str, name: str, uid: str, spec: Mapping[str, Any], status: Mapping[str, Any]) -> None:
        """Queue the report ConfigMap (tables now, curves image off the reconcile path)."""


class Twin(Protocol):
    def advise(self, key: str, compute: Callable[[], Any]) -> Any | None:
        """The result of `compute` for `key` when it is ready, else None: it is computed off the reconcile
        path (a later tick asks again with the same key and gets it). `key` names the tuning and the history
        the advice is for; a newer key for the same tuning replaces an older one."""


class InlineTwin:
    """`Twin` that computes on the spot (tests, and the CLI): deterministic, on the caller's thread."""

    def advise(self, key: str, compute: Callable[[], Any]) -> Any | None:
        return compute()


class GitPorts:
    """Git repositories and forges (`controller.gitremote`, `controller.forge`); the tests use the same, against a
    real Git server on loopback."""

    def remote(self, url: str, username: str | None, token: str | None) -> Any:
        from batchtune.controller.gitremote import Credentials, GitRemote

        return GitRemote(url, Credentials(username or "batchtune", token) if token else None)

    def forge(self, kind: str, api: str, repo_url: str, token: str) -> Any:
        from batchtune.controller.forge import Forge
        from batchtune.core.gitwrite import ForgeType

        return Forge(ForgeType(kind), api, repo_url, token)


@dataclass
class Ports:
    cluster: Cluster
    metrics: Metrics
    reports: Reports
    install: Install
    engines: Sequence[Engine] = ()
    twin: Twin = field(default_factory=InlineTwin)
    """Where TwinGuided's advice is computed (the operator: a background worker)."""
    git: GitPorts = field(default_factory=GitPorts)
    """PullRequest mode's repositories and forges."""
