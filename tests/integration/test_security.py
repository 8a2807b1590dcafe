"""The security boundary on the local cluster: the operator's RBAC as `kubectl auth can-i` measures it
(both install modes, rendered from the chart), the chart's ValidatingAdmissionPolicy on the real API
server (requests impersonate the operator's ServiceAccount, objects come from the operator's own
builders), and the load Job under the `restricted` Pod Security profile.

Nothing here runs the operator: the chart's RBAC and policy objects are applied as `helm template`
renders them, and requests are sent as the ServiceAccount with `kubectl --as=system:serviceaccount:...`.
Run: `.venv/bin/python -m pytest tests/integration/test_security.py -s` (-s prints the matrix).
"""

from __future__ import annotations

import json
import secrets
import subprocess
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

import batchtune_local as lc

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "batchtune"
KUBE_VERSION = "1.36.3"
POLICY_DENIED = "ValidatingAdmissionPolicy"


def render(release: str, namespace: str, *sets: str, show: tuple[str, ...]) -> list[dict[str, Any]]:
    argv = [str(lc.binaries().helm), "template", release, str(CHART), "--namespace", namespace,
            "--kube-version", KUBE_VERSION]
    for s in sets:
        argv += ["--set", s]
    for template in show:
        argv += ["--show-only", f"templates/{template}"]
    done = subprocess.run(argv, capture_output=True, text=True, check=True)
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def create_namespace(kube: Any, name: str, labels: dict[str, str] | None = None) -> None:
    from kubernetes import client

    kube.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(
        name=name, labels={"batchtune.io/test": "true", **(labels or {})})))
    lc.wait_for(lambda: kube.core.read_namespaced_service_account("default", name), timeout=30,
                what=f"ServiceAccount default in namespace {name}")


@pytest.fixture
def installed(kubectl: Callable[..., subprocess.CompletedProcess[str]]) -> Iterator[Callable[..., str]]:
    """`installed(release, namespace, *sets, show=...)`: applies the rendered objects, returns the
    ServiceAccount's user name; the cluster-scoped objects are deleted afterwards (namespaced ones go
    with their namespaces)."""
    applied: list[dict[str, Any]] = []

    def install(release: str, namespace: str, *sets: str, show: tuple[str, ...]) -> str:
        docs = render(release, namespace, *sets, show=show)
        kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))
        applied.extend(d for d in docs if "namespace" not in d["metadata"])
        return f"system:serviceaccount:{namespace}:{release}-batchtune"

    yield install
    if applied:
        kubectl("delete", "--ignore-not-found", "--wait=false", "-f", "-", input=yaml.safe_dump_all(applied),
                check=False)


# ---- (i) the RBAC matrix ---------------------------------------------------------------------

@dataclass(frozen=True)
class Right:
    """One `kubectl auth can-i` question and the answer each install mode must give."""

    verb: str
    resource: str
    where: str
    """W: a watched namespace, S: a watched namespace listed in prometheus.authSecretNamespaces,
    O: a namespace a namespaced install does not watch, "-": cluster-scoped / all namespaces."""
    cluster_wide: bool
    namespaced: bool
    why: str


def _need(verb: str, resource: str, why: str, where: str = "W") -> Right:
    return Right(verb, resource, where, True, True, why)


def _never(verb: str, resource: str, why: str, where: str = "W") -> Right:
    return Right(verb, resource, where, False, False, why)


