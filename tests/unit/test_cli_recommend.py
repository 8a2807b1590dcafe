"""`batchtune recommend -o patch|kustomize|helm-values|args`: stdout holds only the change."""

from __future__ import annotations

import json

import cli_fakes
import pytest

from batchtune.cli import main
from batchtune.cli.recommend import NoRecommendation, recommendation_text


@pytest.mark.parametrize("output, check", [
    pytest.param("patch", lambda t: json.loads(t)[0]["path"] == "/spec/template/spec/containers/0/args", id="patch"),
    pytest.param("kustomize", lambda t: t.startswith("apiVersion: apps/v1\nkind: Deployment"), id="kustomize"),
    pytest.param("args", lambda t: t.splitlines()[1:3] == ["--max-num-seqs", "128"], id="args"),
])
def test_formats(output, check):
    text, note = recommendation_text(cli_fakes.succeeded(), output)
    assert check(text), text
    assert note == ("# max-num-seqs 128, gpu-memory-utilization 90%: highest output throughput meeting "
                    "p95 ITL 50 ms, 10% headroom below the knee")


@pytest.mark.parametrize("make, output, message", [
    pytest.param(cli_fakes.trialing, "patch",
                 r"inference/llama-8b has no recommendation yet \(phase Trialing, 2/6 trials done\)", id="running"),
    pytest.param(cli_fakes.fresh, "patch", r"no recommendation yet \(phase Pending, 0/0", id="new"),
    pytest.param(cli_fakes.failed, "patch", r"failed without a recommendation: NoFeasibleSetting: no trial met",
                 id="failed"),
    pytest.param(cli_fakes.succeeded, "helm-values",
                 r"has no Helm values snippet \(status.recommendation.helmValues is empty\); available: -o patch, "
                 r"-o kustomize, -o args", id="format-missing-lists-the-available"),
])
def test_no_recommendation(make, output, message):
    with pytest.raises(NoRecommendation, match=message):
        recommendation_text(make(), output)


def test_rolled_back_recommendation_carries_a_warning():
    bt = cli_fakes.succeeded()
    bt["status"]["phase"] = "RolledBack"
    _, note = recommendation_text(bt, "patch")
    assert "rolled back on production" in note


@pytest.fixture
def api():
    fake = cli_fakes.FakeApi()
    yield fake
    fake.close()


def test_recommend_command_prints_only_the_patch_on_stdout(api, tmp_path, capsys):
    api.add_batchtuning(cli_fakes.succeeded())
    kubeconfig = api.kubeconfig(tmp_path / "kc")
    assert main(["recommend", "llama-8b", "-n", "inference", "-o", "patch", "--kubeconfig", str(kubeconfig)]) == 0
    captured = capsys.readouterr()
    patch = json.loads(captured.out)
    assert patch[0]["value"][2] == "128"
    assert captured.err.startswith("# max-num-seqs 128")


def test_recommend_rejects_an_unknown_format(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["recommend", "x", "-o", "yaml"])
    assert exc.value.code == 2
    assert "invalid choice: 'yaml'" in capsys.readouterr().err


def test_recommend_before_a_decision_exits_1(api, tmp_path, capsys):
    api.add_batchtuning(cli_fakes.trialing())
    kubeconfig = api.kubeconfig(tmp_path / "kc", namespace="inference")
    assert main(["recommend", "llama-8b", "--kubeconfig", str(kubeconfig)]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and "no recommendation yet" in captured.err
