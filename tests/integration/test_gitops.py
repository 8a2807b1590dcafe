"""GitOps on the local cluster: detection on objects real tools wrote, and PullRequest mode end to end.

- Detection reads managedFields as the API server records them: `helm install` (the real Helm 3.22
  binary), `kubectl apply` client-side, and server-side applies under Argo CD's and Flux's field
  manager names (`argocd-controller`, `kustomize-controller`: the names their sources use; Argo CD and
  Flux themselves do not run here) with their tracking marks.
- PullRequest mode: the operator (as its least-privilege user) tunes a twin-backed production, writes
  the decision to a real Git server on loopback (git http-backend), and never patches production;
  the test merges the branch and plays Argo CD (server-side apply of the merged manifest as
  argocd-controller); the operator sees production run it and verifies.
"""

from __future__ import annotations

import base64
import json
import subprocess

import pytest
import yaml
from operator_env import (
    PRODUCTION_ARGS,
    Traffic,
    batchtuning,
    condition,
    get_bt,
    grant_operator_rbac,
    production,
    running_operator,
    wait_phase,
)

import batchtune_local as lc
from batchtune.core.gitops import Manager, detect
from batchtune_local.gitserver import GitServer

pytestmark = [pytest.mark.integration]

USER, TOKEN = "batchtune", "integration-s3cret"


def live(kube, namespace: str, name: str) -> dict:
    return kube.api.sanitize_for_serialization(kube.apps.read_namespaced_deployment(name, namespace))


def parked(namespace: str, name: str, labels: dict | None = None, annotations: dict | None = None) -> dict:
    """A production-shaped Deployment with no replicas (detection needs only its metadata)."""
    dep = production(namespace, name, labels=labels)
    dep["spec"]["replicas"] = 0
    if annotations:
        dep["metadata"]["annotations"] = annotations
    return dep


@pytest.mark.timeout(120)
def test_detection_on_objects_the_real_tools_wrote(cluster, kube, kubectl, namespace, tmp_path):
    # Helm: a chart of one Deployment, installed by the real helm binary.
    chart = tmp_path / "chart"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: vllm\nversion: 0.1.0\n")
    dep = parked(namespace, "helmed", labels={"app.kubernetes.io/instance": "{{ .Release.Name }}",
                                              "app.kubernetes.io/managed-by": "{{ .Release.Service }}"})
    (chart / "templates" / "deployment.yaml").write_text(yaml.safe_dump(dep))
    helm = lc.binaries().helm
    subprocess.run([str(helm), "install", "llm", str(chart), "-n", namespace, "--kubeconfig",
                    str(cluster.admin_kubeconfig)], check=True, capture_output=True, text=True, timeout=60)
    found = detect(live(kube, namespace, "helmed"), "vllm")
    assert found.managers == (Manager.HELM,), found.describe()
    text = found.describe()
    assert "annotation meta.helm.sh/release-name=llm" in text and "managedFields manager helm (Update)" in text
    assert found.primary is not None and found.primary.owns_args is True

    # kubectl apply (client-side): nobody re-applies it.
    kubectl("apply", "-f", "-", input=yaml.safe_dump(parked(namespace, "plain")))
    assert not detect(live(kube, namespace, "plain"), "vllm")

    # Argo CD's server-side sync with annotation tracking, under its field manager name.
    argo = parked(namespace, "argo", annotations={"argocd.argoproj.io/tracking-id": f"llm:apps/Deployment:{namespace}/argo"})
    kubectl("apply", "--server-side", "--field-manager=argocd-controller", "-f", "-", input=yaml.safe_dump(argo))
    found = detect(live(kube, namespace, "argo"), "vllm")
    assert found.managers == (Manager.ARGO_CD,) and "managedFields manager argocd-controller (Apply)" in found.describe()
    assert found.primary is not None and found.primary.owns_args is True

    # Flux kustomize-controller: owner labels, server-side apply.
    flux = parked(namespace, "flux", labels={"kustomize.toolkit.fluxcd.io/name": "apps",
                                             "kustomize.toolkit.fluxcd.io/namespace": "flux-system"})
    kubectl("apply", "--server-side", "--field-manager=kustomize-controller", "-f", "-", input=yaml.safe_dump(flux))
    found = detect(live(kube, namespace, "flux"), "vllm")
    assert found.managers == (Manager.FLUX,) and "managedFields manager kustomize-controller (Apply)" in found.describe()


@pytest.fixture
def git_server(tmp_path):
    with GitServer(tmp_path / "git", (USER, TOKEN)) as server:
        yield server


