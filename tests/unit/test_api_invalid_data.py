"""Malformed BatchTunings are rejected by the models and by the CRD (schema + CEL, offline); samples pass both.

Each file under tests/data/invalid/ starts with `# expect: <field path>`: the models must name
exactly that field, and the CRD must reject the object at that field or one of its ancestors.
"""

from __future__ import annotations

from pathlib import Path

import api_crd
import pytest
import yaml

from batchtune.api import InvalidBatchTuning, load_file

REPO = Path(__file__).resolve().parents[2]
INVALID = sorted((REPO / "tests" / "data" / "invalid").glob("*.yaml"))
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
    errors = api_crd.validate(_document(path))
    assert errors, "the CRD's schema and CEL rules accepted a malformed object"
    assert any(api_crd.related(e.path, expect) for e in errors), errors


@pytest.mark.parametrize("path", [pytest.param(p, id=p.stem) for p in SAMPLES])
def test_samples_pass_the_models(path: Path) -> None:
    (bt,) = load_file(path)
    assert bt.metadata.name


@pytest.mark.parametrize("path", [pytest.param(p, id=p.stem) for p in SAMPLES])
def test_samples_pass_the_crd_offline(path: Path) -> None:
    assert api_crd.validate(_document(path)) == []


def test_samples_include_a_minimal_and_a_full_one() -> None:
    assert {p.name for p in SAMPLES} >= {"batchtuning-minimal.yaml", "batchtuning-full.yaml"}
