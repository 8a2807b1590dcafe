"""Pure parts of the local cluster: polling, kubeconfigs, tokens, Prometheus relabelling, PID records."""

from __future__ import annotations

import csv
import os
import re
import shutil
import socket

import pytest
import yaml

from batchtune_local import health, pki, processes, prometheus


def test_wait_for_returns_the_first_truthy_value():
    answers = iter([None, 0, {"ready": True}])
    assert health.wait_for(lambda: next(answers), timeout=5, interval=0) == {"ready": True}


def test_wait_for_names_what_and_the_last_error_on_timeout():
    def boom() -> bool:
        raise ValueError("apiserver said no")

    with pytest.raises(health.Timeout, match=r"pods Ready not met within 0.05s .*apiserver said no"):
        health.wait_for(boom, timeout=0.05, interval=0.01, what="pods Ready")


def test_wait_for_stops_at_once_on_give_up():
    calls = []

    def dead() -> bool:
        calls.append(1)
        raise health.GiveUp("etcd exited")

    with pytest.raises(health.GiveUp, match="etcd exited"):
        health.wait_for(dead, timeout=30, interval=0.01)
    assert len(calls) == 1


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")
def test_tokens_give_admin_masters_and_operator_no_groups(tmp_path):
    pki.ensure_pki(tmp_path, shutil.which("openssl"))
    rows = {row[1]: row for row in csv.reader((tmp_path / "tokens.csv").read_text().splitlines())}
    assert rows[pki.ADMIN.user][3:] == ["system:masters"]
    assert rows[pki.OPERATOR.user][3:] == []
    assert len({row[0] for row in rows.values()}) == len(rows), "tokens must differ"
    assert pki.token_of(tmp_path, pki.OPERATOR) == rows[pki.OPERATOR.user][0]


def test_kubeconfig_carries_server_ca_and_token(tmp_path):
    path = pki.write_kubeconfig(tmp_path / "k", "https://127.0.0.1:6443", tmp_path / "ca.crt", "u", token="t0k")
    config = yaml.safe_load(path.read_text())
    assert config["clusters"][0]["cluster"] == {"server": "https://127.0.0.1:6443",
                                                "certificate-authority": str(tmp_path / "ca.crt")}
    assert config["users"][0] == {"name": "u", "user": {"token": "t0k"}}
    assert oct(path.stat().st_mode & 0o777) == "0o600"


def test_kubeconfig_without_credentials_names_the_user(tmp_path):
    with pytest.raises(ValueError, match="user='nobody'"):
        pki.write_kubeconfig(tmp_path / "k", "https://127.0.0.1:1", tmp_path / "ca.crt", "nobody")


def _relabel(labels: dict[str, str]) -> dict[str, str] | None:
    """Apply the pod job's relabel rules the way Prometheus does (replace/keep/drop, anchored regex)."""
    labels = dict(labels)
    for rule in prometheus.pod_relabel_configs():
        value = ";".join(labels.get(name, "") for name in rule["source_labels"])
        match = re.fullmatch(rule.get("regex", "(.*)"), value)
        action = rule.get("action", "replace")
        if action == "keep" and not match or action == "drop" and match:
            return None
        if action == "replace" and match:
            labels[rule["target_label"]] = match.expand(rule.get("replacement", "$1").replace("$", "\\"))
    return {k: v for k, v in labels.items() if not k.startswith("__") or k in ("__address__", "__metrics_path__")}


POD = {"__address__": "127.1.0.5:8000", "__meta_kubernetes_namespace": "ns", "__meta_kubernetes_pod_name": "p",
       "__meta_kubernetes_pod_container_name": "vllm", "__meta_kubernetes_pod_phase": "Running",
       "__metrics_path__": "/metrics"}
ANNOTATION = "__meta_kubernetes_pod_annotation_prometheus_io_"


