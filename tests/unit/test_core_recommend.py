"""The recommendation: production's new command line, ready patches, and the replica hint."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from batchtune.core.recommend import ContainerArgs, production_args, recommend, replicas_needed
from batchtune.core.settings import Setting
from batchtune.engines import VLLM


@pytest.mark.parametrize("capacity, peak, replicas", [
    pytest.param(10.0, 25.0, 3, id="ceil"),
    pytest.param(10.0, 20.0, 2, id="exact"),
    pytest.param(10.0, 0.5, 1, id="at-least-one"),
    pytest.param(None, 25.0, None, id="capacity-missing"),
    pytest.param(10.0, None, None, id="peak-missing"),
    pytest.param(0.0, 25.0, None, id="capacity-zero"),
    pytest.param(10.0, 0.0, None, id="peak-zero"),
    pytest.param(-1.0, 25.0, None, id="capacity-negative"),
    pytest.param(math.nan, 25.0, None, id="capacity-nan"),
    pytest.param(10.0, math.inf, None, id="peak-inf"),
])
def test_replicas_needed(capacity, peak, replicas):
    assert replicas_needed(capacity, peak) == replicas


CONTAINER = {"name": "vllm", "image": "vllm/vllm-openai", "command": ["vllm", "serve"],
             "args": ["m", "--max-num-seqs", "256", "--port", "8000"]}
TARGET = {"metadata": {"name": "llm"},
          "spec": {"template": {"spec": {"containers": [{"name": "proxy", "command": ["envoy"]}, CONTAINER]}}}}
SETTING = Setting(64, 85, 4096)
EXTRA = ["--enforce-eager", "--max-model-len", "4096"]
EXPECTED_ARGS = ["m", "--max-num-seqs", "64", "--port", "8000", "--gpu-memory-utilization", "0.85",
                 "--max-num-batched-tokens", "4096", "--enforce-eager", "--max-model-len", "4096"]


def test_recommend_includes_the_extra_args_in_the_container_args():
    rec = recommend(VLLM, TARGET, CONTAINER, SETTING, EXTRA)
    assert rec.container == ContainerArgs(("vllm", "serve"), tuple(EXPECTED_ARGS))
    assert rec.container_name == "vllm" and rec.setting == SETTING
    assert production_args(VLLM, CONTAINER, SETTING, EXTRA) == rec.container
    inv = VLLM.read({"name": "vllm", **rec.container.to_wire()})
    assert "enforce-eager" in inv.flags and inv.flags["max-model-len"] == "4096" and inv.max_num_seqs == 64


def test_recommend_patches():
    rec = recommend(VLLM, TARGET, CONTAINER, SETTING, EXTRA)
    assert json.loads(rec.json_patch) == [{"op": "replace", "path": "/spec/template/spec/containers/1/args",
                                           "value": EXPECTED_ARGS}]
    kustomize = yaml.safe_load(rec.kustomize_patch)
    assert kustomize["metadata"] == {"name": "llm"}
    assert kustomize["spec"]["template"]["spec"]["containers"] == [
        {"name": "vllm", "command": ["vllm", "serve"], "args": EXPECTED_ARGS}]
    helm = yaml.safe_load(rec.helm_values)
    assert helm["vllm"] == {"maxNumSeqs": 64, "gpuMemoryUtilization": 0.85, "maxNumBatchedTokens": 4096}
    assert helm["extraArgs"] == VLLM.setting_args(SETTING) + EXTRA
    assert CONTAINER["args"][2] == "256"  # the target is untouched


def test_recommend_adds_args_a_container_did_not_have():
    container = {"name": "vllm", "command": ["vllm", "serve", "m"]}
    target = {"metadata": {"name": "llm"}, "spec": {"template": {"spec": {"containers": [container]}}}}
    ops = json.loads(recommend(VLLM, target, container, Setting(8, 90), []).json_patch)
    assert ops == [{"op": "add", "path": "/spec/template/spec/containers/0/args",
                    "value": ["--max-num-seqs", "8", "--gpu-memory-utilization", "0.90"]}]


@pytest.mark.parametrize("container, flat", [
    pytest.param({"command": ["a"], "args": ["b"]}, ["a", "b"], id="both"),
    pytest.param({"args": ["b"]}, ["b"], id="args-only"),
    pytest.param({}, [], id="neither"),
])
def test_container_args(container, flat):
    args = ContainerArgs.of(container)
    assert args.flat() == flat and args.to_wire() == container


# ---- cases mutation testing (hack/mutation-test) showed no test would notice -----------------------

def test_a_slow_setting_under_one_request_per_second_still_gets_a_hint():
    from batchtune.core.recommend import replicas_needed

    assert replicas_needed(0.5, 2.0) == 4


def test_the_patches_are_well_formed_and_say_the_same():
    import json

    import yaml

    from batchtune.core.recommend import recommend
    from batchtune.core.settings import Setting
    from batchtune.engines import VLLM

    container = {"name": "vllm", "command": ["vllm", "serve", "m"], "args": ["--max-num-seqs", "8"]}
    target = {"metadata": {"name": "llm"}, "spec": {"template": {"spec": {"containers": [
        {"name": "side", "image": "x"}, container]}}}}
    rec = recommend(VLLM, target, container, Setting(32, 90, 4096), ["--enforce-eager"])
    patch = json.loads(rec.json_patch)
    assert patch == [{"op": "replace", "path": "/spec/template/spec/containers/1/args",
                      "value": ["--max-num-seqs", "32", "--gpu-memory-utilization", "0.90",
                                "--max-num-batched-tokens", "4096", "--enforce-eager"]}]
    kustomize = yaml.safe_load(rec.kustomize_patch)
    assert kustomize["apiVersion"] == "apps/v1" and kustomize["kind"] == "Deployment"
    assert kustomize["metadata"] == {"name": "llm"}
    assert kustomize["spec"]["template"]["spec"]["containers"] == [
        {"name": "vllm", "command": ["vllm", "serve", "m"], "args": patch[0]["value"]}]
    helm = yaml.safe_load(rec.helm_values.split("\n", 1)[1])
    assert helm["vllm"] == {"maxNumSeqs": 32, "gpuMemoryUtilization": 0.9, "maxNumBatchedTokens": 4096}
    assert helm["extraArgs"][-1] == "--enforce-eager"
    assert list(helm) == ["vllm", "extraArgs"]  # keys in the order a reader expects


@pytest.mark.parametrize("objective, capacities, peak, replicas", [
    pytest.param("SloCapacity", [4.0], 10.0, 3, id="peak-over-capacity"),
    pytest.param("SloCapacity", [4.0], 8.0, 2, id="exactly"),
    pytest.param("SloCapacity", [5.0, 4.0], 10.0, 3, id="the-worst-repeat-counts"),
    pytest.param("Goodput", [4.0], 10.0, 3, id="goodput-searches-the-same-capacity"),
    pytest.param("SloCapacity", [4.0, None], 10.0, None, id="a-repeat-without-capacity"),
    pytest.param("SloCapacity", [], 10.0, None, id="no-capacity"),
    pytest.param("SloCapacity", [4.0], None, None, id="no-peak"),
    pytest.param("OutputThroughput", [4.0], 10.0, None, id="fixed-load-has-no-capacity"),
    pytest.param("TokensPerJoule", [4.0], 10.0, None, id="fixed-load-tokens-per-joule"),
])
def test_replica_hint(objective, capacities, peak, replicas):
    from batchtune.core.recommend import replica_hint

    hint = replica_hint(objective, capacities, peak, "the profile", 10)
    assert hint.replicas == replicas
    if replicas is None:
        assert hint.basis.startswith("no replica hint")
    else:
        assert "10% headroom" in hint.basis and "so no more is added" in hint.basis


def test_the_headroom_is_counted_once():
    from batchtune.core.recommend import replica_hint

    # A capacity of 4 req/s measured under the SLO less 25% headroom serves a 12 req/s peak with 3 replicas;
    # taking the headroom off again (4 * 0.75 = 3 req/s) would ask for 4.
    assert replica_hint("SloCapacity", [4.0], 12.0, "the profile", 25).replicas == 3


@pytest.mark.parametrize("char", [pytest.param('"', id="quotes-escaped-twice-as-long"),
                                  pytest.param("\u4e2d", id="beyond-ascii-six-times-as-long")])
def test_the_longest_command_line_planning_accepts_fits_every_patch_whole(char):
    # Status keeps the patches at most Patch's 16384 characters and cuts a longer one: a cut patch would change
    # production to a different container, so the command lines planning accepts must always fit whole.
    from batchtune.api.models import Recommendation as RecommendationStatus
    from batchtune.core.recommend import MAX_COMMAND_LINE_WORDS, command_line_problem

    args = ["m", "--max-num-seqs", "256"]
    while len(args) + 2 < MAX_COMMAND_LINE_WORDS - 8:
        longer = [*args, char * 60]
        rec = recommend(VLLM, TARGET, {**CONTAINER, "args": longer}, SETTING, EXTRA)
        if command_line_problem(rec.container, "c") is not None:
            break
        args = longer
    container = {**CONTAINER, "args": args}
    rec = recommend(VLLM, TARGET, container, SETTING, EXTRA)
    assert command_line_problem(rec.container, "c") is None and len(args) > 20
    status = RecommendationStatus.model_validate({"setting": {"maxNumSeqs": 64, "gpuMemoryUtilizationPercent": 85},
                                                  "reason": "r", "jsonPatch": rec.json_patch,
                                                  "kustomizePatch": rec.kustomize_patch, "helmValues": rec.helm_values})
    assert (status.json_patch, status.kustomize_patch, status.helm_values) == \
        (rec.json_patch, rec.kustomize_patch, rec.helm_values)  # none cut
    assert json.loads(rec.json_patch)[0]["value"] == list(rec.container.args or ())
    kustomized = yaml.safe_load(rec.kustomize_patch)["spec"]["template"]["spec"]["containers"][0]
    assert kustomized["args"] == list(rec.container.args or ())


@pytest.mark.parametrize("args, message", [
    pytest.param(["m", "x" * 4000, "y" * 86], None, id="at-the-character-bound"),
    pytest.param(["m", "x" * 4000, "y" * 87], "have 4097 characters (4117 spelled as JSON), more than the 4096 (8192)",
                 id="one-character-over"),
    pytest.param(["m", "\u4e2d" * 1350], None, id="at-most-the-json-bound"),
    pytest.param(["m", "\u4e2d" * 1400], "have 1410 characters (8426 spelled as JSON), more than the 4096 (8192)",
                 id="over-the-json-bound"),
])
def test_a_command_line_longer_than_status_keeps_is_refused_naming_its_length(args, message):
    from batchtune.core.recommend import command_line_problem

    problem = command_line_problem(ContainerArgs(("vllm", "serve"), tuple(args)), "spec.targetRef[vllm]")
    if message is None:
        assert problem is None
    else:
        assert problem is not None and problem.startswith(f"spec.targetRef[vllm].command and .args together {message}")
