"""The Helm chart and manifests/ on the local cluster: install --wait, upgrade, RBAC per mode
(checked with SubjectAccessReviews for the chart's ServiceAccount), and `kubectl apply` of manifests/.

The node agent hands each pod a token of its own ServiceAccount (as a kubeconfig), so the installed
operator runs as the chart's ServiceAccount with exactly the chart's RBAC.
The CRD comes from the session's `batchtuning_crd` fixture (crds.enabled=false): a CRD Helm did not
create cannot be adopted by a release, and deleting the shared one would take every test's objects.
"""

from __future__ import annotations

import json
import secrets
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import batchtune_local as lc

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "batchtune"


@pytest.fixture
def helm(cluster: lc.ClusterInfo) -> Callable[..., subprocess.CompletedProcess[str]]:
    binary = lc.binaries().helm

    def run(*args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        argv = [str(binary), f"--kubeconfig={cluster.admin_kubeconfig}", *args]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
        return done

    return run


@pytest.fixture
def releases(helm, kubectl) -> Iterator[list[tuple[str, str]]]:
    """(release, namespace) pairs a test installed; uninstalled (with the test's bindings) afterwards."""
    installed: list[tuple[str, str]] = []
    yield installed
    for release, namespace in installed:
        # BatchTunings go while their operator still runs (it removes its finalizer); one it left is freed,
        # so a failed test leaves nothing behind for the next one to trip on.
        kubectl("delete", "batchtunings.batchtune.io", "--all", "-n", namespace, "--wait", "--timeout", "60s",
                check=False)
        left = kubectl("get", "batchtunings.batchtune.io", "-n", namespace, "-o", "name", check=False).stdout.split()
        for name in left:
            kubectl("patch", name, "-n", namespace, "--type", "merge", "-p", '{"metadata":{"finalizers":null}}',
                    check=False)
        helm("uninstall", release, "-n", namespace, "--wait", "--timeout", "60s", check=False)
        kubectl("delete", "clusterrolebinding", f"{release}-as-test-user", "--ignore-not-found", check=False)


def operator_env(cluster: lc.ClusterInfo) -> list[str]:
    # No prometheus.scrapeIntervalSeconds: the operator reads the interval from the cluster's Prometheus (2 s here).
    # Its Prometheus is on loopback, which the chart allows only where allowedUrls names it.
    return ["--set", "operator.tickSeconds=1", "--set", f"prometheus.allowedUrls={{{cluster.prometheus_url}/}}"]


def can_i(kube, verb: str, resource: str, namespace: str | None, sa: str) -> bool:
    """A SubjectAccessReview for the ServiceAccount `sa` (system:serviceaccount:NS:NAME): allowed?

    `resource` is `plural.group[/subresource]` (core: `plural`); namespace "*" means all namespaces,
    None a cluster-scoped resource. The review names group and resource exactly: no discovery involved.
    """
    from kubernetes import client

    name, _, subresource = resource.partition("/")
    plural, _, group = name.partition(".")
    sa_namespace = sa.split(":")[2]
    review = client.V1SubjectAccessReview(spec=client.V1SubjectAccessReviewSpec(
        user=sa, groups=["system:serviceaccounts", f"system:serviceaccounts:{sa_namespace}", "system:authenticated"],
        resource_attributes=client.V1ResourceAttributes(
            verb=verb, group=group, resource=plural, subresource=subresource or None,
            namespace=None if namespace in (None, "*") else namespace)))
    result = client.AuthorizationV1Api(kube.api).create_subject_access_review(review)
    return bool(result.status.allowed)


def operator_pods(kube, namespace: str, release: str, count: int = 2) -> list[dict]:
    """The release's live operator pods (the chart runs two: one leads, one stands by)."""
    pods = kube.core.list_namespaced_pod(
        namespace, label_selector=f"app.kubernetes.io/instance={release},app.kubernetes.io/component=operator").items
    live = [p for p in pods if not p.metadata.deletion_timestamp]
    assert len(live) == count, [p.metadata.name for p in pods]
    return [kube.api.sanitize_for_serialization(p) for p in live]


def ready(pod: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions") or [])


def lease_holder(kube, namespace: str, release: str) -> dict:
    from kubernetes import client

    lease = client.CoordinationV1Api(kube.api).read_namespaced_lease(f"{release}-batchtune", namespace)
    return {"holder": lease.spec.holder_identity, "transitions": lease.spec.lease_transitions or 0}


@pytest.mark.timeout(900)  # above its waits: two 180 s installs, 240 s for the tuning and 60 s waits
def test_install_wait_upgrade_and_the_operator_reconciles_under_chart_rbac(
        cluster, kube, kubectl, helm, releases, namespace, batchtuning_crd, wait_for):
    release = f"bt-{secrets.token_hex(3)}"
    releases.append((release, namespace))
    done = helm("install", release, str(CHART), "-n", namespace, "--set", "crds.enabled=false",
                *operator_env(cluster), "--wait", "--timeout", "180s")
    assert f"{release}-batchtune in namespace {namespace}" in done.stdout  # NOTES rendered
    assert "watches BatchTunings in every namespace" in done.stdout
    pods = operator_pods(kube, namespace, release)
    assert all(ready(pod) for pod in pods)  # the standby is Ready too: it answers /healthz while it waits
    assert all(pod["spec"]["serviceAccountName"] == f"{release}-batchtune" for pod in pods)
    # One of the two holds the leader Lease.
    holder = wait_for(lambda: lease_holder(kube, namespace, release)["holder"], timeout=60, what="a Lease holder")
    assert holder.split("_")[0] in {pod["metadata"]["name"] for pod in pods}

    # The running operator acts on a BatchTuning with only the chart's rules.
    kube.custom.create_namespaced_custom_object("batchtune.io", "v1alpha1", namespace, "batchtunings", {
        "apiVersion": "batchtune.io/v1alpha1", "kind": "BatchTuning", "metadata": {"name": "no-target"},
        "spec": {"targetRef": {"name": "does-not-exist"}, "searchSpace": {"maxNumSeqs": {"values": [8, 16]}},
                 "slo": {"interTokenLatencyMilliseconds": 50},
                 "prometheus": {"url": cluster.prometheus_url}}})

    def waiting_for_target():
        bt = kube.custom.get_namespaced_custom_object("batchtune.io", "v1alpha1", namespace, "batchtunings",
                                                      "no-target")
        reasons = {c.get("reason") for c in (bt.get("status") or {}).get("conditions") or []}
        return "TargetNotFound" in reasons

    wait_for(waiting_for_target, timeout=60, what="the chart's operator to report TargetNotFound")
    events = kube.core.list_namespaced_event(namespace, field_selector="involvedObject.name=no-target").items
    assert any(e.reason == "TargetNotFound" for e in events), [e.reason for e in events]
    kube.custom.delete_namespaced_custom_object("batchtune.io", "v1alpha1", namespace, "batchtunings", "no-target")
    wait_for(lambda: not any(i["metadata"]["name"] == "no-target" for i in kube.custom.list_namespaced_custom_object(
        "batchtune.io", "v1alpha1", namespace, "batchtunings")["items"]), timeout=60,
        what="the operator to remove its finalizer")

    # A real tuning run end to end under the chart's identity: twin-backed vLLM, one trial, a decision.
    from operator_env import batchtuning, production

    kube.apps.create_namespaced_deployment(namespace, production(namespace))
    kube.custom.create_namespaced_custom_object("batchtune.io", "v1alpha1", namespace, "batchtunings", batchtuning(
        namespace, cluster.prometheus_url, name="real",
        searchSpace={"maxNumSeqs": {"values": [16]}, "gpuMemoryUtilizationPercent": [95]},
        strategy={"type": "Grid", "maxTrials": 1, "maxParallelTrials": 1}, objective={"type": "OutputThroughput"},
        load={"inputTokens": 256, "outputTokens": 64, "concurrency": 4}, apply={"mode": "Recommend"},
        report={"curveLoad": {"concurrency": 4}}))  # the search's load: no extra curve step

    def decided():
        bt = kube.custom.get_namespaced_custom_object("batchtune.io", "v1alpha1", namespace, "batchtunings", "real")
        return (bt.get("status") or {}).get("phase") in ("Recommended", "Failed") and bt
    bt = wait_for(decided, timeout=240, interval=1, what="the chart's operator to finish a tuning")
    assert bt["status"]["phase"] == "Recommended", json.dumps(bt["status"], indent=1)[-2000:]
    # Without prometheus.scrapeIntervalSeconds the operator asked Prometheus: the local cluster scrapes every 2 s.
    scrape = bt["status"]["plan"]["scrapeInterval"]
    assert scrape["seconds"] == cluster.config.get("scrape_interval_s", 2) and "Prometheus'" in scrape["source"], scrape
    # The report is rendered off the reconcile path after the decision: it follows within seconds.
    report = wait_for(lambda: kube.core.list_namespaced_config_map(
        namespace, field_selector="metadata.name=real-report").items, timeout=60, interval=1,
        what="the report ConfigMap")[0]
    assert report.binary_data["curves.png"]
    kube.custom.delete_namespaced_custom_object("batchtune.io", "v1alpha1", namespace, "batchtunings", "real")
    wait_for(lambda: not kube.custom.list_namespaced_custom_object(
        "batchtune.io", "v1alpha1", namespace, "batchtunings")["items"], timeout=60, what="cleanup of 'real'")

    # Upgrade: a changed value rolls the operator (Recreate) and it comes back Ready.
    done = helm("upgrade", release, str(CHART), "-n", namespace, "--reuse-values", "--set",
                "operator.tickSeconds=3", "--wait", "--timeout", "180s")
    status = json.loads(helm("status", release, "-n", namespace, "-o", "json").stdout)
    assert status["version"] == 2 and status["info"]["status"] == "deployed"
    for pod in wait_for(lambda: _rolled(kube, namespace, release, "3"), timeout=120, what="the rolled operator pods"):
        assert ready(pod)


def _rolled(kube, namespace: str, release: str, tick: str) -> list[dict] | None:
    """The operator pods once both run the new template (the old ones gone)."""
    try:
        pods = operator_pods(kube, namespace, release)
    except AssertionError:
        return None
    ticks = {next(e.get("value") for e in p["spec"]["containers"][0]["env"] if e["name"] == "BATCHTUNE_TICK_SECONDS")
             for p in pods}
    return pods if ticks == {tick} else None


@pytest.mark.slow
# Measured 199 s on the shared 2-core machine; the timeout is above the sum of the test's own waits
# (120 + 90 + 120 + 150 + 60 + 240 s).
@pytest.mark.timeout(840)
def test_helm_upgrade_with_a_tuning_in_flight_finishes_it_on_the_new_version(
        cluster, kube, kubectl, helm, releases, namespace, batchtuning_crd, wait_for):
    """Two replicas; mid-trial, `helm upgrade` to a new image with changed values: the rollout replaces both pods
    (each old leader hands the Lease over on SIGTERM) and the tuning applies, verifies and ends exactly once."""
    import threading

    from operator_env import Traffic, batchtuning, production

    release = f"bt-{secrets.token_hex(3)}"
    releases.append((release, namespace))
    helm("install", release, str(CHART), "-n", namespace, "--set", "crds.enabled=false",
         "--set", f"watchNamespaces={{{namespace}}}", *operator_env(cluster), "--wait", "--timeout", "120s")
    first = {p["metadata"]["name"] for p in operator_pods(kube, namespace, release)}
    kube.apps.create_namespaced_deployment(namespace, production(namespace))
    wait_for(lambda: (kube.apps.read_namespaced_deployment("llm", namespace).status.ready_replicas or 0) >= 1,
             timeout=90, what="production ready")
    created: dict[str, int] = {}
    stop = threading.Event()

    def watch_creations() -> None:
        from kubernetes import watch
        w = watch.Watch()
        for event in w.stream(kube.apps.list_namespaced_deployment, namespace, timeout_seconds=840):
            if event["type"] == "ADDED" and "-trial-" in event["object"].metadata.name:
                created[event["object"].metadata.name] = created.get(event["object"].metadata.name, 0) + 1
            if stop.is_set():
                w.stop()
    threading.Thread(target=watch_creations, daemon=True).start()
    traffic = Traffic(kube, namespace, "app=llm", rate=2)
    traffic.start()

    def bt() -> dict:
        return kube.custom.get_namespaced_custom_object("batchtune.io", "v1alpha1", namespace, "batchtunings", "tune")
    try:
        kube.custom.create_namespaced_custom_object("batchtune.io", "v1alpha1", namespace, "batchtunings", batchtuning(
            namespace, cluster.prometheus_url,
            searchSpace={"maxNumSeqs": {"values": [4, 16]}, "gpuMemoryUtilizationPercent": [95]},
            strategy={"type": "Grid", "maxTrials": 2, "maxParallelTrials": 1}, objective={"type": "OutputThroughput"},
            load={"inputTokens": 256, "outputTokens": 64, "concurrency": 8}, report={"curveLoad": {"concurrency": 8}},
            trial={"warmupSeconds": 3, "measureSeconds": 15, "readinessTimeoutSeconds": 120},
            apply={"mode": "Auto", "verifySeconds": 15, "cooldownSeconds": 0, "verifyMinRequests": 10}))
        wait_for(lambda: any(t.get("state") in ("Warming", "Measuring") for t in (bt().get("status") or {}).get(
            "trials") or []), timeout=120, interval=0.5, what="the first trial under load")
        # A new image (the local cluster's node agent runs any batchtune:* image) and a changed value.
        helm("upgrade", release, str(CHART), "-n", namespace, "--reuse-values", "--set", "image.tag=0.1.1-next",
             "--set", "operator.tickSeconds=2", "--wait", "--timeout", "150s")
        pods = wait_for(lambda: _rolled(kube, namespace, release, "2"), timeout=60, what="the rolled operator pods")
        assert not first & {p["metadata"]["name"] for p in pods}
        assert {p["spec"]["containers"][0]["image"] for p in pods} == {"batchtune:0.1.1-next"}
        in_flight = bt()["status"]
        assert in_flight["phase"] not in ("Succeeded", "Failed", "RolledBack"), "the tuning finished before the upgrade"

        def finished() -> dict | None:
            found = bt()
            return found if (found.get("status") or {}).get("phase") in ("Succeeded", "Failed", "RolledBack") else None
        done = wait_for(finished, timeout=240, interval=1, what="the tuning to finish on the new version")
    finally:
        stop.set()
        traffic.stop()
    status = done["status"]
    assert status["phase"] == "Succeeded", json.dumps(status, indent=1)[-3000:]
    names = [t["name"] for t in status["trials"]]
    assert len(names) == len(set(names)) == status["trialsPlanned"] == 2
    assert set(created) == set(names) and all(n == 1 for n in created.values()), created
    dep = kube.apps.read_namespaced_deployment("llm", namespace)
    assert json.loads(dep.metadata.annotations["batchtune.io/applied"])["state"] == "Verified"
    assert dep.metadata.annotations["deployment.kubernetes.io/revision"] == "2"
    assert not kube.batch.list_namespaced_job(namespace, label_selector="batchtune.io/tuning=tune").items
    lease = lease_holder(kube, namespace, release)
    assert lease["holder"].split("_")[0] in {p["metadata"]["name"] for p in operator_pods(kube, namespace, release)}
    assert lease["transitions"] >= 1  # handed over during the rollout
    dashboard_reads_the_operator(cluster.prometheus_url, namespace)


def dashboard_reads_the_operator(prometheus_url: str, namespace: str) -> None:
    """Each of the shipped dashboard's operator panels, as Grafana would ask the cluster's Prometheus (which scrapes
    the operator pods' `metrics` port), answers with the install's series."""
    import urllib.parse
    import urllib.request

    dashboard = json.loads((CHART / "dashboards" / "batchtune.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"] if "batchtune_" in t["expr"]]
    assert exprs

    def query(expr: str) -> list[dict]:
        text = expr.replace("$__range", "1h").replace("$namespace", namespace)
        url = f"{prometheus_url}/api/v1/query?" + urllib.parse.urlencode({"query": text})
        answer = json.loads(urllib.request.urlopen(url, timeout=10).read())
        assert answer["status"] == "success", (expr, answer)
        return answer["data"]["result"]
    leaders = query(f'max by (pod) (batchtune_leader{{namespace="{namespace}"}})')
    assert sorted(float(s["value"][1]) for s in leaders) == [0.0, 1.0], leaders  # one leads, one stands by
    for expr in exprs:
        if any(name in expr for name in MEASURED_CAPACITY_ONLY):
            continue  # this test's tuning (OutputThroughput at one load) measures no SLO capacity: absent by design
        assert query(expr), f"the dashboard's {expr!r} has no data"


MEASURED_CAPACITY_ONLY = ("batchtune_slo_capacity_requests_per_second", "batchtune_slo_headroom_percent")
"""Decision gauges set only when the chosen setting's SLO capacity was measured (docs/operator.md, metrics)."""


def test_cluster_wide_service_account_rights(kube, helm, releases, namespace, wait_for):
    release = f"bt-{secrets.token_hex(3)}"
    releases.append((release, namespace))
    # Rights only: no operator pod needed, so no --wait.
    helm("install", release, str(CHART), "-n", namespace, "--set", "crds.enabled=false", "--set",
         "operator.extraArgs={--verbose}")
    sa = f"system:serviceaccount:{namespace}:{release}-batchtune"
    # The API server's RBAC cache takes a moment to see the new binding.
    wait_for(lambda: can_i(kube, "patch", "batchtunings.batchtune.io/status", "default", sa), timeout=15,
             what="the ClusterRoleBinding to take effect")
    assert can_i(kube, "create", "deployments.apps", "kube-system", sa)
    assert can_i(kube, "list", "nodes", None, sa)
    assert can_i(kube, "watch", "customresourcedefinitions.apiextensions.k8s.io", None, sa)
    assert not can_i(kube, "delete", "pods", "default", sa)
    assert not can_i(kube, "list", "secrets", "default", sa)
    assert not can_i(kube, "get", "secrets", "default", sa)  # only in prometheus.authSecretNamespaces
    assert not can_i(kube, "update", "deployments.apps", "default", sa)
    assert not can_i(kube, "create", "clusterroles.rbac.authorization.k8s.io", None, sa)


def test_namespaced_install_cannot_touch_other_namespaces(kube, helm, releases, namespace, wait_for):
    from kubernetes import client

    watched = f"{namespace}-w"[:63]
    other = f"{namespace}-o"[:63]
    for name in (watched, other):
        kube.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(
            name=name, labels={"batchtune.io/test": "true"})))
    try:
        release = f"bt-{secrets.token_hex(3)}"
        releases.append((release, namespace))
        helm("install", release, str(CHART), "-n", namespace, "--set", "crds.enabled=false",
             "--set", f"watchNamespaces={{{watched}}}", "--set", f"prometheus.authSecretNamespaces={{{watched}}}")
        roles = kube.rbac.list_cluster_role(label_selector=f"app.kubernetes.io/instance={release}").items
        assert roles == [], "a namespaced install created a ClusterRole"
        sa = f"system:serviceaccount:{namespace}:{release}-batchtune"
        wait_for(lambda: can_i(kube, "get", "batchtunings.batchtune.io", watched, sa), timeout=15,
                 what="the RoleBinding to take effect")
        for verb, resource in (("get", "batchtunings.batchtune.io"), ("patch", "batchtunings.batchtune.io/status"),
                               ("create", "deployments.apps"), ("patch", "deployments.apps"),
                               ("create", "jobs.batch"), ("list", "pods"), ("create", "events"),
                               ("update", "configmaps"), ("get", "secrets")):
            assert can_i(kube, verb, resource, watched, sa), f"{verb} {resource} in the watched namespace"
            assert not can_i(kube, verb, resource, other, sa), f"{verb} {resource} in another namespace"
            assert not can_i(kube, verb, resource, "default", sa), f"{verb} {resource} in default"
        assert not can_i(kube, "list", "nodes", None, sa)
        assert not can_i(kube, "list", "namespaces", None, sa)
        assert not can_i(kube, "list", "batchtunings.batchtune.io", "*", sa)
        args = kube.apps.read_namespaced_deployment(f"{release}-batchtune", namespace).spec.template.spec.containers[0].args
        assert f"--namespace={watched}" in args
    finally:
        for name in (watched, other):
            kube.core.delete_namespace(name)


