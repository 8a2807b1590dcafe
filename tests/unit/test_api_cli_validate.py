"""`batchtune validate`: exit status and one line per object or per field error."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchtune.cli import main

REPO = Path(__file__).resolve().parents[2]
MINIMAL = REPO / "manifests" / "samples" / "batchtuning-minimal.yaml"
FULL = REPO / "manifests" / "samples" / "batchtuning-full.yaml"
INVALID = REPO / "tests" / "data" / "invalid"


def test_valid_files_print_valid_per_object_and_exit_zero(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # The full sample's Prometheus (TLS, a token) is one the chart's default install does not name: an install that does.
    values = tmp_path / "values.yaml"
    values.write_text("prometheus:\n  allowedUrls:\n    - http://prometheus-operated.monitoring.svc:9090/\n"
                      "    - https://prometheus.monitoring.svc:9091/\n")
    assert main(["validate", "-f", str(MINIMAL), "-f", str(FULL), "--values", str(values)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"{MINIMAL}: llama-8b: valid",
        f"{FULL}: inference/llama-70b: valid (note: spec.load.image 'vllm/vllm-openai:v0.10.1' must be the target's "
        "own image (VllmBench) or one of load.allowedImages; the target's image is checked on the cluster)",
    ]


def test_without_values_the_chart_s_default_install_bounds_the_prometheus_url(capsys: pytest.CaptureFixture[str]):
    assert main(["validate", "-f", str(FULL)]) == 1
    out = capsys.readouterr().out
    assert "spec.prometheus.url: 'https://prometheus.monitoring.svc:9091' is not under a Prometheus URL this install " \
           "allows (http://prometheus-operated.monitoring.svc:9090/; Helm value prometheus.allowedUrls)" in out


@pytest.mark.parametrize("name, line", [
    pytest.param("24-parallel-above-max-trials.yaml",
                 "spec.strategy.maxParallelTrials: must not exceed maxTrials 4 (got 8)", id="cross-field"),
    pytest.param("38-prometheus-url-no-scheme.yaml",
                 'spec.prometheus.url: must start with http:// or https:// (got "prometheus.monitoring.svc:9090")', id="url"),
    pytest.param("01-missing-target-ref.yaml", "spec.targetRef: required field is missing", id="missing"),
])
def test_invalid_file_prints_file_field_message_and_value(name: str, line: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = INVALID / name
    assert main(["validate", "-f", str(path)]) == 1
    assert capsys.readouterr().out.splitlines() == [f"{path}: {line}"]


def test_one_bad_file_fails_the_run_but_every_file_is_reported(capsys: pytest.CaptureFixture[str]) -> None:
    bad = INVALID / "35-trial-measure-too-short.yaml"
    assert main(["validate", "-f", str(bad), "-f", str(MINIMAL)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out == [f"{bad}: spec.trial.measureSeconds: must be at least 5 (got 1)", f"{MINIMAL}: llama-8b: valid"]


def test_multi_document_files_name_the_document(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "two.yaml"
    path.write_text(MINIMAL.read_text() + "---\n" + (INVALID / "30-slo-headroom-negative.yaml").read_text())
    assert main(["validate", "-f", str(path)]) == 1
    assert capsys.readouterr().out.splitlines() == [
        f"{path}[1]: llama-8b: valid",
        f"{path}[2]: spec.slo.headroomPercent: must be at least 0 (got -5)",
    ]


@pytest.mark.parametrize("content, needle", [
    pytest.param("", "no BatchTuning found", id="empty"),
    pytest.param("a: [b\n", "not valid YAML", id="broken-yaml"),
    pytest.param("apiVersion: v1\nkind: Pod\n", "kind: must be BatchTuning (got \"Pod\")", id="other-kind"),
])
def test_files_without_a_batchtuning_fail(tmp_path: Path, content: str, needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "x.yaml"
    path.write_text(content)
    assert main(["validate", "-f", str(path)]) == 1
    assert needle in capsys.readouterr().out


def test_unreadable_file_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", "-f", str(tmp_path / "absent.yaml")]) == 1
    assert "cannot read" in capsys.readouterr().err


def test_help_says_what_validate_checks_beyond_the_crd(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["validate", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    for needle in ("Checked beyond the CRD", "yes/no/on/off", "010", "explicit nulls in spec", "1 MiB",
                   "extraArgs", "EmptySearchSpace", "Not checked"):
        assert needle in out, needle


def test_a_partly_pruned_search_space_is_valid_with_a_note(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "pruned.yaml"
    path.write_text(MINIMAL.read_text().replace("max: 256", "max: 256\n    maxNumBatchedTokens: [64, 8192]"))
    assert main(["validate", "-f", str(path)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"{path}: llama-8b: valid (note: 2 of 12 candidate settings would be refused by vLLM and are pruned; "
        "batchtune plan lists them)"]


def test_an_unreadable_document_does_not_hide_the_others(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "three.yaml"
    second = MINIMAL.read_text().replace("name: llama-8b\nspec", "name: second\nspec").replace("max: 256", "max: 0400")
    path.write_text(MINIMAL.read_text() + "---\n" + second + "---\n" + MINIMAL.read_text())
    assert main(["validate", "-f", str(path)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{path}[1]: llama-8b: valid" and out[2] == f"{path}[3]: llama-8b: valid"
    assert out[1].startswith(f"{path}[2]: spec.searchSpace.maxNumSeqs.max: is read as the octal number 256")


def test_an_empty_mode_is_never_auto(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "empty-mode.yaml"
    path.write_text(MINIMAL.read_text() + "  apply:\n    mode:\n")
    assert main(["validate", "-f", str(path)]) == 1
    assert capsys.readouterr().out.startswith(f"{path}: spec.apply.mode: is empty (null): the API server drops")


@pytest.mark.parametrize("url, words", [
    pytest.param("http://2852039166/", "169.254.169.254 is a link-local address", id="decimal-ipv4-metadata"),
    pytest.param("http://[::ffff:a9fe:a9fe]/", "IPv6 form of 169.254.169.254", id="ipv4-mapped"),
    pytest.param("http://[64:ff9b::a9fe:a9fe]/", "IPv6 form of 169.254.169.254", id="nat64"),
    pytest.param("http://[fd00:0ec2::254]/", "cloud metadata address", id="aws-ipv6-metadata"),
    pytest.param("http://metadata.google.internal./", "cloud metadata service", id="gce-name"),
    pytest.param("http://%31%36%39.254.169.254/", "percent-encoding", id="percent-encoded-host"),
    pytest.param("http://prom:9090/#/x", "fragment", id="fragment"),
    pytest.param("http://127.0.0.1:9090", "loopback", id="loopback"),
])
def test_validate_refuses_a_prometheus_url_as_the_operator_does(url: str, words: str, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from batchtune.core.policy import prometheus_url_problem

    path = tmp_path / "url.yaml"
    path.write_text(MINIMAL.read_text().replace("http://prometheus-operated.monitoring.svc:9090", url))
    assert main(["validate", "-f", str(path)]) == 1
    out = capsys.readouterr().out.splitlines()
    operator_says = prometheus_url_problem(url, ())
    assert operator_says is not None and words in operator_says
    assert out == [f"{path}: {operator_says.replace('spec.prometheus.url ', 'spec.prometheus.url: ', 1)}"]