RIGHTS: tuple[Right, ...] = (
    # What the operator needs (kopf's framework, then tuning).
    *(_need(v, "batchtunings.batchtune.io", "kopf watches BatchTunings, keeps its finalizer")
      for v in ("get", "list", "watch", "patch")),
    _need("patch", "batchtunings.batchtune.io/status", "status is the operator's output"),
    _need("update", "batchtunings.batchtune.io/status", "status is the operator's output"),
    _need("create", "events", "Events on transitions"),
    _need("create", "events.events.k8s.io", "Events on transitions"),
    *(_need(v, "deployments.apps", "trial Deployments; production is read and patched")
      for v in ("get", "list", "watch", "create", "patch", "delete")),
    *(_need(v, "jobs.batch", "load-generator Jobs") for v in ("get", "list", "watch", "create", "delete")),
    *(_need(v, "pods", "trial pods: IPs, failures") for v in ("get", "list", "watch")),
    _need("get", "pods/log", "a crashed trial's engine log: the cause vLLM prints above the termination message"),
    _need("get", "replicasets.apps", "a trial pod counts only when its ReplicaSet is the trial Deployment's (uid)"),
    _never("list", "replicasets.apps", "a trial pod's ReplicaSet is read by name, never listed"),
    _need("list", "services", "a trial keeps no label a Service selects"),
    *(_need(v, "configmaps", "the <bt>-report ConfigMap: created, then replaced") for v in ("create", "update")),
    _need("get", "secrets", "authSecretRef, listed namespace only", where="S"),
    Right("list", "batchtunings.batchtune.io", "-", True, False, "cluster-wide watch"),
    Right("create", "deployments.apps", "O", True, False, "a namespaced install stays in its namespaces"),
    Right("list", "nodes", "-", True, False, "GPU capacity (cluster-wide only)"),
    Right("watch", "nodes", "-", True, False, "GPU capacity (cluster-wide only)"),
    Right("list", "namespaces", "-", True, False, "kopf namespace discovery (cluster-wide only)"),
    Right("list", "customresourcedefinitions.apiextensions.k8s.io", "-", True, False, "kopf CRD discovery"),
    # What it must never be able to do.
    _never("get", "secrets", "Secrets only in prometheus.authSecretNamespaces"),
    _never("get", "secrets", "Secrets only in prometheus.authSecretNamespaces", where="O"),
    _never("list", "secrets", "Secrets are read by name, never listed", where="S"),
    _never("watch", "secrets", "Secrets are read by name, never watched", where="S"),
    _never("create", "pods", "pods come only from its Deployments and Jobs"),
    _never("delete", "pods", "it never deletes pods"),
    _never("create", "pods/exec", "no exec into production"),
    _never("create", "pods/attach", "no attach"),
    _never("create", "pods/portforward", "no port-forward"),
    _never("create", "batchtunings.batchtune.io", "BatchTunings are their authors'"),
    _never("update", "batchtunings.batchtune.io", "only kopf's patch (finalizer, annotations)"),
    _never("delete", "batchtunings.batchtune.io", "BatchTunings are their authors'"),
    _never("deletecollection", "batchtunings.batchtune.io", "BatchTunings are their authors'"),
    _never("update", "deployments.apps", "production is patched, never replaced"),
    _never("deletecollection", "deployments.apps", "deletes one owned Deployment at a time"),
    _never("patch", "deployments.apps/scale", "never scales production"),
    _never("update", "deployments.apps/status", "not its status"),
    _never("update", "jobs.batch", "Jobs are created and deleted, never changed"),
    _never("patch", "jobs.batch", "Jobs are created and deleted, never changed"),
    _never("delete", "configmaps", "keeps reports"),
    _never("get", "configmaps", "never reads a ConfigMap"),
    _never("list", "configmaps", "never reads a ConfigMap"),
    _never("patch", "configmaps", "replaces its report whole"),
    _never("get", "services", "only lists selectors"),
    _never("create", "services", "routes nothing"),
    _never("create", "serviceaccounts/token", "mints no tokens"),
    _never("create", "serviceaccounts", "creates no identities"),
    _never("create", "rolebindings.rbac.authorization.k8s.io", "grants nothing"),
    _never("create", "clusterrolebindings.rbac.authorization.k8s.io", "grants nothing", where="-"),
    _never("escalate", "clusterroles.rbac.authorization.k8s.io", "no RBAC escalation", where="-"),
    _never("bind", "clusterroles.rbac.authorization.k8s.io", "no RBAC escalation", where="-"),
    _never("impersonate", "serviceaccounts", "no impersonation"),
    _never("impersonate", "users", "no impersonation", where="-"),
    _never("create", "namespaces", "no namespaces", where="-"),
    _never("delete", "namespaces", "no namespaces", where="-"),
    _never("update", "nodes", "never touches nodes", where="-"),
    _never("patch", "nodes/status", "never touches nodes", where="-"),
    _never("create", "certificatesigningrequests.certificates.k8s.io", "no certificates", where="-"),
    _never("delete", "validatingadmissionpolicies.admissionregistration.k8s.io", "cannot lift its own policy",
           where="-"),
    _never("update", "validatingadmissionpolicybindings.admissionregistration.k8s.io",
           "cannot lift its own policy", where="-"),
    _never("update", "customresourcedefinitions.apiextensions.k8s.io", "the CRD is the chart's", where="-"),
)


