"""The Helm chart, checked through `helm template` and `helm lint` (no cluster): RBAC per mode, the
operator Deployment's hardening, the install's bounds (flags, Secret reads, the admission policy), the
CRD lifecycle, the strict values schema, and manifests/ drift."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from batchtune_local.binaries import KUBE_VERSION, binaries

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "batchtune"
NAMESPACE = "batchtune-system"

pytestmark = pytest.mark.binaries  # helm from hack/localcluster/build: hack/test-suite runs these after the build


def _helm() -> str:
    helm = os.environ.get("HELM") or str(binaries().helm)
    if not os.access(helm, os.X_OK):
        pytest.fail(f"helm not found at {helm}: run `make binaries` (or set $HELM)", pytrace=False)
    return helm


@cache
def _template(*sets: str) -> tuple[str, tuple[dict[str, Any], ...]]:
    argv = [_helm(), "template", "bt", str(CHART), "--namespace", NAMESPACE,
            "--kube-version", KUBE_VERSION.lstrip("v")]
    for s in sets:
        argv += ["--set", s]
    done = subprocess.run(argv, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout, tuple(d for d in yaml.safe_load_all(done.stdout) if d)


def render(*sets: str) -> list[dict[str, Any]]:
    return list(_template(*sets)[1])


def render_text(*sets: str) -> str:
    return _template(*sets)[0]


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {[d['metadata']['name'] for d in found]}"
    return found[0]


def kinds(docs: list[dict[str, Any]]) -> list[str]:
    return sorted(d["kind"] for d in docs)


def operator_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    dep = one(docs, "Deployment")
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    return container


POLICY = ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")


def grants(rules: list[dict[str, Any]], group: str, resource: str) -> set[str]:
    verbs: set[str] = set()
    for rule in rules:
        if group in rule["apiGroups"] and resource in rule["resources"]:
            verbs |= set(rule["verbs"])
    return verbs


# ---- lint ------------------------------------------------------------------------------

@pytest.mark.parametrize("sets", [
    pytest.param((), id="defaults"),
    pytest.param(("watchNamespaces={team-a,team-b}", "metrics.serviceMonitor.enabled=true",
                  "vllmPodMonitor.enabled=true", "grafanaDashboard.enabled=true", "crds.keep=false",
                  "prometheus.authSecretNamespaces={team-b}", "prometheus.allowedUrls={http://prom.monitoring:9090}",
                  "load.allowedImages={registry.example.com/lg:1}", "maxGpuMinutesPerTuning=600"),
                 id="namespaced-with-every-option"),
])
def test_helm_lint_is_clean(sets):
    argv = [_helm(), "lint", str(CHART), "--strict", "--kube-version", KUBE_VERSION.lstrip("v")]
    for s in sets:
        argv += ["--set", s]
    done = subprocess.run(argv, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[WARNING]" not in done.stdout and "[ERROR]" not in done.stdout, done.stdout


# ---- what gets rendered ----------------------------------------------------------------

# The leader election's Role and RoleBinding (the Lease) and the PodDisruptionBudget come with the default two replicas.
HA = ("PodDisruptionBudget", "Role", "RoleBinding")


@pytest.mark.parametrize("sets, expected", [
    pytest.param((), ["ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "Deployment",
                      "ServiceAccount", *POLICY, *HA], id="cluster-wide-defaults"),
    pytest.param(("watchNamespaces={a,b}",), ["CustomResourceDefinition", "Deployment", "Role", "Role",
                                              "RoleBinding", "RoleBinding", "ServiceAccount", *POLICY, *HA],
                 id="namespaced"),
    pytest.param(("prometheus.authSecretNamespaces={a,b}",),
                 ["ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "Deployment", "Role", "Role",
                  "RoleBinding", "RoleBinding", "ServiceAccount", *POLICY, *HA], id="secret-namespaces"),
    pytest.param(("crds.enabled=false", "rbac.create=false", "serviceAccount.create=false",
                  "prometheus.authSecretNamespaces={a}"), ["Deployment", "PodDisruptionBudget", *POLICY],
                 id="bring-your-own-crd-rbac-and-sa"),
    pytest.param(("admissionPolicy.enabled=false",),
                 ["ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "Deployment", "ServiceAccount",
                  *HA], id="no-admission-policy"),
    pytest.param(("metrics.serviceMonitor.enabled=true",),
                 ["ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "Deployment", "Service",
                  "ServiceAccount", "ServiceMonitor", *POLICY, *HA], id="service-monitor"),
    pytest.param(("metrics.enabled=false", "metrics.serviceMonitor.enabled=true"),
                 ["ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "Deployment",
                  "ServiceAccount", *POLICY, *HA], id="no-metrics-no-monitor"),
    pytest.param(("vllmPodMonitor.enabled=true", "grafanaDashboard.enabled=true", "crds.enabled=false"),
                 ["ClusterRole", "ClusterRoleBinding", "ConfigMap", "Deployment", "PodMonitor", "ServiceAccount",
                  *POLICY, *HA], id="pod-monitor-and-dashboard"),
    pytest.param(("replicaCount=1", "leaderElection.enabled=false"),
                 ["ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "Deployment", "ServiceAccount",
                  *POLICY], id="one-replica-no-election"),
    pytest.param(("replicaCount=1",),
                 ["ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "Deployment", "Role",
                  "RoleBinding", "ServiceAccount", *POLICY], id="one-replica-with-election"),
])
def test_rendered_kinds(sets, expected):
    assert kinds(render(*sets)) == sorted(expected)


def test_every_object_carries_the_chart_labels():
    for doc in render("metrics.serviceMonitor.enabled=true", "vllmPodMonitor.enabled=true",
                      "grafanaDashboard.enabled=true"):
        labels = doc["metadata"].get("labels") or {}
        assert labels.get("app.kubernetes.io/instance") == "bt", doc["kind"]
        assert labels.get("app.kubernetes.io/managed-by") == "Helm", doc["kind"]
        assert labels.get("helm.sh/chart") == "batchtune-0.1.0", doc["kind"]


# ---- the operator Deployment -----------------------------------------------------------

def test_operator_deployment_is_two_replicas_one_leading():
    docs = render()
    dep = one(docs, "Deployment")
    assert dep["spec"]["replicas"] == 2
    # A new replica comes up (as a standby) before an old one goes.
    assert dep["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    selector = dep["spec"]["selector"]["matchLabels"]
    assert selector.items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    args = operator_container(docs)["args"]
    for flag in ("--leader-elect", f"--leader-elect-namespace={NAMESPACE}", "--leader-elect-name=bt-batchtune",
                 "--leader-elect-lease-duration=15", "--leader-elect-renew-deadline=10",
                 "--leader-elect-retry-period=2"):
        assert flag in args, args
    env = {e["name"]: e.get("valueFrom") for e in operator_container(docs)["env"]}
    assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    # Spread over nodes where the cluster allows; never required (a one-node cluster still runs both).
    anti = dep["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    assert list(anti) == ["preferredDuringSchedulingIgnoredDuringExecution"]
    assert anti["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]["labelSelector"][
        "matchLabels"] == selector
    pdb = one(docs, "PodDisruptionBudget")
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": selector}}


def test_the_leader_lease_is_all_the_election_may_touch():
    role = one(render(), "Role", "bt-batchtune-leader")
    assert role["metadata"]["namespace"] == NAMESPACE
    assert role["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "resourceNames": ["bt-batchtune"],
         "verbs": ["get", "update"]}]
    binding = one(render(), "RoleBinding", "bt-batchtune-leader")
    assert binding["roleRef"]["name"] == "bt-batchtune-leader"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "bt-batchtune", "namespace": NAMESPACE}]


def test_one_replica_without_election_is_recreated():
    dep = one(render("replicaCount=1", "leaderElection.enabled=false"), "Deployment")
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"] == {"type": "Recreate"}
    assert not [a for a in operator_container([dep])["args"] if a.startswith("--leader-elect")]
    assert "affinity" not in dep["spec"]["template"]["spec"]


def test_two_replicas_without_election_are_refused():
    argv = [_helm(), "template", "bt", str(CHART), "--kube-version", KUBE_VERSION.lstrip("v"),
            "--set", "replicaCount=2", "--set", "leaderElection.enabled=false"]
    done = subprocess.run(argv, capture_output=True, text=True)
    assert done.returncode != 0
    assert "replicaCount above 1 needs leaderElection.enabled" in done.stderr


def test_operator_runs_hardened():
    docs = render()
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    container = operator_container(docs)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 65532
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    # A read-only root needs a writable /tmp (matplotlib cache, temp files).
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes[mounts["/tmp"]]
    assert pod["serviceAccountName"] == "bt-batchtune"


def test_operator_binds_its_endpoints_to_the_pod_ip_and_probes_healthz():
    container = operator_container(render())
    args = container["args"]
    assert args[0] == "operator"
    assert "--liveness-address=$(POD_IP):8080" in args
    assert "--metrics-address=$(POD_IP):8081" in args
    assert "--operator-image=batchtune:0.1.0" in args
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"health": 8080, "metrics": 8081}


@pytest.mark.parametrize("sets, present, absent", [
    pytest.param(("watchNamespaces={a,b}",), ["--namespace=a", "--namespace=b"], [], id="namespaced-watches"),
    pytest.param((), [], ["--namespace="], id="cluster-wide-watches-all"),
    pytest.param(("metrics.enabled=false",), ["--metrics-address="], ["--metrics-address=$(POD_IP):8081"],
                 id="metrics-off"),
    pytest.param(("image.tag=9.9.9",), ["--operator-image=batchtune:9.9.9"], [], id="tag"),
    pytest.param(("image.digest=sha256:" + "a" * 64,),
                 ["--operator-image=batchtune@sha256:" + "a" * 64], [], id="digest-wins"),
    pytest.param(("operator.loadGeneratorImage=example.com/lg:1",), ["--operator-image=example.com/lg:1"], [],
                 id="own-load-generator-image"),
    pytest.param(("operator.verbose=true", "operator.extraArgs={--tick-seconds=5}"),
                 ["--verbose", "--tick-seconds=5"], [], id="verbose-and-extra-args"),
])
def test_operator_args(sets, present, absent):
    args = operator_container(render(*sets))["args"]
    for arg in present:
        assert arg in args, args
    for arg in absent:
        assert not any(a.startswith(arg) and (arg.endswith("=") or a == arg) for a in args), args


def test_image_follows_tag_and_digest():
    assert operator_container(render())["image"] == "batchtune:0.1.0"
    assert operator_container(render("image.tag=1.2.3"))["image"] == "batchtune:1.2.3"
    pushed = operator_container(render("image.repository=registry.example.com/batchtune"))
    assert pushed["image"] == "registry.example.com/batchtune:0.1.0"
    assert "--operator-image=registry.example.com/batchtune:0.1.0" in pushed["args"]


# ---- RBAC ------------------------------------------------------------------------------

def test_cluster_wide_rbac_grants_what_kopf_and_the_operator_need():
    docs = render()
    rules = one(docs, "ClusterRole")["rules"]
    assert grants(rules, "batchtune.io", "batchtunings") == {"get", "list", "watch", "patch"}
    assert grants(rules, "batchtune.io", "batchtunings/status") == {"get", "patch", "update"}
    assert {"create", "patch"} <= grants(rules, "", "events")
    assert grants(rules, "apiextensions.k8s.io", "customresourcedefinitions") == {"list", "watch"}
    assert grants(rules, "", "namespaces") == {"list", "watch"}
    assert grants(rules, "apps", "deployments") == {"get", "list", "watch", "create", "delete", "patch"}
    assert grants(rules, "batch", "jobs") == {"get", "list", "watch", "create", "delete"}
    assert grants(rules, "", "pods") == {"get", "list", "watch"}
    assert grants(rules, "", "pods/log") == {"get"}  # a crashed engine's cause is above its termination message
    assert grants(rules, "apps", "replicasets") == {"get"}  # a trial pod's ReplicaSet must be the trial Deployment's
    assert grants(rules, "", "configmaps") == {"create", "update"}  # the report: created, then replaced
    # Secrets: never cluster-wide; a Role per prometheus.authSecretNamespaces entry (none by default).
    assert not grants(rules, "", "secrets")
    # Roles: only the leader election's, on its Lease.
    assert [d["metadata"]["name"] for d in docs if d["kind"] in ("Role", "RoleBinding")] == ["bt-batchtune-leader"] * 2
    assert grants(rules, "", "nodes") == {"get", "list", "watch"}
    assert grants(rules, "", "services") == {"list"}
    binding = one(docs, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == "bt-batchtune"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "bt-batchtune", "namespace": NAMESPACE}]


def test_namespaced_rbac_has_no_cluster_wide_rights():
    docs = render("watchNamespaces={team-a,team-b}")
    assert not [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    roles = {d["metadata"]["namespace"]: d for d in docs if d["kind"] == "Role" and not d["metadata"]["name"].endswith(
        "-leader")}
    bindings = {d["metadata"]["namespace"]: d for d in docs if d["kind"] == "RoleBinding" and
                not d["metadata"]["name"].endswith("-leader")}
    assert set(roles) == set(bindings) == {"team-a", "team-b"}
    for ns, role in roles.items():
        rules = role["rules"]
        assert grants(rules, "batchtune.io", "batchtunings/status") == {"get", "patch", "update"}
        assert grants(rules, "apps", "deployments") >= {"create", "patch"}
        # Cluster-scoped resources make no sense in a Role and must not be there.
        assert not grants(rules, "", "nodes") and not grants(rules, "", "namespaces")
        assert not grants(rules, "apiextensions.k8s.io", "customresourcedefinitions")
        assert not grants(rules, "", "secrets")
        assert bindings[ns]["subjects"][0]["namespace"] == NAMESPACE
        assert bindings[ns]["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                           "name": "bt-batchtune"}


@pytest.mark.parametrize("sets", [pytest.param(("prometheus.authSecretNamespaces={a}",), id="cluster-wide"),
                                  pytest.param(("watchNamespaces={a}", "prometheus.authSecretNamespaces={a}"),
                                               id="namespaced")])
def test_rbac_is_least_privilege(sets):
    for doc in render(*sets):
        if doc["kind"] not in ("ClusterRole", "Role"):
            continue
        for rule in doc["rules"]:
            assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"], rule
            # Secrets are read one by one (authSecretRef), never listed or watched, and only by the
            # Roles of prometheus.authSecretNamespaces.
            if "secrets" in rule["resources"]:
                assert rule["verbs"] == ["get"] and rule["resources"] == ["secrets"]
                assert doc["kind"] == "Role" and doc["metadata"]["name"].endswith("-prometheus-token")
            # Production is patched, never replaced; Jobs are never changed; nothing escalates or execs.
            assert "update" not in grants([rule], "apps", "deployments")
            assert not grants([rule], "batch", "jobs") & {"update", "patch"}
            assert not any("/" in r and r not in ("batchtunings/status", "pods/log") for r in rule["resources"]), rule
            if "pods/log" in rule["resources"]:
                assert rule["verbs"] == ["get"] and rule["resources"] == ["pods/log"]
            assert not set(rule["verbs"]) & {"escalate", "bind", "impersonate", "deletecollection"}, rule
            # The operator never deletes pods, nor anything in production other than its own trials.
            if "pods" in rule["resources"]:
                assert "delete" not in rule["verbs"]


def test_rbac_rules_are_grouped_as_framework_and_application():
    text = render_text()
    role = text[text.index("kind: ClusterRole\n"):text.index("kind: ClusterRoleBinding")]
    assert "# Framework" in role and "# Application" in role
    assert role.index("# Framework") < role.index("batchtunings/status")
    assert role.index("# Application") < role.index("deployments")


@pytest.mark.parametrize("sets", [
    pytest.param(("prometheus.authSecretNamespaces={a,b}",), id="cluster-wide"),
    pytest.param(("watchNamespaces={a,b,c}", "prometheus.authSecretNamespaces={a,b}"), id="namespaced"),
])
def test_secrets_are_read_only_in_the_auth_secret_namespaces(sets):
    docs = render(*sets)
    roles = {d["metadata"]["namespace"]: d for d in docs
             if d["kind"] == "Role" and d["metadata"]["name"] == "bt-batchtune-prometheus-token"}
    bindings = {d["metadata"]["namespace"]: d for d in docs
                if d["kind"] == "RoleBinding" and d["metadata"]["name"] == "bt-batchtune-prometheus-token"}
    assert set(roles) == set(bindings) == {"a", "b"}
    for ns, role in roles.items():
        assert role["rules"] == [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}]
        assert bindings[ns]["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                           "name": "bt-batchtune-prometheus-token"}
        assert bindings[ns]["subjects"] == [{"kind": "ServiceAccount", "name": "bt-batchtune",
                                             "namespace": NAMESPACE}]
    secret_grants = [d["metadata"]["namespace"] for d in docs if d["kind"] in ("Role", "ClusterRole")
                     and grants(d["rules"], "", "secrets")]
    assert sorted(secret_grants) == ["a", "b"]


def test_a_secret_namespace_the_operator_does_not_watch_is_refused():
    argv = [_helm(), "template", "bt", str(CHART), "--kube-version", KUBE_VERSION.lstrip("v"),
            "--set", "watchNamespaces={a}", "--set", "prometheus.authSecretNamespaces={a,b}"]
    done = subprocess.run(argv, capture_output=True, text=True)
    assert done.returncode != 0
    assert "prometheus.authSecretNamespaces lists b, which watchNamespaces does not" in done.stderr, done.stderr


# ---- the install's bounds on a BatchTuning ----------------------------------------------------

@pytest.mark.parametrize("sets, present", [
    pytest.param((), ["--max-gpu-minutes=2880", "--allowed-prometheus-url=http://prometheus-operated.monitoring.svc:9090/"],
                 id="defaults"),
    pytest.param(("maxGpuMinutesPerTuning=10000000",), ["--max-gpu-minutes=10000000"], id="large-not-exponent"),
    pytest.param(("load.allowedImages={registry.example.com/lg:1,registry.example.com/lg@sha256:" + "b" * 64 + "}",),
                 ["--allowed-load-image=registry.example.com/lg:1",
                  "--allowed-load-image=registry.example.com/lg@sha256:" + "b" * 64], id="load-images"),
    pytest.param(("prometheus.allowedUrls={http://prom.monitoring.svc:9090,https://thanos.example.com/}",),
                 ["--allowed-prometheus-url=http://prom.monitoring.svc:9090",
                  "--allowed-prometheus-url=https://thanos.example.com/"], id="prometheus-urls"),
    pytest.param(("searchSpace.allowedExtraFlags={--dtype,seed}",),
                 ["--allowed-extra-flag=--dtype", "--allowed-extra-flag=seed"], id="extra-flags"),
])
def test_bounds_are_passed_as_operator_flags(sets, present):
    args = operator_container(render(*sets))["args"]
    for arg in present:
        assert arg in args, args
    if not any(s.startswith("load.") for s in sets):
        assert not [a for a in args if a.startswith("--allowed-load-image")], args
    if not any(s.startswith("prometheus.") for s in sets):  # the default names one URL, never "any"
        assert [a for a in args if a.startswith("--allowed-prometheus-url")] == \
            ["--allowed-prometheus-url=http://prometheus-operated.monitoring.svc:9090/"], args


@pytest.mark.parametrize("sets, expected", [((), None), (("prometheus.scrapeIntervalSeconds=2",), "2")])
def test_scrape_interval_is_an_override_only(sets, expected):
    """Unset, the operator reads the interval from Prometheus; set, the value wins."""
    env = {e["name"]: e.get("value") for e in operator_container(render(*sets))["env"]}
    assert env.get("BATCHTUNE_SCRAPE_INTERVAL_SECONDS") == expected


def test_bound_flags_are_ones_the_operator_accepts():
    """Each flag the chart passes parses with `batchtune operator`'s own argument parser."""
    import argparse

    from batchtune.controller import main as cli

    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())
    args = operator_container(render("load.allowedImages={r.example.com/a:1,r.example.com/b:2}",
                                     "prometheus.allowedUrls={http://prom:9090/}",
                                     "maxGpuMinutesPerTuning=90"))["args"]
    ours = [a for a in args if a.startswith(("--allowed-", "--max-gpu-minutes", "--operator-image", "--leader-elect"))]
    parsed = parser.parse_args(["operator", *ours])
    assert parsed.leader_elect and parsed.leader_elect_namespace == NAMESPACE
    assert (parsed.leader_elect_lease_duration, parsed.leader_elect_renew_deadline,
            parsed.leader_elect_retry_period) == (15, 10, 2)
    assert parsed.allowed_load_image == ["r.example.com/a:1", "r.example.com/b:2"]
    assert parsed.allowed_prometheus_url == ["http://prom:9090/"]
    assert parsed.max_gpu_minutes == 90


