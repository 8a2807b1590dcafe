"""Kubernetes access for the user CLI (`batchtune status|report|recommend`, `kubectl batchtune ...`).

Every failure a user can meet is a `CliError` whose message says what is wrong and what to do:
no kubeconfig, an unreachable API server, the CRD not installed, no such BatchTuning, RBAC.

    from batchtune.client import connect
    kube = connect(kubeconfig=None, context=None)
    bt = kube.get_batchtuning(kube.namespace(None), "llama-8b")
"""

from __future__ import annotations

import base64
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from batchtune import API_GROUP, API_VERSION, KIND, PLURAL

INSTALL_HINT = "install the chart (helm install batchtune charts/batchtune) or kubectl apply -f manifests/install.yaml"


class CliError(Exception):
    """A failure to report to the user as one message, exit status 1."""


class KubeconfigMissing(CliError):
    pass


class ApiUnreachable(CliError):
    pass


class CrdMissing(CliError):
    pass


class NotFound(CliError):
    pass


class Forbidden(CliError):
    pass


def kubeconfig_path(explicit: str | None = None) -> Path:
    """The kubeconfig kubectl would use: --kubeconfig, the first existing $KUBECONFIG entry, ~/.kube/config."""
    if explicit:
        return Path(explicit).expanduser()
    env = os.environ.get("KUBECONFIG")
    if env:
        for entry in env.split(os.pathsep):
            if entry and Path(entry).expanduser().exists():
                return Path(entry).expanduser()
        return Path(env.split(os.pathsep)[0]).expanduser()
    return Path.home() / ".kube" / "config"


@dataclass(frozen=True)
class StoredReport:
    """A report ConfigMap as read: its files, and who controls it (anyone who may write ConfigMaps in the
    namespace can write one named `<bt>-report`)."""

    files: dict[str, bytes]
    """File name -> bytes (data and binaryData)."""
    controllers: tuple[tuple[str, str], ...] = ()
    """(kind, uid) of each ownerReference with controller: true."""

    def owned_by(self, kind: str, uid: str | None) -> bool:
        """Whether this object (the BatchTuning, by uid) controls the ConfigMap: the operator wrote it."""
        return bool(uid) and (kind, uid) in self.controllers


@dataclass
class Kube:
    """The API client of one identity and the namespace its kubeconfig context selects."""

    api: Any
    default_namespace: str
    server: str

    def namespace(self, explicit: str | None) -> str:
        return explicit or self.default_namespace

    # ---- reads ------------------------------------------------------------------------

    def get_batchtuning(self, namespace: str, name: str) -> dict[str, Any]:
        from kubernetes import client

        custom = client.CustomObjectsApi(self.api)
        try:
            obj = custom.get_namespaced_custom_object(API_GROUP, API_VERSION, namespace, PLURAL, name)
            return cast(dict[str, Any], obj)  # the custom-objects API returns the object's JSON as a dict
        except Exception as exc:  # noqa: BLE001 - classified below
            if _status(exc) != 404:
                raise self._error(exc, f"get {KIND} {namespace}/{name}") from None
        # A 404 means either no such object or no such resource: the list call tells them apart.
        names = self.batchtuning_names(namespace)
        hint = f"; {KIND}s in {namespace}: {', '.join(names)}" if names else f"; there are no {KIND}s in {namespace}"
        raise NotFound(f'{KIND} "{name}" not found in namespace "{namespace}"{hint}')

    def batchtuning_names(self, namespace: str) -> list[str]:
        from kubernetes import client

        custom = client.CustomObjectsApi(self.api)
        try:
            listed = cast(dict[str, Any], custom.list_namespaced_custom_object(API_GROUP, API_VERSION, namespace, PLURAL))
        except Exception as exc:  # noqa: BLE001 - classified below
            if _status(exc) == 404:
                raise CrdMissing(f"the {KIND} CRD ({PLURAL}.{API_GROUP}) is not installed on {self.server}; "
                                 f"{INSTALL_HINT}") from None
            raise self._error(exc, f"list {PLURAL} in {namespace}") from None
        return sorted(item["metadata"]["name"] for item in listed.get("items") or [])

    def get_report(self, namespace: str, name: str) -> StoredReport | None:
        """The report ConfigMap `<name>-report`'s files and controllers, or None when it is not written yet."""
        from kubernetes import client

        try:
            cm = client.CoreV1Api(self.api).read_namespaced_config_map(f"{name}-report", namespace)
        except Exception as exc:  # noqa: BLE001 - classified below
            if _status(exc) == 404:
                return None
            raise self._error(exc, f"get ConfigMap {namespace}/{name}-report") from None
        files = {key: value.encode() for key, value in (cm.data or {}).items()}
        files.update({key: base64.b64decode(value) for key, value in (cm.binary_data or {}).items()})
        owners = (cm.metadata.owner_references if cm.metadata else None) or []
        return StoredReport(files, tuple((str(o.kind), str(o.uid)) for o in owners if o.controller))

    def get_deployment(self, namespace: str, name: str) -> dict[str, Any]:
        """The Deployment as the API server's JSON (camelCase), for `batchtune workload capture`."""
        from kubernetes import client

        try:
            resp: Any = client.AppsV1Api(self.api).read_namespaced_deployment(name, namespace, _preload_content=False)
        except Exception as exc:  # noqa: BLE001 - classified below
            if _status(exc) == 404:
                raise NotFound(f'Deployment "{name}" not found in namespace "{namespace}"') from None
            raise self._error(exc, f"get Deployment {namespace}/{name}") from None
        return cast(dict[str, Any], json.loads(resp.data))

    def pods(self, namespace: str, match_labels: dict[str, str]) -> list[dict[str, Any]]:
        """The pods a Deployment's matchLabels select, as the API server's JSON."""
        from kubernetes import client

        selector = ",".join(f"{k}={v}" for k, v in sorted(match_labels.items()))
        try:
            resp: Any = client.CoreV1Api(self.api).list_namespaced_pod(namespace, label_selector=selector,
                                                                       _preload_content=False)
        except Exception as exc:  # noqa: BLE001 - classified below
            raise self._error(exc, f"list pods in {namespace}") from None
        return cast(list[dict[str, Any]], json.loads(resp.data).get("items") or [])

    def _error(self, exc: Exception, doing: str) -> CliError:
        status = _status(exc)
        if status == 403:
            return Forbidden(f"forbidden: your identity may not {doing} ({_reason(exc)}); "
                             "ask for a Role granting get/list on batchtunings and get on configmaps")
        if status == 401:
            return CliError(f"the API server at {self.server} did not accept your credentials ({_reason(exc)}); "
                            "check the kubeconfig's user")
        if status is None:
            import urllib3

            if not isinstance(exc, (urllib3.exceptions.HTTPError, OSError)):
                raise exc
            return ApiUnreachable(f"cannot reach the API server at {self.server}: {_short(exc)}")
        return CliError(f"{doing} failed: HTTP {status}: {_reason(exc)}")