def can_i(kubectl: Callable[..., subprocess.CompletedProcess[str]], user: str, right: Right,
          namespaces: dict[str, str]) -> bool:
    resource, _, subresource = right.resource.partition("/")
    argv = ["auth", "can-i", right.verb, resource, f"--as={user}"]
    if subresource:
        argv.append(f"--subresource={subresource}")
    argv += ["--all-namespaces"] if right.where == "-" else ["-n", namespaces[right.where]]
    done = kubectl(*argv, check=False)
    answer = done.stdout.strip()
    assert answer in ("yes", "no"), f"kubectl {' '.join(argv)}: {done.stdout} {done.stderr}"
    return answer == "yes"


def matrix_table(measured: dict[str, dict[Right, bool]]) -> str:
    def cell(right: Right, mode: str) -> str:
        expected = right.cluster_wide if mode == "cluster-wide" else right.namespaced
        got = measured[mode][right]
        return ("yes" if got else "no") + ("" if got == expected else " (WRONG)")

    lines = ["| verb | resource | where | cluster-wide | namespaced | why |", "|---|---|---|---|---|---|"]
    for r in RIGHTS:
        lines.append(f"| {r.verb} | {r.resource} | {r.where} | {cell(r, 'cluster-wide')} | "
                     f"{cell(r, 'namespaced')} | {r.why} |")
    return "\n".join(lines)


def test_operator_rbac_can_i_matrix(kube, kubectl, namespace, installed, batchtuning_crd, wait_for):
    """Both install modes, from the chart: every right the operator needs, none it must not have."""
    spaces = {"W": f"{namespace}-w"[:63], "S": f"{namespace}-s"[:63], "O": f"{namespace}-o"[:63]}
    for name in spaces.values():
        create_namespace(kube, name)
    try:
        modes = {
            "cluster-wide": (f"prometheus.authSecretNamespaces={{{spaces['S']}}}",),
            "namespaced": (f"watchNamespaces={{{spaces['W']},{spaces['S']}}}",
                           f"prometheus.authSecretNamespaces={{{spaces['S']}}}"),
        }
        measured: dict[str, dict[Right, bool]] = {}
        for mode, sets in modes.items():
            user = installed(f"bt-{secrets.token_hex(3)}", namespace, *sets, show=("rbac.yaml",))
            probe = _need("get", "secrets", "", where="S")
            wait_for(lambda u=user, p=probe: can_i(kubectl, u, p, spaces), timeout=15,
                     what=f"the {mode} bindings to take effect")
            with ThreadPoolExecutor(4) as pool:
                answers = pool.map(lambda r, u=user: can_i(kubectl, u, r, spaces), RIGHTS)
                measured[mode] = dict(zip(RIGHTS, answers, strict=True))
        print(f"\n`kubectl auth can-i ... --as=<the chart's ServiceAccount>` (W={spaces['W']}, "
              f"S={spaces['S']}, O={spaces['O']}):\n{matrix_table(measured)}")
        wrong = [f"{mode}: {r.verb} {r.resource} in {r.where} is {'allowed' if got else 'denied'}"
                 for mode, answers in measured.items() for r, got in answers.items()
                 if got != (r.cluster_wide if mode == "cluster-wide" else r.namespaced)]
        assert not wrong, "\n".join(wrong)
    finally:
        for name in spaces.values():
            kube.core.delete_namespace(name)