def test_validate_and_the_operator_read_the_same_values_file():
    """The values file parsed offline gives the Install the operator builds from the flags the chart renders."""
    import argparse

    from batchtune import __version__
    from batchtune.controller import main as operator
    from batchtune.core.install import install_from_environment, install_from_values

    sets = ("load.allowedImages={r.example.com/a:1}", "prometheus.allowedUrls={http://prom:9090/}",
            "git.allowedUrls={https://github.com/acme/}", "maxGpuMinutesPerTuning=90",
            "searchSpace.allowedExtraFlags={--dtype,seed}", "image.tag=7.7")
    values = {"load": {"allowedImages": ["r.example.com/a:1"]}, "prometheus": {"allowedUrls": ["http://prom:9090/"]},
              "git": {"allowedUrls": ["https://github.com/acme/"]}, "maxGpuMinutesPerTuning": 90,
              "searchSpace": {"allowedExtraFlags": ["--dtype", "seed"]}, "image": {"tag": "7.7"}}
    parser = argparse.ArgumentParser()
    operator.add_parser(parser.add_subparsers())
    args = [a for a in operator_container(render(*sets))["args"]
            if a.startswith(("--allowed-", "--max-gpu-minutes", "--operator-image", "--argocd-instance-label"))]
    env = operator.environment(parser.parse_args(["operator", *args]))
    assert install_from_environment(env, __version__) == install_from_values(values, __version__)


