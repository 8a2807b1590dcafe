"""PullRequest mode and managed targets through the whole loop: the in-memory world of fake_world for the
cluster and Prometheus, and a REAL Git server (git http-backend on loopback) for the repository.

The change reaches production only from Git here: the test merges the branch and plays Argo CD (it
copies the merged manifest's container into the Deployment), and the loop must notice, verify, and
never patch production itself.
"""

from __future__ import annotations

import copy

import pytest
import yaml
from fake_world import LOCAL_PROMETHEUS, NS, production_target, world

from batchtune.controller.ports import Install
from batchtune_local.gitserver import GitServer

TERMINAL = {"Succeeded", "Failed", "RolledBack", "Recommended"}
USER, TOKEN = "batchtune", "s3cret-token-123"


def manifest() -> str:
    dep = production_target()
    dep["metadata"] = {"name": "llm", "labels": {"app": "llm"}}
    dep.pop("status")
    return "# llm: production vLLM\n" + yaml.safe_dump(dep, sort_keys=False)


@pytest.fixture
def server(tmp_path):
    with GitServer(tmp_path / "git", (USER, TOKEN)) as s:
        s.create("org/deploy", {"apps/llm/deployment.yaml": manifest(),
                                "apps/llm/kustomization.yaml": "resources:\n- deployment.yaml\n"})
        yield s


def install(server: GitServer, **kw) -> Install:
    return Install(operator_image="batchtune:test", prometheus_urls=LOCAL_PROMETHEUS, scrape_lag_seconds=0, git_urls=(server.base_url,), **kw)


def git_world(server: GitServer, layout: str = "Manifest", path: str = "apps/llm/deployment.yaml", **apply):
    w = world(apply={"mode": "PullRequest", "git": {
        "url": server.url("org/deploy"), "path": path, "layout": layout,
        "credentialsSecretRef": {"name": "git"}}, **apply})
    w.secrets = {"git": {"labels": {"batchtune.io/git-credentials": "true"}, "data": {"token": TOKEN}}}
    return w


def run(w, server, phases, limit=400):
    for _ in range(limit):
        if w.status.get("phase") in phases:
            return w.status["phase"]
        w.tick(install(server))
    raise AssertionError(f"phase {w.status.get('phase')} after {limit} ticks; {w.condition('Progressing')}")


def sync_from_git(w, server) -> None:
    """What Argo CD does after the merge: production's container becomes the manifest's on main."""
    merged = yaml.safe_load(server.show("org/deploy", "main", "apps/llm/deployment.yaml"))
    live = w.deployments["llm"]
    live["spec"]["template"]["spec"]["containers"] = copy.deepcopy(merged["spec"]["template"]["spec"]["containers"])
    live["metadata"]["resourceVersion"] = w.next_rv()


def test_pull_request_mode_pushes_a_branch_verifies_the_merged_change_and_never_patches(server):
    w = git_world(server)
    assert run(w, server, {"AwaitingMerge"} | TERMINAL) == "AwaitingMerge"
    record = w.status["pullRequest"]
    branch = record["branch"]
    assert branch == f"batchtune/{NS}/tune/g1-r1" and branch in server.branches("org/deploy")
    diff = server.diff("org/deploy", "main", branch)
    changed = [line for line in diff.splitlines() if line[:1] in "+-" and line[:3] not in ("+++", "---")]
    best = w.status["recommendation"]["setting"]["maxNumSeqs"]
    # Exactly the knob change: the chosen maxNumSeqs, and the search space's gpu-memory-utilization (production
    # had none) added right after the other flags; every other line of the file as it was.
    assert changed == ["-        - '16'", f"+        - '{best}'", "+        - --gpu-memory-utilization",
                       "+        - '0.90'"], diff
    text = server.message("org/deploy", branch)
    assert text.startswith(f"llm: {w.status['bestSetting']}") and "(chosen)" in text and "Margins" in text
    assert TOKEN not in str(w.status) and TOKEN not in str(w.events)
    # Waiting: production does not run it yet, and batchtune does not patch it.
    for _ in range(5):
        w.tick(install(server))
    assert w.phase == "AwaitingMerge" and w.patches == []
    server.merge("org/deploy", branch)
    sync_from_git(w, server)
    assert run(w, server, TERMINAL) == "Succeeded"
    assert w.condition("Succeeded")["reason"] == "Verified"
    assert w.patches == []  # production's change came from Git only
    assert "MergedChangeRunning" in [r for _, r, _ in w.events]


def test_a_regression_on_the_merged_change_fails_and_names_the_commit_to_revert(server):
    from test_reconcile import degrade_after_change

    w = git_world(server)
    degrade_after_change(w)
    assert run(w, server, {"AwaitingMerge"} | TERMINAL) == "AwaitingMerge"
    commit = w.status["pullRequest"]["commit"]
    server.merge("org/deploy", w.status["pullRequest"]["branch"])
    sync_from_git(w, server)
    assert run(w, server, TERMINAL) == "Failed"
    assert w.condition("Failed")["reason"] == "Regression" and w.condition("Degraded")["reason"] == "Regression"
    assert f"revert commit {commit[:12]}" in w.condition("Failed")["message"]
    assert w.patches == []  # batchtune never overwrites what Git deployed