# ---- (ii) the admission policy -----------------------------------------------------------------

def production(namespace: str, name: str = "llm") -> dict[str, Any]:
    """A production Deployment (no replicas: admission is what is tested, not the pods)."""
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace, "labels": {"app": name},
                     "annotations": {"team": "inference"}},
        "spec": {
            "replicas": 0, "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {"containers": [
                    {"name": "vllm", "image": "vllm/vllm-openai:v0.11.0",
                     "args": ["meta-llama/Llama-3.1-8B-Instruct", "--max-num-seqs", "128"],
                     "env": [{"name": "HF_HOME", "value": "/cache"}],
                     "resources": {"limits": {"nvidia.com/gpu": "1"}}},
                    {"name": "sidecar", "image": "busybox:1.36", "command": ["sleep", "infinity"]}]},
            },
        },
    }


@dataclass
class AsOperator:
    kubectl: Callable[..., subprocess.CompletedProcess[str]]
    user: str
    namespace: str

    def __call__(self, *args: str, input: Any = None) -> subprocess.CompletedProcess[str]:
        text = json.dumps(input) if isinstance(input, dict) else input
        return self.kubectl(f"--as={self.user}", "-n", self.namespace, *args, input=text, check=False)

    def allowed(self, *args: str, input: Any = None) -> None:
        done = self(*args, input=input)
        assert done.returncode == 0, f"{' '.join(args)} was refused: {done.stderr}"

    def denied(self, *args: str, input: Any = None, says: str = "") -> str:
        done = self(*args, input=input)
        assert done.returncode != 0, f"{' '.join(args)} was allowed: {done.stdout}"
        assert POLICY_DENIED in done.stderr and says in done.stderr, done.stderr
        return done.stderr


@pytest.fixture
def as_operator(kube, kubectl, namespace, installed, batchtuning_crd, wait_for) -> AsOperator:
    """The chart's ClusterRole and admission policy for a fresh release in `namespace`; requests as its
    ServiceAccount. Ready once the policy refuses an unlabelled Deployment (RBAC lets it through)."""
    user = installed(f"bt-{secrets.token_hex(3)}", namespace,
                     show=("rbac.yaml", "admission-policy.yaml"))
    operator = AsOperator(kubectl, user, namespace)

    def enforced() -> bool:
        done = operator("create", "--dry-run=server", "-f", "-", input=production(namespace, "probe"))
        return done.returncode != 0 and POLICY_DENIED in done.stderr
    wait_for(enforced, timeout=30, interval=0.5, what="the ValidatingAdmissionPolicy to be enforced")
    return operator


def bench_job(namespace: str, uid: str, name: str) -> dict[str, Any]:
    """The VllmBench Job as the operator builds it: `vllm bench serve` from production's image in an init
    container, summarised by the operator image."""
    from batchtune.core.manifests import LoadProfile, build_bench_job
    from batchtune.engines import VLLM

    job = build_bench_job(VLLM, "tune", uid, namespace, 0, name, image="vllm/vllm-openai:v0.11.0",
                          operator_image="batchtune:0.1.0", base_url="http://127.0.0.1:9", model="m",
                          tokenizer=None, profile=LoadProfile(concurrency=1, duration_seconds=1, warmup_seconds=0))
    job["spec"]["suspend"] = True
    return job


def batchtuning(kube, namespace: str) -> dict[str, Any]:
    return kube.custom.create_namespaced_custom_object("batchtune.io", "v1alpha1", namespace, "batchtunings", {
        "apiVersion": "batchtune.io/v1alpha1", "kind": "BatchTuning", "metadata": {"name": "tune"},
        "spec": {"targetRef": {"name": "llm"}, "searchSpace": {"maxNumSeqs": {"values": [8, 16]}},
                 "slo": {"interTokenLatencyMilliseconds": 50}, "prometheus": {"url": "http://127.0.0.1:1"}}})


