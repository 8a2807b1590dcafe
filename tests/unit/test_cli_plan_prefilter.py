"""`batchtune plan --gpu`: the offline plan runs the operator's memory prefilter (`twin.prefilter.memory_fit`, what
controller/plan.py runs), so a reviewer sees which settings would be pruned, and why, before anything runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from batchtune.cli import main
from batchtune.core import SearchSpace, plan_candidates
from batchtune.engines import VLLM
from batchtune.twin.prefilter import memory_fit

TUNING = {
    "apiVersion": "batchtune.io/v1alpha1", "kind": "BatchTuning", "metadata": {"name": "llm"},
    "spec": {"targetRef": {"name": "llm"},
             "searchSpace": {"maxNumSeqs": {"values": [8, 256]}, "gpuMemoryUtilizationPercent": [50, 90]},
             "slo": {"interTokenLatencyMilliseconds": 50}, "prometheus": {"url": "http://p:9090"}},
}
TARGET = {
    "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "llm"},
    "spec": {"template": {"spec": {"containers": [{
        "name": "vllm", "image": "vllm/vllm-openai:v0.32.0",
        "command": ["vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct"], "args": ["--max-model-len", "8192"]}]}}},
}


@pytest.fixture
def files(tmp_path: Path) -> tuple[str, str]:
    tuning, target = tmp_path / "bt.yaml", tmp_path / "deploy.yaml"
    tuning.write_text(yaml.safe_dump(TUNING))
    target.write_text(yaml.safe_dump(TARGET))
    return str(tuning), str(target)


def test_plan_with_the_gpu_prunes_what_the_operator_prunes(files: tuple[str, str], capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "250")
    tuning, target = files
    assert main(["plan", "-f", tuning, "--target", target, "--gpu", "NVIDIA-L4"]) == 0
    out = capsys.readouterr().out
    assert "memory prefilter: twin model of Llama-3.1-8B on L4" in out
    # the operator's prefilter on the same target and GPU
    container = TARGET["spec"]["template"]["spec"]["containers"][0]  # type: ignore[index]
    invocation = VLLM.read(container)
    fits, _ = memory_fit(VLLM, invocation, "NVIDIA-L4")
    expected = plan_candidates(SearchSpace((8, 256), (50, 90)), None, fits, VLLM.limits(invocation.flags))
    assert expected.pruned and {p.setting.gpu_memory_utilization_percent for p in expected.pruned} == {50}
    assert f"pruned: {len(expected.pruned)}" in out
    for pruned in expected.pruned:
        assert pruned.setting.label() in out
    assert "DoesNotFitMemory" in out and "No available memory for the cache blocks" in out  # vLLM's own words
    # without the GPU nothing is pruned for memory
    assert main(["plan", "-f", tuning, "--target", target]) == 0
    assert "DoesNotFitMemory" not in capsys.readouterr().out


def test_plan_gpu_refusals(files: tuple[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    tuning, target = files
    assert main(["plan", "-f", tuning, "--gpu", "NVIDIA-L4"]) == 1
    assert "--gpu needs --target" in capsys.readouterr().err
    assert main(["plan", "-f", tuning, "--target", target, "--gpu", "NVIDIA-Z9000"]) == 1
    assert "--gpu: " in capsys.readouterr().err