def connect(kubeconfig: str | None = None, context: str | None = None) -> Kube:
    """An API client from --kubeconfig / $KUBECONFIG / ~/.kube/config, or the in-cluster service account."""
    from kubernetes import client, config

    path = kubeconfig_path(kubeconfig)
    # Inside a pod with no kubeconfig of its own: the pod's service account, as kubectl does.
    in_cluster = (not kubeconfig and not os.environ.get("KUBECONFIG") and not path.exists()
                  and "KUBERNETES_SERVICE_HOST" in os.environ)
    if in_cluster:
        configuration = client.Configuration()
        config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]  # the kubernetes client is untyped here
        namespace_file = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
        namespace = namespace_file.read_text().strip() if namespace_file.exists() else "default"
        return Kube(api=_api(configuration), default_namespace=namespace, server=configuration.host)
    if not path.exists():
        where = "--kubeconfig" if kubeconfig else ("$KUBECONFIG" if os.environ.get("KUBECONFIG") else "the default")
        raise KubeconfigMissing(
            f"no kubeconfig at {path} ({where}); point --kubeconfig or $KUBECONFIG at one "
            "(for the local cluster: . ~/.cache/batchtune/cluster/env)")
    configuration = client.Configuration()
    try:
        config.load_kube_config(config_file=str(path), context=context, client_configuration=configuration)  # type: ignore[no-untyped-call]  # the kubernetes client is untyped here
        contexts, active = config.list_kube_config_contexts(config_file=str(path))  # type: ignore[no-untyped-call]  # the kubernetes client is untyped here
    except config.ConfigException as exc:
        raise CliError(f"kubeconfig {path}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - yaml errors and the like
        raise CliError(f"kubeconfig {path} could not be read: {exc}") from None
    chosen = next((c for c in contexts if c.get("name") == context), active) if context else active
    namespace = ((chosen or {}).get("context") or {}).get("namespace") or "default"
    return Kube(api=_api(configuration), default_namespace=namespace, server=configuration.host)


def _api(configuration: Any) -> Any:
    from kubernetes import client

    # One retry, not urllib3's three: a user waiting on a dead API server wants to know fast.
    configuration.retries = 1
    return client.ApiClient(configuration)


def _status(exc: Exception) -> int | None:
    from kubernetes.client.exceptions import ApiException

    if isinstance(exc, ApiException):
        return exc.status or None
    return None


def _reason(exc: Exception) -> str:
    import json

    body = getattr(exc, "body", None)
    try:
        # A missing (None) or non-JSON body raises here and falls to the except below.
        return json.loads(cast(str, body)).get("message") or str(getattr(exc, "reason", exc))
    except Exception:  # noqa: BLE001 - non-JSON bodies
        return str(getattr(exc, "reason", None) or exc)


def _short(exc: Exception) -> str:
    text = str(getattr(exc, "reason", None) or exc)
    # urllib3 wraps the socket error in several layers; the last clause names the cause.
    return text.split("Caused by ")[-1].strip("()")[:300]
