"""A command line status cannot keep whole is refused, never cut (issue 22, section 9).

Status keeps production's command line and the recommended one (baseline, recommendation, applied: what a rollback
restores), each list bounded in the CRD. A cut one would run, and restore, a different container, so planning
refuses the target with a condition naming the field and the length, before any trial or GPU.
"""

from __future__ import annotations

import pytest
from fake_world import World, fresh_backoff, production_target, spec  # noqa: F401  # the fixture, through pytestmark

from batchtune.core.recommend import MAX_COMMAND_LINE_WORD_LENGTH, MAX_COMMAND_LINE_WORDS

TERMINAL = {"Succeeded", "Failed", "RolledBack", "Recommended"}
pytestmark = pytest.mark.usefixtures("fresh_backoff")
FIELD = "Deployment inference/llm spec.template.spec.containers[vllm]"


def refused(args: list[str], **overrides) -> dict:
    w = World(bt_spec=spec(**overrides))
    w.deployments["llm"] = production_target(args=args)
    before = [dict(c) for c in w.deployments["llm"]["spec"]["template"]["spec"]["containers"]]
    assert w.run_until(TERMINAL) == "Failed"
    assert w.created == [], "no trial object before the refusal"
    assert w.deployments["llm"]["spec"]["template"]["spec"]["containers"] == before, "production untouched"
    assert "baseline" not in w.status and not w.status.get("trials")
    failed = w.condition("Failed")
    assert failed["reason"] == "CommandLineTooLong", failed
    return failed


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        pytest.param(
            ["--max-num-seqs", "16", "--compilation-config", "{" + "x" * (MAX_COMMAND_LINE_WORD_LENGTH - 1) + "}"],
            f"{FIELD}.args[3] is {MAX_COMMAND_LINE_WORD_LENGTH + 1} characters long, more than the "
            f"{MAX_COMMAND_LINE_WORD_LENGTH}",
            id="a-word-too-long",
        ),
        pytest.param(
            ["--max-num-seqs", "16", "--lora-modules", *[f"m{i}=/models/m{i}" for i in range(70)]],
            f"{FIELD}.args has 73 words, more than the {MAX_COMMAND_LINE_WORDS}",
            id="too-many-words",
        ),
    ],
)
def test_a_production_command_line_status_cannot_keep_is_refused_naming_the_field_and_its_length(args, expected):
    failed = refused(args)
    assert expected in failed["message"], failed["message"]
    assert "rather than cut" in failed["message"]


def test_a_recommended_command_line_over_the_bound_is_refused_before_any_trial():
    # Production's fits (3 command words and 60 args); the trials' and the recommendation's would not: the
    # setting's missing --gpu-memory-utilization adds two words.
    args = ["--max-num-seqs", "16", "--port", "8000", "--lora-modules", *[f"m{i}=/models/m{i}" for i in range(55)]]
    assert 3 + len(args) == MAX_COMMAND_LINE_WORDS - 1
    failed = refused(args)
    assert f"{FIELD} with the setting seqs=64 gmu=90% and spec.searchSpace.extraArgs" in failed["message"], failed
    assert f".command and .args together have {MAX_COMMAND_LINE_WORDS + 1} words" in failed["message"], failed


def test_a_command_line_at_the_bound_is_tuned():
    # 3 command words, 59 args and the two words the setting adds: exactly at the bound, kept whole.
    args = ["--max-num-seqs", "16", "--port", "8000", "--lora-modules", *[f"m{i}=/models/m{i}" for i in range(54)]]
    w = World(bt_spec=spec(apply={"mode": "Recommend"}))
    w.deployments["llm"] = production_target(args=args)
    assert w.run_until(TERMINAL) == "Recommended", w.condition("Failed")
    recommendation = w.status["recommendation"]
    assert len(recommendation["args"]) == MAX_COMMAND_LINE_WORDS  # the whole command line, command and args
    rewritten = recommendation["container"]["args"]
    assert len(rewritten) == len(args) + 2 and rewritten[2 : len(args)] == args[2:]  # only the knobs changed
    assert w.status["baseline"]["args"] == ["meta-llama/Llama-3.1-8B-Instruct", *args]
