"""A status whose fields have the wrong types (whoever may write `batchtunings/status` can write anything there):
`batchtune status`, `report` and `recommend` parse it once into the typed model and end in one line naming the
field, exit 1, never a traceback; huge numbers the model allows render without one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import cli_fakes
import pytest

from batchtune.cli import main

FORGERIES: dict[str, tuple[str, Any]] = {
    # id: (field path, value)
    "phase-a-number": ("status.phase", 3),
    "phase-unknown": ("status.phase", "Hacked"),
    "trials-a-mapping": ("status.trials", {"a": 1}),
    "trial-a-string": ("status.trials[0]", "trial"),
    "index-a-string": ("status.trials[0].index", "first"),
    "setting-a-list": ("status.trials[0].setting", [64, 90]),
    "max-num-seqs-a-string": ("status.trials[0].setting.maxNumSeqs", "many"),
    "max-num-seqs-negative": ("status.trials[0].setting.maxNumSeqs", -1),
    "state-unknown": ("status.trials[0].state", "Pwned"),
    "metrics-a-list": ("status.trials[0].metrics", [1, 2]),
    "knee-a-list": ("status.knee", []),
    "recommendation-a-string": ("status.recommendation", "apply me"),
    "recommendation-args-a-string": ("status.recommendation.args", "--max-num-seqs 100000"),
    "conditions-a-mapping": ("status.conditions", {"type": "Failed"}),
    "condition-time-garbage": ("status.conditions[0].lastTransitionTime", "yesterday"),
    "applied-a-list": ("status.applied", ["x"]),
    "gpu-minutes-beyond-a-float": ("status.gpuMinutes", 10 ** 400),
    "trials-completed-a-float": ("status.trialsCompleted", 1.5),
    "workload-requests-a-string": ("status.workload", {"source": "production", "requests": "lots"}),
    "rounds-too-many": ("status.rounds", [{"round": 1, "trigger": "Initial"}] * 11),
    "twin-predictions-a-string": ("status.twin", {"basis": "x", "predictions": "top"}),
    # Trial indexes name Kubernetes objects: the model bounds them at int32 (the operator's own limit).
    "next-trial-index-huge": ("status.nextTrialIndex", 10 ** 400),
    "index-huge": ("status.trials[0].index", 2 ** 63 - 1),
}


def _set(bt: dict[str, Any], path: str, value: Any) -> None:
    """Put `value` at a dotted path with [i] indexes (status.trials[0].setting.maxNumSeqs)."""
    parts: list[str | int] = []
    for part in path.split("."):
        name, _, rest = part.partition("[")
        parts.append(name)
        if rest:
            parts.append(int(rest.rstrip("]")))
    node: Any = bt
    for part in parts[:-1]:
        node = node[part]
    node[parts[-1]] = value


@pytest.fixture
def api():
    fake = cli_fakes.FakeApi()
    yield fake
    fake.close()


COMMANDS = {
    "status": ["status", "llama-8b"],
    "report": ["report", "llama-8b", "--out", "{tmp}/out", "--html"],
    "recommend": ["recommend", "llama-8b", "-o", "patch"],
    "recommend-keda": ["recommend", "llama-8b", "-o", "keda"],
}


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("forgery", list(FORGERIES))
def test_a_forged_status_ends_in_one_line_naming_the_field(api, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           forgery: str, command: str) -> None:
    field, value = FORGERIES[forgery]
    bt = cli_fakes.succeeded()
    _set(bt, field, value)
    api.add_batchtuning(bt)
    kubeconfig = api.kubeconfig(tmp_path / "kc", namespace="inference")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in COMMANDS[command]]
    assert main([*argv, "--kubeconfig", str(kubeconfig)]) == 1
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and not captured.out
    lines = captured.err.splitlines()
    assert lines and all(line.startswith("error: BatchTuning inference/llama-8b: status") for line in lines), lines
    assert any(line.startswith(f"error: BatchTuning inference/llama-8b: {field}") for line in lines), lines
    assert not (tmp_path / "out").exists()


def test_a_status_that_is_not_an_object_is_named(api, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bt = cli_fakes.succeeded()
    bt["status"] = ["not", "a", "status"]
    api.add_batchtuning(bt)
    kubeconfig = api.kubeconfig(tmp_path / "kc", namespace="inference")
    assert main(["status", "llama-8b", "--kubeconfig", str(kubeconfig)]) == 1
    assert capsys.readouterr().err.startswith("error: BatchTuning inference/llama-8b: status: must be an object")


@pytest.mark.parametrize("field, value", [
    pytest.param("status.trialsPlanned", 2 ** 63 - 1, id="trials-planned-int64-max"),
    pytest.param("status.trialsPlanned", 10 ** 400, id="trials-planned-past-any-float"),
    pytest.param("status.trials[0].metrics", {"outputThroughput": 10 ** 400, "ttftMs": 1e308}, id="metrics-huge"),
    pytest.param("status.recommendation.replicasHint", 10 ** 30, id="replicas-hint-huge"),
])
def test_huge_numbers_the_model_allows_render_without_a_traceback(api, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str],
                                                                  field: str, value: Any) -> None:
    bt = cli_fakes.succeeded()
    _set(bt, field, value)
    api.add_batchtuning(bt)
    kubeconfig = api.kubeconfig(tmp_path / "kc", namespace="inference")
    for argv in (["status", "llama-8b"], ["report", "llama-8b", "--out", str(tmp_path / "o"), "--html"]):
        assert main([*argv, "--kubeconfig", str(kubeconfig)]) == 0, capsys.readouterr()
    assert "Traceback" not in capsys.readouterr().err