# ---- the admission policy -------------------------------------------------------------------------

def test_admission_policy_matches_only_the_operator_and_denies_on_failure():
    docs = render()
    policy = one(docs, "ValidatingAdmissionPolicy")
    binding = one(docs, "ValidatingAdmissionPolicyBinding")
    assert policy["apiVersion"] == binding["apiVersion"] == "admissionregistration.k8s.io/v1"
    assert policy["spec"]["failurePolicy"] == "Fail"
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}
    assert policy["spec"]["matchConditions"] == [{
        "name": "from-the-operator",
        "expression": f"request.userInfo.username == 'system:serviceaccount:{NAMESPACE}:bt-batchtune'"}]
    rules = {(tuple(r["apiGroups"]), tuple(r["resources"])): set(r["operations"])
             for r in policy["spec"]["matchConstraints"]["resourceRules"]}
    assert rules == {(("apps",), ("deployments",)): {"CREATE", "UPDATE", "DELETE"},
                     (("batch",), ("jobs",)): {"CREATE", "UPDATE", "DELETE"},
                     (("",), ("configmaps",)): {"CREATE", "UPDATE"}}
    # Every validation names its reason for the person reading the denial.
    for validation in policy["spec"]["validations"]:
        assert validation.get("message") or validation.get("messageExpression"), validation


