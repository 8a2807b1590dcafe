"""The BatchTuning CRD installs, and the API server itself rejects malformed BatchTunings, naming the field."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.integration

INVALID = Path(__file__).resolve().parents[1] / "data" / "invalid"
GROUP, VERSION, PLURAL = "batchtune.io", "v1alpha1", "batchtunings"
# Files whose rule only the Python models check (not expressible in the CRD schema or CEL).
# Each must still be *accepted* by the server, so this list shrinks when the CRD learns the rule.
MODEL_ONLY: dict[str, str] = {}


def _cases() -> list[pytest.ParameterSet]:
    cases = []
    for path in sorted(INVALID.glob("*.yaml")):
        match = re.search(r"^# expect: (\S+)", path.read_text(), re.MULTILINE)
        assert match, f"{path.name}: no '# expect: <field path>' header"
        cases.append(pytest.param(path, match.group(1), id=path.stem))
    return cases


def _create(kube, namespace: str, body: dict) -> tuple[int, str]:
    """Server-side dry-run create with strict field validation: (HTTP status, server message)."""
    from kubernetes.client.exceptions import ApiException

    try:
        kube.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body,
                                                    dry_run="All", field_validation="Strict")
    except ApiException as exc:
        try:
            return exc.status, json.loads(exc.body)["message"]
        except (TypeError, ValueError, KeyError):
            return exc.status, str(exc.body)
    return 201, ""


def test_crd_is_established_and_served(kube, batchtuning_crd, namespace):
    crd = kube.apiext.read_custom_resource_definition(batchtuning_crd)
    assert crd.spec.group == GROUP
    assert VERSION in [v.name for v in crd.spec.versions if v.served]
    # Served both ways; other tests' objects may exist cluster-wide, a fresh namespace has none.
    assert isinstance(kube.custom.list_cluster_custom_object(GROUP, VERSION, PLURAL)["items"], list)
    assert kube.custom.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)["items"] == []


def test_valid_batchtuning_is_accepted(kube, batchtuning_crd, namespace):
    body = yaml.safe_load((INVALID / "01-missing-target-ref.yaml").read_text())
    body["spec"]["targetRef"] = {"name": "llama-8b"}
    status, message = _create(kube, namespace, body)
    assert status == 201, message


@pytest.mark.parametrize(("path", "field"), _cases())
def test_server_rejects_invalid_batchtuning_naming_the_field(kube, batchtuning_crd, namespace, path, field):
    body = yaml.safe_load(path.read_text())
    status, message = _create(kube, namespace, body)
    if path.stem in MODEL_ONLY:
        assert status == 201, f"server now rejects {path.name}; drop it from MODEL_ONLY: {message}"
        return
    assert status in (400, 422), f"{path.name} was accepted by the API server (HTTP {status})"
    assert field in message, f"{path.name}: expected the field {field!r} in: {message}"


def test_the_server_bounds_a_command_line_in_status_by_its_total_characters(kube, batchtuning_crd, namespace):
    # The CRD's CEL rule (Kubernetes' list library `sum`) is what keeps the largest object within etcd's limit
    # (tests/unit/test_api_object_size.py): one long word is fine, a longer line in total is refused by name.
    from kubernetes.client.exceptions import ApiException

    from batchtune.core.recommend import MAX_COMMAND_LINE_CHARACTERS

    body = yaml.safe_load((INVALID / "01-missing-target-ref.yaml").read_text())
    body["spec"]["targetRef"] = {"name": "llama-8b"}
    body["metadata"] = {"name": "command-line-bound"}
    kube.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)

    def write(args: list[str]) -> tuple[int, str]:
        try:
            kube.custom.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, PLURAL, body["metadata"]["name"],
                                                             {"status": {"baseline": {"args": args}}})
        except ApiException as exc:
            return exc.status, json.loads(exc.body)["message"]
        return 200, ""

    whole = ["sh", "-c", "x" * (MAX_COMMAND_LINE_CHARACTERS - 4)]  # a shell-form line: one word nearly all of it
    assert write(whole) == (200, "")
    status, message = write([*whole, "y"])
    assert status == 422 and "status.baseline.args" in message and \
        f"at most {MAX_COMMAND_LINE_CHARACTERS} characters" in message, (status, message)