def test_admission_policy_bounds_the_operator(kube, kubectl, namespace, as_operator):
    from batchtune.core.manifests import (
        LoadProfile,
        build_load_job,
        build_trial_deployment,
        owner_reference,
        trial_labels,
    )
    from batchtune.core.production import ANNOTATION_APPLIED, ANNOTATION_APPLIED_AT, AppliedMark, args_patch
    from batchtune.core.recommend import ContainerArgs

    kubectl("apply", "-f", "-", input=json.dumps(production(namespace)))
    bt = batchtuning(kube, namespace)
    owner = owner_reference("tune", bt["metadata"]["uid"])

    # CREATE: an unlabelled Deployment is refused; one labelled and owned like a trial is admitted.
    as_operator.denied("create", "-f", "-", input=production(namespace, "rogue"), says="creates only")
    labelled_only = production(namespace, "half")
    labelled_only["metadata"]["labels"] = trial_labels("tune", 0, "trial")
    as_operator.denied("create", "-f", "-", input=labelled_only, says="creates only")
    trial = production(namespace, "tune-trial-0")
    trial["metadata"]["labels"] = trial_labels("tune", 0, "trial")
    trial["metadata"]["ownerReferences"] = [owner]
    as_operator.allowed("create", "-f", "-", input=trial)

    # UPDATE of production: image, replicas, env, a foreign annotation, labels are refused.
    def rv() -> str:
        return kube.apps.read_namespaced_deployment("llm", namespace).metadata.resource_version
    for patch, field in (
            ({"spec": {"template": {"spec": {"containers": [{"name": "vllm", "image": "evil/vllm:latest"}]}}}},
             "containers[vllm]"),
            ({"spec": {"replicas": 4}}, "spec.replicas"),
            ({"spec": {"template": {"spec": {"containers": [
                {"name": "vllm", "env": [{"name": "HF_HOME", "value": "/tmp"}]}]}}}}, "containers[vllm]"),
            ({"spec": {"template": {"spec": {"serviceAccountName": "admin"}}}}, "serviceAccountName"),
            ({"spec": {"template": {"metadata": {"labels": {"app": "llm", "x": "y"}}}}}, "spec.template.metadata"),
            ({"metadata": {"annotations": {"team": None}}}, "metadata.annotations[team]"),
            ({"metadata": {"labels": {"app.kubernetes.io/managed-by": "batchtune"}}}, "metadata.labels")):
        as_operator.denied("patch", "deployment", "llm", "--type=strategic", "-p", json.dumps(patch), says=field)

    # ... while the operator's own patch (args_patch: command/args and its two annotations, at a
    # resourceVersion) is admitted, and so is the annotation-only mark update.
    now = datetime.now(UTC)
    before = ContainerArgs.of(production(namespace)["spec"]["template"]["spec"]["containers"][0])
    after = ContainerArgs(None, ("meta-llama/Llama-3.1-8B-Instruct", "--max-num-seqs", "64"))
    mark = AppliedMark("tune", bt["metadata"]["uid"], 1, "vllm", before, after, now)
    def patched_at_rv(make: Callable[[str], dict[str, Any]]) -> None:
        # The Deployment controller writes status too: on a Conflict read again, as the operator does.
        for _ in range(10):
            done = as_operator("patch", "deployment", "llm", "--type=strategic", "-p", json.dumps(make(rv())))
            if "Conflict" not in done.stderr:
                break
        assert done.returncode == 0, done.stderr

    patched_at_rv(lambda v: args_patch("vllm", after, {
        ANNOTATION_APPLIED: mark.to_annotation(), ANNOTATION_APPLIED_AT: now.strftime("%Y-%m-%dT%H:%M:%SZ")}, v))
    changed = kube.api.sanitize_for_serialization(kube.apps.read_namespaced_deployment("llm", namespace))
    assert changed["spec"]["template"]["spec"]["containers"][0]["args"][-1] == "64"
    assert changed["metadata"]["generation"] == 2
    patched_at_rv(lambda v: {"metadata": {"resourceVersion": v,
                                          "annotations": {ANNOTATION_APPLIED: mark.to_annotation()}}})
    patched_at_rv(lambda v: args_patch("vllm", ContainerArgs(("vllm", "serve"), after.args), {}, v))

    # Someone else (the admin here) is not bound by the policy.
    kubectl("-n", namespace, "patch", "deployment", "llm", "-p", json.dumps({"metadata": {"annotations": {
        "team": "platform"}}}))

    # DELETE: production is refused, the operator's own trial is admitted.
    as_operator.denied("delete", "deployment", "llm", "--wait=false", says="deletes only")
    as_operator.allowed("delete", "deployment", "tune-trial-0", "--wait=false")

    # Jobs: the load Job as built is admitted; with a token, as root, or unlabelled it is refused.
    def load_job(name: str) -> dict[str, Any]:
        job = build_load_job("tune", bt["metadata"]["uid"], namespace, 0, name, image="batchtune:0.1.0",
                             base_url="http://127.0.0.1:1", model="m",
                             profile=LoadProfile(concurrency=1, duration_seconds=1, warmup_seconds=0))
        job["spec"]["suspend"] = True  # admission is what is tested: no pod needed
        return job
    as_operator.allowed("create", "-f", "-", input=load_job("tune-trial-0-s0r0a0"))
    as_operator.allowed("create", "-f", "-", input=bench_job(namespace, bt["metadata"]["uid"], "tune-trial-0-s1r0a0"))
    token = load_job("with-token")
    token["spec"]["template"]["spec"]["automountServiceAccountToken"] = True
    as_operator.denied("create", "-f", "-", input=token, says="without a ServiceAccount token")
    default_token = load_job("default-token")
    del default_token["spec"]["template"]["spec"]["automountServiceAccountToken"]
    as_operator.denied("create", "-f", "-", input=default_token, says="without a ServiceAccount token")
    projected = load_job("projected-token")
    projected["spec"]["template"]["spec"]["volumes"].append(
        {"name": "token", "projected": {"sources": [{"serviceAccountToken": {"path": "token"}}]}})
    as_operator.denied("create", "-f", "-", input=projected, says="without a ServiceAccount token")
    root = load_job("as-root")
    root["spec"]["template"]["spec"]["securityContext"] = {"runAsUser": 0}
    root["spec"]["template"]["spec"]["containers"][0]["securityContext"] = {"allowPrivilegeEscalation": False}
    as_operator.denied("create", "-f", "-", input=root, says="non-root")
    unowned = load_job("unowned")
    del unowned["metadata"]["ownerReferences"]
    as_operator.denied("create", "-f", "-", input=unowned, says="creates only")
    as_operator.allowed("delete", "job", "tune-trial-0-s0r0a0", "--wait=false")

    # ConfigMaps: the report (as the operator builds it) is created and replaced; a ConfigMap someone
    # else wrote is not overwritten, and no other name is written.
    from batchtune.controller.reports import configmap

    report = configmap(namespace, "tune", bt["metadata"]["uid"], bt["spec"], {}, None)
    as_operator.allowed("create", "-f", "-", input=report)
    report["data"]["trials.csv"] = "index\n"
    as_operator.allowed("replace", "-f", "-", input=report)
    kubectl("-n", namespace, "create", "configmap", "other-report", "--from-literal=k=v")
    foreign = configmap(namespace, "other", bt["metadata"]["uid"], bt["spec"], {}, None)
    as_operator.denied("replace", "-f", "-", input=foreign, says="never overwrites")
    misnamed = configmap(namespace, "tune", bt["metadata"]["uid"], bt["spec"], {}, None)
    misnamed["metadata"]["name"] = "coredns"
    as_operator.denied("create", "-f", "-", input=misnamed, says="writes only report ConfigMaps")

    # A trial built by the operator's own builder from production is admitted too.
    from batchtune.core.settings import Setting
    from batchtune.engines import find_engine_container

    target = kube.api.sanitize_for_serialization(kube.apps.read_namespaced_deployment("llm", namespace))
    engine, container = find_engine_container(target["spec"]["template"]["spec"], "vllm")
    built = build_trial_deployment(engine, target, container, "tune", bt["metadata"]["uid"], namespace, 1,
                                   Setting(16, 90))
    as_operator.allowed("create", "-f", "-", input=built)
    as_operator.allowed("delete", "deployment", built["metadata"]["name"], "--wait=false")