def test_admission_policy_follows_the_service_account_name():
    policy = one(render("serviceAccount.name=tuner"), "ValidatingAdmissionPolicy")
    assert "'system:serviceaccount:batchtune-system:tuner'" in policy["spec"]["matchConditions"][0]["expression"]
    policy = one(render("serviceAccount.create=false"), "ValidatingAdmissionPolicy")
    assert "'system:serviceaccount:batchtune-system:default'" in policy["spec"]["matchConditions"][0]["expression"]


def test_admission_policy_needs_kubernetes_1_30():
    argv = [_helm(), "template", "bt", str(CHART), "--kube-version", "1.29.4"]
    done = subprocess.run(argv, capture_output=True, text=True)
    assert done.returncode != 0 and "admissionPolicy.enabled needs Kubernetes 1.30" in done.stderr, done.stderr
    argv += ["--set", "admissionPolicy.enabled=false"]
    assert subprocess.run(argv, capture_output=True, text=True).returncode == 0


# ---- CRD lifecycle ---------------------------------------------------------------------

def test_chart_crd_is_the_source_crd():
    source = [d for d in yaml.safe_load_all((REPO / "crds" / "batchtune.io_batchtunings.yaml").read_text()) if d]
    charted = [d for d in render() if d["kind"] == "CustomResourceDefinition"]
    assert len(source) == len(charted) == 1
    for doc in charted:
        doc["metadata"].pop("labels")
        doc["metadata"].pop("annotations", None)
    assert charted == source