@pytest.mark.parametrize(("extra", "address", "path"), [
    pytest.param({f"{ANNOTATION}scrape": "true"}, "127.1.0.5:8000", "/metrics", id="annotated"),
    pytest.param({f"{ANNOTATION}scrape": "true", f"{ANNOTATION}port": "9100", f"{ANNOTATION}path": "/m"},
                 "127.1.0.5:9100", "/m", id="annotated-port-and-path"),
    pytest.param({"__meta_kubernetes_pod_container_port_name": "metrics"}, "127.1.0.5:8000", "/metrics",
                 id="port-named-metrics"),
    pytest.param({"__meta_kubernetes_pod_container_port_name": "http"}, "127.1.0.5:8000", "/metrics",
                 id="port-named-http"),
])
def test_declared_pods_are_scraped_with_pod_labels(extra, address, path):
    target = _relabel({**POD, **extra})
    assert target is not None
    assert (target["__address__"], target["__metrics_path__"]) == (address, path)
    assert (target["namespace"], target["pod"], target["container"]) == ("ns", "p", "vllm")


@pytest.mark.parametrize("extra", [
    pytest.param({}, id="undeclared"),
    pytest.param({"__meta_kubernetes_pod_container_port_name": "grpc"}, id="other-port-name"),
    pytest.param({"__meta_kubernetes_pod_container_port_name": "metrics", f"{ANNOTATION}scrape": "false"},
                 id="opted-out"),
    pytest.param({f"{ANNOTATION}scrape": "true", "__meta_kubernetes_pod_phase": "Succeeded"}, id="finished"),
    pytest.param({f"{ANNOTATION}scrape": "true", "__meta_kubernetes_pod_container_init": "true"}, id="init"),
])
def test_other_pods_are_not_scraped(extra):
    assert _relabel({**POD, **extra}) is None


def test_gpu_job_keeps_the_node_agents_pod_labels():
    config = prometheus.render_config(api_server="https://127.0.0.1:1", ca_file="ca", token_file="t",
                                      gpu_metrics_target="127.0.0.1:9400", scrape_interval_s=0.5)
    gpu = next(job for job in config["scrape_configs"] if job["job_name"] == prometheus.GPU_JOB)
    assert gpu["honor_labels"] is True
    assert config["global"]["scrape_interval"] == "0.5s"


def test_start_ticks_tell_a_live_process_from_a_reused_pid():
    me = processes.Managed("me", os.getpid(), processes.start_ticks(os.getpid()) or -1, (), "")
    assert processes.is_alive(me)
    assert not processes.is_alive(processes.Managed("me", os.getpid(), me.start_ticks + 1, (), ""))


def test_listening_ports_sees_a_loopback_listener():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert port in processes.listening_ports()
    assert port not in processes.listening_ports()


def test_free_ports_are_distinct():
    ports = processes.free_ports(7)
    assert len(set(ports)) == 7


@pytest.mark.parametrize(("owned", "other_user_alive", "stops"), [
    pytest.param(True, False, True, id="tests-started-last-user"),
    pytest.param(True, True, False, id="tests-started-still-used"),
    pytest.param(False, False, False, id="started-by-hand"),
])
def test_detach_stops_only_a_test_started_cluster_nobody_uses(tmp_path, monkeypatch, owned, other_user_alive, stops):
    from batchtune_local import cluster

    stopped = []
    monkeypatch.setattr(cluster, "down", lambda state, log: stopped.append(state))
    users = tmp_path / "users"
    users.mkdir()
    (users / str(os.getpid())).write_text(str(processes.start_ticks(os.getpid())))
    # PID 1 stands in for another session; a wrong start time marks it dead.
    ticks = processes.start_ticks(1) if other_user_alive else -5
    (users / "1").write_text(str(ticks))
    if owned:
        (tmp_path / cluster.TEST_OWNED).write_text("0")
    assert cluster.detach(tmp_path, log=lambda _: None) is stops
    assert bool(stopped) is stops
    assert not (users / str(os.getpid())).exists()
