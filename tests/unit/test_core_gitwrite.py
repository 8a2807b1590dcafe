"""The recommendation as a text edit of the user's files: the diff is the knob change and nothing else."""

from __future__ import annotations

import difflib

import pytest
import yaml

from batchtune.core.gitwrite import (
    EditError,
    Layout,
    Target,
    branch_name,
    change,
    commit_message,
    edit_kustomization,
    edit_manifest,
    edit_values,
)
from batchtune.core.recommend import kustomize_patch
from batchtune.core.settings import Setting
from batchtune.engines.vllm import VLLM

SETTING = Setting(max_num_seqs=64, gpu_memory_utilization_percent=90)


def rewrite(container):
    return VLLM.rewrite(container, SETTING)


def diff(a: str, b: str) -> list[str]:
    return [line for line in difflib.unified_diff(a.splitlines(), b.splitlines(), lineterm="", n=0)
            if line[:1] in "+-" and not line.startswith(("+++", "---"))]


MANIFEST = """\
# Production vLLM (reviewed by the platform team)
apiVersion: v1
kind: Service
metadata:
  name: llm
spec:
  ports: [{port: 8000}]
---
apiVersion: apps/v1
kind: Deployment
metadata:
  name: llm
  labels: {app: llm}
spec:
  replicas: 2   # two GPUs' worth
  template:
    spec:
      containers:
        - name: sidecar
          image: busybox
          args: ["--max-num-seqs", "1"]
        - name: vllm
          image: vllm/vllm-openai:v0.11.0
          args:
            - meta-llama/Llama-3.1-8B-Instruct
            - --max-num-seqs
            - "128"            # vLLM's default for this GPU
            - --gpu-memory-utilization=0.95
            - --port
            - "8000"
"""


def test_manifest_args_edited_in_place():
    out = edit_manifest(MANIFEST, "apps/llm.yaml", "llm", "vllm", rewrite)
    assert diff(MANIFEST, out) == [
        '-            - "128"            # vLLM\'s default for this GPU',
        '-            - --gpu-memory-utilization=0.95',
        '+            - "64"            # vLLM\'s default for this GPU',
        '+            - --gpu-memory-utilization=0.90',
    ]
    docs = list(yaml.safe_load_all(out))
    assert docs[1]["spec"]["template"]["spec"]["containers"][0]["args"] == ["--max-num-seqs", "1"]  # the sidecar


def test_manifest_flag_added_keeps_the_other_lines():
    text = MANIFEST.replace("            - --gpu-memory-utilization=0.95\n", "")
    out = edit_manifest(text, "f.yaml", "llm", "vllm", rewrite)
    changed = diff(text, out)
    assert '+            - "64"            # vLLM\'s default for this GPU' not in changed  # the comment line is new-rendered
    assert any(line.startswith("+") and "--gpu-memory-utilization" in line for line in changed)
    assert len([line for line in changed if line.startswith("-")]) == 1  # only the 128 line
    container = list(yaml.safe_load_all(out))[1]["spec"]["template"]["spec"]["containers"][1]
    assert VLLM.read(container).flags["max-num-seqs"] == "64"


def test_manifest_flow_list_and_equals_form():
    text = ("apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: llm}\nspec:\n  template:\n    spec:\n"
            "      containers:\n      - name: vllm\n        command: [vllm, serve, m, '--max-num-seqs=256', "
            "'--gpu-memory-utilization=0.90']\n")
    out = edit_manifest(text, "f.yaml", "llm", "vllm", rewrite)
    assert diff(text, out) == [
        "-        command: [vllm, serve, m, '--max-num-seqs=256', '--gpu-memory-utilization=0.90']",
        "+        command: [vllm, serve, m, '--max-num-seqs=64', '--gpu-memory-utilization=0.90']"]


def test_manifest_already_tuned_is_unchanged():
    text = MANIFEST.replace('"128"', '"64"').replace("=0.95", "=0.90")
    assert edit_manifest(text, "f.yaml", "llm", "vllm", rewrite) == text


@pytest.mark.parametrize("deployment, container, message", [
    ("other", "vllm", "holds no Deployment named 'other'"),
    ("llm", "nope", "has no container named 'nope'"),
])
def test_manifest_errors_name_what_is_missing(deployment, container, message):
    with pytest.raises(EditError, match=message):
        edit_manifest(MANIFEST, "apps/llm.yaml", deployment, container, rewrite)


def test_manifest_without_the_list_to_edit():
    text = MANIFEST.replace("          args:\n", "          argz:\n")
    with pytest.raises(EditError, match="container vllm: container 'vllm': does not run vLLM"):
        edit_manifest(text, "f.yaml", "llm", "vllm", rewrite)


VALUES = """\
replicaCount: 2
vllm:
  model: meta-llama/Llama-3.1-8B-Instruct
  # Flags passed to `vllm serve` after the model.
  args:
  - --max-num-seqs=128
  - --enable-prefix-caching
resources:
  limits: {nvidia.com/gpu: 1}
"""