@pytest.mark.parametrize("manifest", ["install.yaml", "install-namespaced.yaml"])
def test_kubectl_apply_of_the_manifests_is_accepted(kube, kubectl, batchtuning_crd, manifest, wait_for):
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    # A server-side dry run creates nothing, so the namespace the objects go to must exist already.
    outcome: dict[str, bool] = {}

    def namespace_usable() -> bool:
        try:
            kube.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name="batchtune-system")))
            outcome["created"] = True
            return True
        except ApiException as exc:
            if exc.status != 409:
                raise
        # It exists: usable unless a previous run is still deleting it.
        return kube.core.read_namespace("batchtune-system").status.phase == "Active"

    wait_for(namespace_usable, timeout=90, what="namespace batchtune-system to be usable")
    try:
        done = kubectl("apply", "--dry-run=server", "--server-side", "--force-conflicts",
                       "-f", str(REPO / "manifests" / manifest))
        out = done.stdout
        for expected in ("customresourcedefinition.apiextensions.k8s.io/batchtunings.batchtune.io",
                         "serviceaccount/batchtune", "deployment.apps/batchtune"):
            assert expected in out, out
        assert ("clusterrole.rbac.authorization.k8s.io/batchtune" in out) is (manifest == "install.yaml")
    finally:
        if outcome.get("created"):
            kube.core.delete_namespace("batchtune-system")