@pytest.fixture
def git_operator(cluster, kube, kubectl, namespace, batchtuning_crd, git_server, tmp_path):
    grant_operator_rbac(kubectl)
    # The credentials Secret's namespace is one the install may read Secrets in (the chart's Role).
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": {"name": "batchtune-secrets", "namespace": namespace},
            "rules": [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}]}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": {"name": "batchtune-secrets", "namespace": namespace},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "batchtune-secrets"},
               "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "batchtune-operator"}]}
    kubectl("apply", "-f", "-", input=yaml.safe_dump_all([role, binding]))
    (tmp_path / "logs").mkdir()
    yield from running_operator(cluster.operator_kubeconfig, kube, namespace, tmp_path / "logs",
                                ("--allowed-git-url", git_server.base_url))


@pytest.mark.slow
@pytest.mark.timeout(600)  # above its waits: 90 s for production, 240 s for the decision, 150 s to verify
def test_pull_request_mode_ends_with_a_branch_of_exactly_the_knob_change(kube, kubectl, namespace, git_operator,
                                                                         git_server, prometheus_url, wait_for):
    dep = production(namespace)
    manifest = "# production vLLM, deployed from Git\n" + yaml.safe_dump(
        {k: v for k, v in dep.items() if k != "status"}, sort_keys=False)
    git_server.create("org/deploy", {"apps/llm/deployment.yaml": manifest})
    kubectl("apply", "--server-side", "--field-manager=argocd-controller", "-f", "-", input=manifest)
    wait_for(lambda: (kube.apps.read_namespaced_deployment("llm", namespace).status.ready_replicas or 0) >= 1,
             timeout=90, what="production ready")
    kube.core.create_namespaced_secret(namespace, {
        "metadata": {"name": "git", "labels": {"batchtune.io/git-credentials": "true"}},
        "data": {"token": base64.b64encode(TOKEN.encode()).decode()}})
    bt = batchtuning(namespace, prometheus_url,
                     searchSpace={"maxNumSeqs": {"values": [16, 32]}, "gpuMemoryUtilizationPercent": [95]},
                     strategy={"type": "Grid", "maxTrials": 2, "maxParallelTrials": 2},
                     objective={"type": "OutputThroughput"},
                     load={"inputTokens": 256, "outputTokens": 64, "concurrency": 8},
                     report={"curveLoad": {"concurrency": 8}},
                     apply={"mode": "PullRequest", "verifySeconds": 15, "cooldownSeconds": 0, "verifyMinRequests": 10,
                            "git": {"url": git_server.url("org/deploy"), "path": "apps/llm/deployment.yaml",
                                    "layout": "Manifest", "credentialsSecretRef": {"name": "git"}}})
    traffic = Traffic(kube, namespace, "app=llm", rate=2)
    traffic.start()
    try:
        kube.custom.create_namespaced_custom_object("batchtune.io", "v1alpha1", namespace, "batchtunings", bt)
        got = wait_phase(kube, namespace, "tune", {"AwaitingMerge", "Failed", "Succeeded", "Recommended"}, 240,
                         git_operator)
        status = got["status"]
        assert status["phase"] == "AwaitingMerge", json.dumps(status, indent=1)[-3000:]
        branch = status["pullRequest"]["branch"]
        chosen = status["recommendation"]["setting"]["maxNumSeqs"]
        # The branch's diff is exactly the knob change (production already sets --gpu-memory-utilization 0.95).
        diff = git_server.diff("org/deploy", "main", branch)
        changed = [line for line in diff.splitlines() if line[:1] in "+-" and line[:3] not in ("+++", "---")]
        assert changed == ["-        - '128'", f"+        - '{chosen}'"], diff
        message = git_server.message("org/deploy", branch)
        assert "(chosen)" in message and "tune-trial-" in message
        assert TOKEN not in json.dumps(status)
        assert "batchtune.io/applied" not in (live(kube, namespace, "llm")["metadata"].get("annotations") or {})

        # Review: merge; Argo CD syncs the merged manifest.
        git_server.merge("org/deploy", branch)
        kubectl("apply", "--server-side", "--field-manager=argocd-controller", "-f", "-",
                input=git_server.show("org/deploy", "main", "apps/llm/deployment.yaml"))
        done = wait_phase(kube, namespace, "tune", {"Succeeded", "Failed", "Recommended"}, 150, git_operator)
    finally:
        traffic.stop()
    assert done["status"]["phase"] == "Succeeded", json.dumps(done["status"], indent=1)[-3000:]
    assert condition(done, "Succeeded")["reason"] == "Verified"
    args = live(kube, namespace, "llm")["spec"]["template"]["spec"]["containers"][0]["args"]
    expected = list(PRODUCTION_ARGS)
    expected[expected.index("--max-num-seqs") + 1] = str(chosen)
    assert args == expected
    # batchtune never wrote to production: only Argo CD's manager (and the controllers' status) appear.
    managers = {e["manager"] for e in live(kube, namespace, "llm")["metadata"]["managedFields"]}
    assert "batchtune" not in managers and "argocd-controller" in managers
    assert get_bt(kube, namespace, "tune")["status"]["applied"]["verifiedAt"]
