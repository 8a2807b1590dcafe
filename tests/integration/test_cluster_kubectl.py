"""The built kubectl matches the API server, and RBAC is really enforced for the operator identity."""

from __future__ import annotations

import json
import secrets

import pytest

pytestmark = pytest.mark.integration


def test_kubectl_client_and_server_have_the_same_minor(kubectl):
    versions = json.loads(kubectl("version", "-o", "json").stdout)
    client, server = versions["clientVersion"], versions["serverVersion"]
    assert (client["major"], client["minor"]) == (server["major"], server["minor"]), versions
    assert server["gitVersion"].startswith(f"v{server['major']}.{server['minor']}."), server


def test_operator_identity_has_no_permissions_by_default(kubectl, cluster, namespace):
    """Other tests on this lane's cluster may have granted the operator the chart's role by now, so the identity
    is held to what no grant gives it, and a new identity from the same CA to the empty default."""
    from batchtune_local import make_kubeconfig

    whoami = json.loads(kubectl("auth", "whoami", "-o", "json", kubeconfig=cluster.operator_kubeconfig).stdout)
    assert whoami["status"]["userInfo"]["username"] == "batchtune-operator"
    denied = kubectl("get", "clusterrolebindings", kubeconfig=cluster.operator_kubeconfig, check=False)
    assert denied.returncode != 0 and "forbidden" in denied.stderr.lower(), denied.stderr
    fresh = make_kubeconfig(cluster, f"nobody-{secrets.token_hex(3)}")
    denied = kubectl("get", "pods", "-n", namespace, kubeconfig=fresh, check=False)
    assert denied.returncode != 0 and "forbidden" in denied.stderr.lower(), denied.stderr


def test_rbac_grant_reaches_the_operator_identity(kubectl, cluster, namespace, wait_for):
    kubectl("create", "role", "pod-reader", "--verb=list", "--resource=pods", "-n", namespace)
    kubectl("create", "rolebinding", "pod-reader", "--role=pod-reader", "--user=batchtune-operator", "-n", namespace)
    wait_for(lambda: kubectl("get", "pods", "-n", namespace, kubeconfig=cluster.operator_kubeconfig,
                             check=False).returncode == 0, timeout=10, what="operator can list pods")


def test_make_kubeconfig_gives_a_certificate_identity(kubectl, cluster):
    from batchtune_local import make_kubeconfig

    path = make_kubeconfig(cluster, "alice", ("team-a",))
    whoami = json.loads(kubectl("auth", "whoami", "-o", "json", kubeconfig=path).stdout)
    assert whoami["status"]["userInfo"]["username"] == "alice"
    assert "team-a" in whoami["status"]["userInfo"]["groups"]