def test_crd_lifecycle_keep_survives_uninstall(kube, kubectl, helm, releases, namespace, batchtuning_crd, wait_for):
    """crds.enabled with crds.keep: the release adopts and upgrades the CRD, and uninstall leaves it."""
    release = f"bt-{secrets.token_hex(3)}"
    adopt = {"meta.helm.sh/release-name": release, "meta.helm.sh/release-namespace": namespace}
    # The session's CRD was applied by kubectl; these markers let this release adopt it instead of failing.
    kubectl("label", "--overwrite", "crd", batchtuning_crd, "app.kubernetes.io/managed-by=Helm")
    kubectl("annotate", "--overwrite", "crd", batchtuning_crd, *(f"{k}={v}" for k, v in adopt.items()))
    try:
        kube.custom.create_namespaced_custom_object("batchtune.io", "v1alpha1", namespace, "batchtunings", {
            "apiVersion": "batchtune.io/v1alpha1", "kind": "BatchTuning", "metadata": {"name": "kept"},
            "spec": {"targetRef": {"name": "x"}, "searchSpace": {"maxNumSeqs": {"values": [8]}},
                     "slo": {"interTokenLatencyMilliseconds": 50}, "prometheus": {"url": "http://127.0.0.1:1"}}})
        helm("install", release, str(CHART), "-n", namespace, "--set", "crds.enabled=true",
             "--set", "operator.extraArgs={--namespace=nowhere}")
        crd = kube.apiext.read_custom_resource_definition(batchtuning_crd)
        assert crd.metadata.annotations["helm.sh/resource-policy"] == "keep"
        assert crd.metadata.labels["app.kubernetes.io/instance"] == release
        helm("uninstall", release, "-n", namespace, "--wait", "--timeout", "60s")
        # Kept: the CRD and the BatchTunings stored under it.
        assert kube.apiext.read_custom_resource_definition(batchtuning_crd).metadata.deletion_timestamp is None
        kube.custom.get_namespaced_custom_object("batchtune.io", "v1alpha1", namespace, "batchtunings", "kept")
    finally:
        # No operator ever handled it (no finalizer): delete it now rather than with the namespace later,
        # so tests that list BatchTunings cluster-wide do not see it.
        kubectl("-n", namespace, "delete", "batchtuning", "kept", "--ignore-not-found", "--wait=true", check=False)
        kubectl("annotate", "crd", batchtuning_crd, *(f"{k}-" for k in adopt), "helm.sh/resource-policy-",
                check=False)
        kubectl("label", "crd", batchtuning_crd, "app.kubernetes.io/managed-by-", check=False)