def test_sync_crds_check_passes():
    done = subprocess.run([sys.executable, str(REPO / "hack" / "sync-crds"), "--check"], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("keep, annotated", [pytest.param("true", True, id="keep"),
                                             pytest.param("false", False, id="delete-on-uninstall")])
def test_crd_keep_annotation(keep, annotated):
    crd = one(render(f"crds.keep={keep}"), "CustomResourceDefinition")
    policy = (crd["metadata"].get("annotations") or {}).get("helm.sh/resource-policy")
    assert (policy == "keep") is annotated


# ---- values and their schema -----------------------------------------------------------

@pytest.mark.parametrize("bad_set, complaint", [
    pytest.param("imagetag=1", "imagetag", id="unknown-top-level"),
    pytest.param("image.tga=1", "tga", id="unknown-nested"),
    pytest.param("crds.enabled=yes", "crds", id="wrong-type"),
    pytest.param("watchNamespaces={Not_A_Namespace}", "watchNamespaces", id="invalid-namespace"),
    pytest.param("image.pullPolicy=Sometimes", "pullPolicy", id="enum"),
    pytest.param("health.port=70000", "port", id="port-range"),
    pytest.param("securityContext.privilegd=true", "privilegd", id="typo-in-security-context"),
    pytest.param("rbac.readSecrets=true", "readSecrets", id="removed-read-secrets"),
    pytest.param("admissionPolicy.enable=false", "enable", id="typo-in-admission-policy"),
    pytest.param("load.allowedImage={x}", "allowedImage", id="typo-in-load"),
    pytest.param("load.allowedImages={a;rm -rf}", "allowedImages", id="image-with-shell"),
    pytest.param("prometheus.allowedUrls={http://prom}", "allowedUrls", id="prefix-without-port-or-slash"),
    pytest.param("prometheus.allowedUrls={file:///etc/}", "allowedUrls", id="prefix-not-http"),
    pytest.param("prometheus.authSecretNamespaces={Not_A_Namespace}", "authSecretNamespaces", id="secret-ns"),
    pytest.param("prometheus.url=http://prom:9090", "url", id="unknown-prometheus-key"),
    pytest.param("maxGpuMinutesPerTuning=0", "maxGpuMinutesPerTuning", id="gpu-minutes-zero"),
    pytest.param("maxGpuMinutesPerTuning=1.5", "maxGpuMinutesPerTuning", id="gpu-minutes-fraction"),
    pytest.param("prometheus.scrapeIntervalSeconds=0", "scrapeIntervalSeconds", id="scrape-interval-zero"),
    pytest.param("replicaCount=0", "replicaCount", id="no-replicas"),
    pytest.param("leaderElection.leaseDurationSeconds=1", "leaseDurationSeconds", id="lease-too-short"),
])
def test_schema_rejects_bad_values(bad_set, complaint):
    argv = [_helm(), "template", "bt", str(CHART), "--kube-version", KUBE_VERSION.lstrip("v"), "--set", bad_set]
    done = subprocess.run(argv, capture_output=True, text=True)
    assert done.returncode != 0
    assert complaint in done.stderr, done.stderr


def _object_schemas(node: Any, path: str = "$"):
    if isinstance(node, dict):
        if node.get("type") == "object" or "properties" in node:
            yield path, node
        for key, value in node.items():
            yield from _object_schemas(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _object_schemas(value, f"{path}[{i}]")


def test_schema_closes_every_object():
    schema = json.loads((CHART / "values.schema.json").read_text())
    for path, node in _object_schemas(schema):
        if "properties" in node:
            assert node.get("additionalProperties") is False, f"{path} allows unknown keys"
        elif "$comment" not in node:
            # A map (labels, quantities): its values are typed; only documented pass-through objects stay open.
            assert isinstance(node.get("additionalProperties"), dict), f"{path} is an untyped open object"


def test_default_values_validate_against_the_schema():
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.validate(yaml.safe_load((CHART / "values.yaml").read_text()), schema)


def test_schema_covers_exactly_the_values():
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert set(values) == set(schema["properties"])


# Kubernetes objects passed through as written: their fields are Kubernetes', documented there.
PASS_THROUGH = ("resources", "podSecurityContext", "securityContext", "vllmPodMonitor.selector",
                "grafanaDashboard.labels", "metrics.serviceMonitor.labels", "vllmPodMonitor.labels")


def test_every_value_is_documented_by_a_comment_starting_with_its_name():
    lines = (CHART / "values.yaml").read_text().splitlines()
    stack: list[tuple[int, str]] = []
    undocumented = []
    for i, line in enumerate(lines):
        match = re.match(r"^( *)([A-Za-z][A-Za-z0-9_]*):", line)
        if not match:
            continue
        indent, key = len(match.group(1)), match.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        parent = ".".join(k for _, k in stack)
        path = f"{parent}.{key}" if parent else key
        stack.append((indent, key))
        if any(parent == p or parent.startswith(p + ".") for p in PASS_THROUGH):
            continue
        comment = lines[i - 1].strip() if i else ""
        # The comment block above the key: walk up to its first line.
        j = i - 1
        while j > 0 and lines[j - 1].strip().startswith("#") and lines[j].strip().startswith("#"):
            j -= 1
        first = lines[j].strip() if j >= 0 else ""
        if not (comment.startswith("#") and first.startswith(f"# {key}")):
            undocumented.append(path)
    assert not undocumented, f"values without a comment starting with their name: {undocumented}"


# ---- optional objects ------------------------------------------------------------------

def test_service_monitor_scrapes_the_metrics_port():
    docs = render("metrics.serviceMonitor.enabled=true", "metrics.serviceMonitor.labels.release=prom")
    monitor = one(docs, "ServiceMonitor")
    service = one(docs, "Service")
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert service["spec"]["selector"].items() <= \
        one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"].items()


@pytest.mark.parametrize("sets, namespace_selector", [
    pytest.param((), {"any": True}, id="all-namespaces"),
    pytest.param(("vllmPodMonitor.namespaces={inference}",), {"matchNames": ["inference"]}, id="listed"),
])
def test_vllm_pod_monitor(sets, namespace_selector):
    monitor = one(render("vllmPodMonitor.enabled=true", *sets), "PodMonitor")
    assert monitor["spec"]["namespaceSelector"] == namespace_selector
    assert monitor["spec"]["podMetricsEndpoints"] == [{"port": "http", "path": "/metrics", "interval": "5s"}]
    assert monitor["spec"]["selector"] == {"matchLabels": {"app.kubernetes.io/component": "vllm"}}


def dashboard_exprs() -> list[str]:
    cm = one(render("grafanaDashboard.enabled=true"), "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(cm["data"]["batchtune.json"])
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    return [t["expr"] for p in dashboard["panels"] for t in p["targets"]]


def test_grafana_dashboard_reads_the_vllm_and_gpu_series():
    exprs = " ".join(dashboard_exprs())
    assert "DCGM_FI_DEV_GPU_UTIL" in exprs
    assert "histogram_quantile(0.95" in exprs and "vllm:inter_token_latency_seconds_bucket" in exprs


def test_grafana_dashboard_reads_every_operator_metric_and_only_those():
    """Each of the operator's own metrics (controller/telemetry.py) has a panel, and no panel names one it lacks."""
    from prometheus_client import REGISTRY

    from batchtune.controller import telemetry  # noqa: F401  # registers the operator's metrics

    ours = {m.name for m in REGISTRY.collect() if m.name.startswith("batchtune_")}
    assert {"batchtune_reconcile_seconds", "batchtune_trials", "batchtune_leader"} <= ours
    read = set()
    for expr in dashboard_exprs():
        read |= {re.sub(r"_(bucket|count|sum|total)$", "", n) for n in re.findall(r"batchtune_[a-z_]+", expr)}
    assert read == ours, f"without a panel: {sorted(ours - read)}; unknown: {sorted(read - ours)}"


# ---- manifests/ ------------------------------------------------------------------------

def test_manifests_match_the_chart_byte_for_byte(tmp_path):
    env = dict(os.environ, HELM=_helm())
    done = subprocess.run([sys.executable, str(REPO / "hack" / "render-manifests"), "--out", str(tmp_path)],
                          capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    rendered = sorted(p.name for p in tmp_path.iterdir())
    assert rendered == ["install-namespaced.yaml", "install.yaml"]
    stale = [name for name in rendered
             if (tmp_path / name).read_bytes() != (REPO / "manifests" / name).read_bytes()]
    assert not stale, f"manifests/{stale} drifted from the chart: run hack/render-manifests"


def test_install_manifest_creates_its_namespace_first():
    docs = [d for d in yaml.safe_load_all((REPO / "manifests" / "install.yaml").read_text()) if d]
    assert docs[0] == {"apiVersion": "v1", "kind": "Namespace",
                       "metadata": {"name": NAMESPACE, "labels": {"app.kubernetes.io/part-of": "batchtune"}}}
    assert {d["metadata"].get("namespace") for d in docs if d["kind"] in ("Deployment", "ServiceAccount")} == \
        {NAMESPACE}


def test_api_reference_is_generated_from_the_crd():
    done = subprocess.run([sys.executable, str(REPO / "hack" / "gen-reference"), "--check"], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    reference = (REPO / "docs" / "reference.md").read_text()
    crd = yaml.safe_load((REPO / "crds" / "batchtune.io_batchtunings.yaml").read_text().split("\n---\n", 1)[-1])
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    for field in spec:
        assert f"`spec.{field}`" in reference, field
