"""Container environment resolution as the kubelet does it."""

from __future__ import annotations

from decimal import Decimal

import pytest

from batchtune_local.nodeagent.env import EnvError, PodNetwork, expand, parse_quantity, resolve_env

POD = {
    "metadata": {"name": "web-0", "namespace": "team", "uid": "u-1", "labels": {"app": "web"},
                 "annotations": {"note": "hi"}},
    "spec": {"nodeName": "gpu-node-1", "serviceAccountName": "default"},
}
NET = PodNetwork("127.1.0.9", "127.0.0.1")
CONFIG_MAPS = {("team", "cfg"): {"MODEL": "llama", "PORT": "8000"}}
SECRETS = {("team", "sec"): {"TOKEN": "s3cret"}}


def resolve(container, allocatable=None):
    return resolve_env(POD, container, NET, config_map=lambda ns, n: CONFIG_MAPS.get((ns, n)),
                       secret=lambda ns, n: SECRETS.get((ns, n)), node_allocatable=allocatable)


def field(path):
    return {"valueFrom": {"fieldRef": {"fieldPath": path}}}


@pytest.mark.parametrize(
    "var, expected",
    [
        pytest.param({"value": "plain"}, "plain", id="value"),
        pytest.param(field("metadata.name"), "web-0", id="pod-name"),
        pytest.param(field("metadata.namespace"), "team", id="namespace"),
        pytest.param(field("metadata.uid"), "u-1", id="uid"),
        pytest.param(field("status.podIP"), "127.1.0.9", id="pod-ip"),
        pytest.param(field("status.hostIP"), "127.0.0.1", id="host-ip"),
        pytest.param(field("spec.nodeName"), "gpu-node-1", id="node-name"),
        pytest.param(field("metadata.labels['app']"), "web", id="label"),
        pytest.param(field("metadata.annotations['note']"), "hi", id="annotation"),
        pytest.param({"valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "MODEL"}}}, "llama", id="configmap"),
        pytest.param({"valueFrom": {"secretKeyRef": {"name": "sec", "key": "TOKEN"}}}, "s3cret", id="secret"),
        pytest.param({"valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}}, "3", id="cpu-rounds-up"),
        pytest.param({"valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}}}, "512",
                     id="memory-divisor"),
    ],
)
def test_single_var(var, expected):
    container = {"name": "c", "env": [{"name": "X", **var}],
                 "resources": {"limits": {"cpu": "2500m", "memory": "512Mi"}}}
    assert resolve(container)["X"] == expected


def test_expansion_uses_earlier_vars_and_envfrom_prefix():
    container = {
        "name": "c",
        "envFrom": [{"configMapRef": {"name": "cfg"}, "prefix": "CFG_"}],
        "env": [{"name": "URL", "value": "http://$(HOST):$(CFG_PORT)/$$x/$(NOPE)"}, {"name": "HOST", "value": "h"}],
    }
    env = resolve(container)
    assert env["CFG_MODEL"] == "llama"
    assert env["URL"] == "http://$(HOST):8000/$x/$(NOPE)"  # HOST is defined later: not expanded


@pytest.mark.parametrize(
    "container, message",
    [
        pytest.param({"env": [{"name": "X", "valueFrom": {"configMapKeyRef": {"name": "nope", "key": "k"}}}]},
                     'configmap "nope" not found', id="missing-configmap"),
        pytest.param({"env": [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "sec", "key": "k"}}}]},
                     "couldn't find key k in Secret team/sec", id="missing-key"),
        pytest.param({"envFrom": [{"secretRef": {"name": "nope"}}]}, 'secret "nope" not found', id="missing-secret"),
        pytest.param({"env": [{"name": "X", **field("spec.bogus")}]}, "'spec.bogus' is not supported", id="bad-field"),
    ],
)
def test_errors_name_the_object(container, message):
    with pytest.raises(EnvError, match=message):
        resolve({"name": "c", **container})


def test_optional_refs_are_skipped():
    env = resolve({"name": "c", "envFrom": [{"configMapRef": {"name": "nope", "optional": True}}],
                   "env": [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "nope", "key": "k", "optional": True}}}]})
    assert "X" not in env


def test_resource_without_limit_uses_node_allocatable():
    container = {"name": "c", "env": [{"name": "G", "valueFrom": {"resourceFieldRef": {"resource": "limits.nvidia.com/gpu"}}}]}
    assert resolve(container, {"nvidia.com/gpu": "8"})["G"] == "8"


@pytest.mark.parametrize(
    "text, expected",
    [("500m", Decimal("0.5")), ("2", Decimal(2)), ("1Gi", Decimal(2**30)), ("1k", Decimal(1000)),
     ("1e3", Decimal(1000))],
)
def test_parse_quantity(text, expected):
    assert parse_quantity(text) == expected


def test_expand_escape():
    assert expand("$$(A) $(A)", {"A": "1"}) == "$(A) 1"
