"""Malformed BatchTunings are rejected by the models and by the CRD (schema + CEL, offline); samples pass both.

Each file under tests/data/invalid/ starts with `# expect: <field path>`: the models must name
exactly that field, and the CRD must reject the object at that field or one of its ancestors
(offline: `api_server`, the CRD's schema and CEL plus what the API server adds around them; on a
cluster: tests/integration/test_cluster_crd.py sends the same files to the real API server).

Files under tests/data/refused/ carry the same header and a second line saying what the API server
or kubectl does instead: batchtune refuses them on purpose (a null the server would drop so the
default applies unannounced, a scalar YAML readers disagree on, a search space the operator would
fail at planning). They are kept apart because the API server would accept them, or would be sent
something else by a YAML 1.1 reader such as the integration test's.
"""

from __future__ import annotations

from pathlib import Path

import api_crd
import api_server
import pytest
import yaml

from batchtune.api import InvalidBatchTuning, load_file
from batchtune.cli import main

REPO = Path(__file__).resolve().parents[2]
INVALID = sorted((REPO / "tests" / "data" / "invalid").glob("*.yaml"))
REFUSED = sorted((REPO / "tests" / "data" / "refused").glob("*.yaml"))
SAMPLES = sorted((REPO / "manifests" / "samples").glob("*.yaml"))


def _expected_path(path: Path) -> str:
    first = path.read_text().splitlines()[0]
    assert first.startswith("# expect: "), f"{path.name} must start with '# expect: <field path>'"
    return first.removeprefix("# expect: ").strip()


def _document(path: Path) -> dict:
    (doc,) = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return doc


def test_there_are_at_least_thirty_malformed_batchtunings() -> None:
    assert len(INVALID) >= 30


@pytest.mark.parametrize("path", [pytest.param(p, id=p.stem) for p in INVALID])
def test_models_reject_naming_the_field(path: Path) -> None:
    expect = _expected_path(path)
    with pytest.raises(InvalidBatchTuning) as caught:
        load_file(path)
    paths = [e.path for e in caught.value.errors]
    assert expect in paths
    # The message a user sees names the file and the field.
    assert str(path) in str(caught.value) and f"{expect}:" in str(caught.value)


@pytest.mark.parametrize("path", [pytest.param(p, id=p.stem) for p in INVALID])
def test_crd_rejects_offline_at_the_field_or_an_ancestor(path: Path) -> None:
    expect = _expected_path(path)
    errors = api_server.validate(_document(path))
    assert errors, "the CRD's schema and CEL rules (and the API server's own checks) accepted a malformed object"
    assert any(api_crd.related(e.path, expect) for e in errors), errors


@pytest.mark.parametrize("path", [pytest.param(p, id=p.stem) for p in INVALID + REFUSED])
def test_validate_refuses_naming_the_file_and_the_field_one_line_each(
        path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    expect = _expected_path(path)
    assert path.read_text().splitlines()[1].startswith("# ")
    assert main(["validate", "-f", str(path)]) == 1
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert lines and all(line.startswith(f"{path}: ") for line in lines), captured.out
    assert any(line.startswith(f"{path}: {expect}: ") for line in lines), captured.out
    assert captured.err == ""


@pytest.mark.parametrize("path", [pytest.param(p, id=p.stem) for p in REFUSED])
def test_refused_files_say_what_the_api_server_or_kubectl_does_instead(path: Path) -> None:
    assert path.read_text().splitlines()[1].startswith(("# API server: ", "# kubectl: ", "# CRD: "))


@pytest.mark.parametrize("path", [pytest.param(p, id=p.stem) for p in REFUSED
                                  if p.read_text().splitlines()[1].startswith(("# API server: ", "# CRD: "))])
def test_refused_on_purpose_are_accepted_by_the_api_server(path: Path) -> None:
    # What kubectl sends for these equals what PyYAML reads; the server (offline) accepts it, which is
    # why they are not under invalid/: the refusal is batchtune's.
    assert api_server.validate(_document(path)) == []


@pytest.mark.parametrize("path", [pytest.param(p, id=p.stem) for p in SAMPLES])
def test_samples_pass_the_models(path: Path) -> None:
    (bt,) = load_file(path)
    assert bt.metadata.name


@pytest.mark.parametrize("path", [pytest.param(p, id=p.stem) for p in SAMPLES])
def test_samples_pass_the_crd_offline(path: Path) -> None:
    assert api_crd.validate(_document(path)) == []
    assert api_server.validate(_document(path)) == []


def test_samples_include_a_minimal_and_a_full_one() -> None:
    assert {p.name for p in SAMPLES} >= {"batchtuning-minimal.yaml", "batchtuning-full.yaml"}