def test_a_new_generation_supersedes_the_unmerged_branch(server):
    w = git_world(server)
    assert run(w, server, {"AwaitingMerge"}) == "AwaitingMerge"
    first = w.status["pullRequest"]["branch"]
    w.generation += 1
    w.bt_spec["searchSpace"] = {"maxNumSeqs": {"values": [8, 32]}}
    w.tick(install(server))
    assert w.phase == "Pending"
    assert run(w, server, {"AwaitingMerge"} | TERMINAL) == "AwaitingMerge"
    second = w.status["pullRequest"]["branch"]
    assert second.endswith("g2-r1") and second in server.branches("org/deploy")
    assert first not in server.branches("org/deploy")
    assert "Superseded" in [r for _, r, _ in w.events]


def test_kustomize_layout_writes_the_patch_file_and_one_entry(server):
    w = git_world(server, layout="Kustomize", path="apps/llm")
    assert run(w, server, {"AwaitingMerge"} | TERMINAL) == "AwaitingMerge"
    branch = w.status["pullRequest"]["branch"]
    assert sorted(w.status["pullRequest"]["files"]) == ["apps/llm/batchtune-llm.yaml", "apps/llm/kustomization.yaml"]
    k = yaml.safe_load(server.show("org/deploy", branch, "apps/llm/kustomization.yaml"))
    assert k == {"resources": ["deployment.yaml"], "patches": [{"path": "batchtune-llm.yaml"}]}
    patch = yaml.safe_load(server.show("org/deploy", branch, "apps/llm/batchtune-llm.yaml"))
    assert patch["spec"]["template"]["spec"]["containers"][0]["args"] == w.status["recommendation"]["container"]["args"]


def test_git_urls_and_secrets_follow_the_install(server):
    w = git_world(server)
    assert w.run_until(TERMINAL, install=Install(operator_image="batchtune:test", prometheus_urls=LOCAL_PROMETHEUS, scrape_lag_seconds=0)) == "Failed"
    assert "allows no Git repository" in w.condition("Failed")["message"]
    w = git_world(server)
    w.secrets["git"]["labels"] = {"batchtune.io/prometheus-token": "true"}  # opted in for the wrong use
    assert run(w, server, TERMINAL) == "Failed"
    assert "spec.apply.git.credentialsSecretRef" in w.condition("Failed")["message"]


def test_wrong_credentials_wait_and_never_show_the_token(server):
    w = git_world(server)
    w.secrets["git"]["data"]["token"] = "wrong-" + TOKEN
    for _ in range(200):
        w.tick(install(server))
        if w.condition("Progressing").get("reason") == "GitUnavailable":
            break
    assert w.condition("Progressing")["reason"] == "GitUnavailable"
    assert "HTTPUnauthorized" in w.condition("Progressing")["message"]
    assert TOKEN not in str(w.status) and TOKEN not in str(w.events)


def test_explicit_auto_on_an_argo_cd_target_is_downgraded_unless_carved_out():
    w = world(apply={"mode": "Auto"})
    w.deployments["llm"]["metadata"]["annotations"]["argocd.argoproj.io/tracking-id"] = f"llm:apps/Deployment:{NS}/llm"
    assert w.run_until(TERMINAL) == "Recommended" and w.patches == []
    assert w.condition("Degraded")["reason"] == "AutoDowngraded"
    assert f"Argo CD (annotation argocd.argoproj.io/tracking-id=llm:apps/Deployment:{NS}/llm" in \
        w.condition("Degraded")["message"]
    w = world(apply={"mode": "Auto", "autoUnderManagers": ["ArgoCD"]})
    w.deployments["llm"]["metadata"]["annotations"]["argocd.argoproj.io/tracking-id"] = f"llm:apps/Deployment:{NS}/llm"
    assert w.run_until(TERMINAL) == "Succeeded" and w.patches


def test_unset_mode_on_a_helm_release_recommends_and_says_so():
    w = world(apply={"mode": None})
    w.bt_spec["apply"].pop("mode")
    w.deployments["llm"]["metadata"]["annotations"].update({"meta.helm.sh/release-name": "llm",
                                                             "meta.helm.sh/release-namespace": NS})
    w.deployments["llm"]["metadata"]["managedFields"] = [{"manager": "helm", "operation": "Update"}]
    assert w.run_until(TERMINAL) == "Recommended" and w.patches == []
    message = w.condition("Succeeded")["message"]
    assert "managed by Helm (annotation meta.helm.sh/release-name=llm" in message
    assert "managedFields manager helm (Update)" in message
