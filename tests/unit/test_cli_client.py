"""batchtune.client: where the kubeconfig comes from, and how API failures become one clear message."""

from __future__ import annotations

import socket
from pathlib import Path

import cli_fakes
import pytest

from batchtune import client


@pytest.fixture
def api():
    fake = cli_fakes.FakeApi()
    yield fake
    fake.close()


@pytest.mark.parametrize("explicit, env, expected", [
    pytest.param("/x/kc", "/y/kc", "/x/kc", id="flag-wins"),
    pytest.param(None, "/y/kc", "/y/kc", id="env"),
    pytest.param(None, None, "HOME/.kube/config", id="home-default"),
])
def test_kubeconfig_path(explicit, env, expected, monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    if env:
        monkeypatch.setenv("KUBECONFIG", env)
    else:
        monkeypatch.delenv("KUBECONFIG", raising=False)
    assert client.kubeconfig_path(explicit) == Path(expected.replace("HOME", str(tmp_path)))


def test_kubeconfig_path_takes_the_first_existing_entry_of_a_list(monkeypatch, tmp_path):
    present = tmp_path / "b"
    present.write_text("{}")
    monkeypatch.setenv("KUBECONFIG", f"{tmp_path / 'a'}:{present}")
    assert client.kubeconfig_path() == present


def test_missing_kubeconfig_names_the_path_and_the_fix(tmp_path):
    with pytest.raises(client.KubeconfigMissing, match=r"no kubeconfig at .*/nope \(--kubeconfig\)"):
        client.connect(str(tmp_path / "nope"))


@pytest.mark.parametrize("content, message", [
    pytest.param("{}", "kubeconfig .*", id="empty"),
    pytest.param("::: not yaml", "kubeconfig .*", id="garbage"),
])
def test_broken_kubeconfig_is_a_cli_error(tmp_path, content, message):
    path = tmp_path / "kc"
    path.write_text(content)
    with pytest.raises(client.CliError, match=message):
        client.connect(str(path))


def test_unknown_context_is_a_cli_error(api, tmp_path):
    path = api.kubeconfig(tmp_path / "kc")
    with pytest.raises(client.CliError, match="kubeconfig"):
        client.connect(str(path), context="nope")


@pytest.mark.parametrize("namespace, expected", [pytest.param("team-a", "team-a", id="context-namespace"),
                                                 pytest.param(None, "default", id="default")])
def test_default_namespace_comes_from_the_context(api, tmp_path, namespace, expected):
    kube = client.connect(str(api.kubeconfig(tmp_path / "kc", namespace=namespace)))
    assert kube.namespace(None) == expected
    assert kube.namespace("explicit") == "explicit"


def test_unreachable_api_server(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # Nothing listens on the port once the socket is closed.
    fake = cli_fakes.FakeApi()
    fake.url = f"http://127.0.0.1:{port}"
    path = fake.kubeconfig(tmp_path / "kc")
    fake.close()
    kube = client.connect(str(path))
    with pytest.raises(client.ApiUnreachable, match=f"cannot reach the API server at http://127.0.0.1:{port}"):
        kube.get_batchtuning("default", "x")


def test_get_report_decodes_binary_data(api, tmp_path):
    api.add_report("inference", "llama-8b", {"trials.csv": "name\n"}, {"curves.png": b"\x89PNG\r\n\x1a\nrest"})
    kube = client.connect(str(api.kubeconfig(tmp_path / "kc")))
    stored = kube.get_report("inference", "llama-8b")
    assert stored is not None and not stored.controllers  # written by someone, owned by no one
    assert stored.files == {"trials.csv": b"name\n", "curves.png": b"\x89PNG\r\n\x1a\nrest"}
    assert kube.get_report("inference", "other") is None


def test_get_report_forbidden(api, tmp_path):
    api.routes["/api/v1/namespaces/inference/configmaps/llama-8b-report"] = cli_fakes.forbidden("no")
    kube = client.connect(str(api.kubeconfig(tmp_path / "kc")))
    with pytest.raises(client.Forbidden, match="get ConfigMap inference/llama-8b-report"):
        kube.get_report("inference", "llama-8b")