# ---- (iii) the load Job under Pod Security `restricted` --------------------------------------------

def test_load_job_is_admitted_under_restricted_pod_security(kube, kubectl, namespace, wait_for):
    from batchtune.core.manifests import LoadProfile, build_load_job

    restricted = f"{namespace}-r"[:63]
    create_namespace(kube, restricted, {"pod-security.kubernetes.io/enforce": "restricted",
                                        "pod-security.kubernetes.io/enforce-version": "latest",
                                        "pod-security.kubernetes.io/warn": "restricted"})
    try:
        def job(name: str) -> dict[str, Any]:
            return build_load_job("tune", "00000000-0000-4000-8000-000000000001", restricted, 0, name,
                                  image="batchtune:0.1.0", base_url="http://127.0.0.1:9", model="m",
                                  profile=LoadProfile(concurrency=1, duration_seconds=1, warmup_seconds=0))

        def as_pod(j: dict[str, Any]) -> dict[str, Any]:
            return {"apiVersion": "v1", "kind": "Pod",
                    "metadata": {"name": j["metadata"]["name"], "namespace": restricted},
                    "spec": j["spec"]["template"]["spec"]}

        good = job("load-restricted")
        # No ownerReference: its owner does not exist here, and the garbage collector would delete it.
        del good["metadata"]["ownerReferences"]
        done = kubectl("create", "-f", "-", input=json.dumps(good))
        assert "PodSecurity" not in done.stderr, done.stderr
        pod = kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(as_pod(good)), check=False)
        assert pod.returncode == 0, pod.stderr
        # The Job controller's pod passes `enforce: restricted` (it need not run to completion).
        wait_for(lambda: kube.core.list_namespaced_pod(
            restricted, label_selector="batch.kubernetes.io/job-name=load-restricted").items, timeout=60,
            what="the restricted Job's pod to be admitted")

        # The VllmBench Job (production's image in an init container) passes too.
        bench = bench_job(restricted, "00000000-0000-4000-8000-000000000001", "bench-restricted")
        del bench["metadata"]["ownerReferences"]
        done = kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(bench))
        assert "PodSecurity" not in done.stderr, done.stderr
        pod = kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(as_pod(bench)), check=False)
        assert pod.returncode == 0, pod.stderr

        bad = job("load-unrestricted")
        del bad["metadata"]["ownerReferences"]
        spec = bad["spec"]["template"]["spec"]
        spec.pop("securityContext")
        spec["containers"][0].pop("securityContext")
        # Pod Security enforces on pods; a Job is admitted with a warning, and its pods are refused.
        done = kubectl("create", "-f", "-", input=json.dumps(bad))
        assert 'would violate PodSecurity "restricted:latest"' in done.stderr, done.stderr
        pod = kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(as_pod(bad)), check=False)
        assert pod.returncode != 0 and 'violates PodSecurity "restricted:latest"' in pod.stderr, pod.stderr

        def refused() -> bool:
            events = kube.core.list_namespaced_event(
                restricted, field_selector="involvedObject.name=load-unrestricted").items
            return any(e.reason == "FailedCreate" and "PodSecurity" in (e.message or "") for e in events)
        wait_for(refused, timeout=60, what="the Job controller's pod to be refused by Pod Security")
        assert not kube.core.list_namespaced_pod(
            restricted, label_selector="batch.kubernetes.io/job-name=load-unrestricted").items
    finally:
        kube.core.delete_namespace(restricted)