def test_helm_values_list_rewritten_by_the_engine():
    out = edit_values(VALUES, "values.yaml", "vllm.args", "vllm", rewrite)
    assert sorted(diff(VALUES, out)) == sorted(["-  - --max-num-seqs=128", "+  - --max-num-seqs=64",
                                                "+  - --gpu-memory-utilization", "+  - '0.90'"])
    assert yaml.safe_load(out)["vllm"]["args"] == ["--max-num-seqs=64", "--enable-prefix-caching",
                                                    "--gpu-memory-utilization", "0.90"]
    assert "# Flags passed to `vllm serve` after the model." in out


def test_helm_values_errors():
    with pytest.raises(EditError, match="has no list at vllm.extraArgs"):
        edit_values(VALUES, "values.yaml", "vllm.extraArgs", "vllm", rewrite)
    with pytest.raises(EditError, match="must be dotted keys"):
        edit_values(VALUES, "values.yaml", "vllm..args", "vllm", rewrite)


KUSTOMIZATION = """\
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - deployment.yaml
patches:
  - path: replicas.yaml   # scale for prod

# Images pinned by the release pipeline.
images:
  - name: vllm/vllm-openai
    newTag: v0.11.0
"""


def test_kustomization_gets_one_entry():
    out = edit_kustomization(KUSTOMIZATION, "apps/llm/kustomization.yaml", "batchtune-llm.yaml")
    assert diff(KUSTOMIZATION, out) == ["+  - path: batchtune-llm.yaml"]
    assert yaml.safe_load(out)["patches"] == [{"path": "replicas.yaml"}, {"path": "batchtune-llm.yaml"}]
    assert edit_kustomization(out, "k.yaml", "batchtune-llm.yaml") == out  # listed already


def test_kustomization_without_patches():
    text = "resources:\n- deployment.yaml\n"
    out = edit_kustomization(text, "k.yaml", "batchtune-llm.yaml")
    assert yaml.safe_load(out) == {"resources": ["deployment.yaml"], "patches": [{"path": "batchtune-llm.yaml"}]}


def test_kustomize_change_writes_the_patch_file_and_the_entry():
    target = {"metadata": {"name": "llm"}}
    container = rewrite({"name": "vllm", "args": ["m", "--max-num-seqs", "128"]})
    t = Target(Layout.KUSTOMIZE, "apps/llm", "llm", "vllm")
    files = change(t, {"apps/llm/kustomization.yaml": KUSTOMIZATION}, rewrite,
                   kustomize_patch(target, "vllm", container))
    assert set(files) == {"apps/llm/kustomization.yaml", "apps/llm/batchtune-llm.yaml"}
    patch = yaml.safe_load(files["apps/llm/batchtune-llm.yaml"])
    assert patch["spec"]["template"]["spec"]["containers"] == [
        {"name": "vllm", "args": ["m", "--max-num-seqs", "64", "--gpu-memory-utilization", "0.90"]}]
    again = change(t, {"apps/llm/kustomization.yaml": files["apps/llm/kustomization.yaml"],
                       "apps/llm/batchtune-llm.yaml": files["apps/llm/batchtune-llm.yaml"]}, rewrite,
                   kustomize_patch(target, "vllm", container))
    assert again == {}


def test_change_missing_file():
    with pytest.raises(EditError, match="does not exist on the base branch"):
        change(Target(Layout.MANIFEST, "apps/x.yaml", "llm", "vllm"), {"apps/x.yaml": None}, rewrite)


def test_branch_name_is_a_safe_ref():
    assert branch_name("batchtune/", "inference", "llama 8b", 2, 3) == "batchtune/inference/llama-8b/g3-r2"
    assert ".." not in branch_name("batchtune", "a..b", "c", 1, 1)


def test_commit_message_carries_the_table():
    text = commit_message("llm: maxNumSeqs=64", "Chosen: maxNumSeqs=64 because ...",
                          [("trial", "setting", "verdict"), ("t-0", "maxNumSeqs=64", "Met")],
                          ["ITL p95 31 ms of 40 ms (23% to spare)"], ["Report: ConfigMap inference/tune-report"])
    assert text.splitlines()[0] == "llm: maxNumSeqs=64"
    assert "t-0    maxNumSeqs=64  Met" in text
    assert "- ITL p95 31 ms of 40 ms (23% to spare)" in text


@pytest.mark.parametrize("kind, url, api", [
    ("GitHub", "https://github.com/acme/deploy.git", "https://api.github.com"),
    ("GitHub", "https://ghe.example.com/acme/deploy.git", "https://ghe.example.com/api/v3"),
    ("Gitea", "https://git.example.com/acme/deploy.git", "https://git.example.com/api/v1"),
    ("GitLab", "https://gitlab.example.com/group/sub/deploy.git", "https://gitlab.example.com/api/v4"),
])
def test_forge_api_url_from_the_repository_url(kind, url, api):
    from batchtune.controller.forge import api_url, repo_path
    from batchtune.core.gitwrite import ForgeType

    assert api_url(ForgeType(kind), url) == api
    assert repo_path(url)[1] == "deploy"
