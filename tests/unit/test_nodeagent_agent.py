"""Agent-level pure parts: the Node manifest, CLI parsing, and GPU samples from allocations and reports."""

from __future__ import annotations

import pytest

from batchtune.gpu_activity import write_activity
from batchtune_local.nodeagent.__main__ import _taint, build_parser
from batchtune_local.nodeagent.agent import AgentConfig, NodeAgent, node_manifest


def test_node_manifest_has_gpus_labels_and_ready(tmp_path):
    config = AgentConfig(kubeconfig=None, state_dir=tmp_path, gpus_per_node=4, gpu_product="NVIDIA-L4",
                         extra_labels={"pool": "a"}, taints=({"key": "pool", "value": "a", "effect": "NoSchedule"},))
    node = node_manifest(config, "gpu-node-3", "v1.36.3")
    labels = node["metadata"]["labels"]
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-L4" and labels["kubernetes.io/hostname"] == "gpu-node-3"
    assert labels["pool"] == "a"
    assert node["status"]["capacity"]["nvidia.com/gpu"] == "4" == node["status"]["allocatable"]["nvidia.com/gpu"]
    assert {c["type"]: c["status"] for c in node["status"]["conditions"]}["Ready"] == "True"
    assert node["status"]["addresses"] == [{"type": "InternalIP", "address": "127.0.0.1"}]  # no DNS lookups
    assert node["spec"]["taints"] == [{"key": "pool", "value": "a", "effect": "NoSchedule"}]
    assert node["status"]["nodeInfo"]["kubeletVersion"] == "v1.36.3"


@pytest.mark.parametrize(
    "text, expected",
    [
        pytest.param("a=b:NoSchedule", {"key": "a", "value": "b", "effect": "NoSchedule"}, id="key-value"),
        pytest.param("a:NoExecute", {"key": "a", "effect": "NoExecute"}, id="key-only"),
    ],
)
def test_taint_parsing(text, expected):
    assert _taint(text) == expected


def test_bad_taint_names_the_flag():
    with pytest.raises(ValueError, match="--node-taint.*'a=b'"):
        _taint("a=b")


def test_cli_defaults_match_the_contract():
    args = build_parser().parse_args(["--state-dir", "/tmp/x"])
    assert (args.nodes, args.gpus_per_node, args.gpu_product, args.node_prefix, args.time_scale) == (
        2, 8, "NVIDIA-H100-80GB-HBM3", "gpu-node-", 1.0)


def test_gpu_samples_map_reports_to_node_gpus(tmp_path):
    config = AgentConfig(kubeconfig=None, state_dir=tmp_path, nodes=1, gpus_per_node=4,
                         metrics_address="127.0.0.1:0", kubelet_address="")
    agent = NodeAgent(config, api=object())  # no API calls in this path
    try:
        agent.store.admit("u0", "team", "other", "gpu-node-0", {"main": 1}, 4, 0.0)  # holds GPU 0, reports nothing
        record = agent.store.admit("u1", "team", "vllm-0", "gpu-node-0", {"vllm": 2}, 4, 0.0)  # GPUs 1, 2
        assert record["gpus"] == {"vllm": [1, 2]}
        report = tmp_path / "pods" / "team_vllm-0_u1" / ".batchtune" / "vllm.gpu-activity.json"
        write_activity(report, [{"index": 1, "gpu_util_pct": 88.0, "fb_used_mib": 70000}])
        samples = {s.index: s for s in agent.gpu_samples()}
        assert samples[2].holder.pod == "vllm-0" and samples[2].activity["gpu_util_pct"] == 88.0
        assert samples[1].holder.position == 0 and samples[1].activity is None  # position 0 did not report
        assert samples[0].holder.pod == "other" and samples[3].holder is None
    finally:
        agent.metrics.server.server_close()


def test_sweep_kills_processes_of_pods_the_api_no_longer_has(tmp_path):
    import json
    import subprocess
    import time
    from types import SimpleNamespace

    from kubernetes import client

    from batchtune_local.nodeagent.process import start_ticks

    class Core:
        def read_namespaced_pod(self, name, namespace, **_):
            if name == "gone":
                raise client.ApiException(status=404)
            return SimpleNamespace(data=json.dumps({"metadata": {"uid": "u-kept"}}).encode())

    config = AgentConfig(kubeconfig=None, state_dir=tmp_path, nodes=1, metrics_address="127.0.0.1:0",
                         kubelet_address="")
    agent = NodeAgent(config, api=SimpleNamespace(client=client, core=Core()))
    sleepers = {name: subprocess.Popen(["sleep", "60"], start_new_session=True) for name in ("gone", "kept")}
    try:
        for name, proc in sleepers.items():
            agent.store.admit(f"u-{name}", "ns", name, "gpu-node-0", {"main": 1}, 8, 0.0)
            agent.store.set_process(f"u-{name}", "main", {"pid": proc.pid, "ticks": start_ticks(proc.pid),
                                                          "startedAt": 0.0})
        agent.collect_orphans(check_api=True)
        assert sleepers["gone"].wait(5) == -9
        time.sleep(0.1)
        assert sleepers["kept"].poll() is None
        assert agent.store.pod("u-gone") is None and agent.store.pod("u-kept") is not None
    finally:
        for proc in sleepers.values():
            proc.kill()
            proc.wait()
        agent.metrics.server.server_close()
