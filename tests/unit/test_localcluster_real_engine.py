"""The real-engine tier's pure parts: the vLLM launcher's argv and env, emptyDir paths, the image map, and the
twin's CPU node the tier's nodes are labelled with. The real server itself: tests/integration/test_real_vllm.py."""

from __future__ import annotations

import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from batchtune.core.planning import FitVerdict
from batchtune.engines import VLLM
from batchtune.twin.catalog import get_model, gpu_from_product_label
from batchtune.twin.config import ServeConfig
from batchtune.twin.memory import StartupFailure, plan_memory
from batchtune_local import cluster
from batchtune_local.nodeagent.images import load_image_map
from batchtune_local.nodeagent.pod import NodeSettings, PodWorker
from batchtune_local.nodeagent.products import product_for_label
from batchtune_local.nodeagent.state import StateStore
from batchtune_local.nodeagent.volumes import empty_dir_mounts, rewrite_path
from batchtune_local.realvllm import plan

VENV = Path("/opt/vllm-venv")
ENV = {"BATCHTUNE_POD_IP": "127.40.0.7", "PATH": "/usr/bin", "VIRTUAL_ENV": "/work/.venv", "PYTHONPATH": "/x",
       "HOME": "/root"}


def test_serve_runs_the_venv_vllm_bound_to_the_pod_ip_offline():
    exe, argv, env = plan(["vllm", "serve", "/m", "--host", "0.0.0.0", "--port", "8000"], VENV, ENV)
    assert exe == "/opt/vllm-venv/bin/vllm"
    assert argv == [exe, "serve", "/m", "--port", "8000", "--host", "127.40.0.7"]
    assert env["VLLM_HOST_IP"] == "127.40.0.7" and env["HF_HUB_OFFLINE"] == "1" and env["VLLM_NO_USAGE_STATS"] == "1"
    assert env["VIRTUAL_ENV"] == str(VENV) and "PYTHONPATH" not in env
    assert env["PATH"].startswith("/opt/vllm-venv/bin:") and env["HOME"] == "/root"
    assert "VLLM_CPU_KVCACHE_SPACE" not in env
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"  # every server would pin its worker to core 0
    assert env["OMP_NUM_THREADS"] == "1"
    assert plan(["serve"], VENV, {**ENV, "VLLM_CPU_OMP_THREADS_BIND": "1"})[2]["VLLM_CPU_OMP_THREADS_BIND"] == "1"


def test_the_image_entrypoint_and_other_spellings():
    assert plan(["serve", "/m", "--host=1.2.3.4"], VENV, ENV)[1][1:] == ["serve", "/m", "--host", "127.40.0.7"]
    assert plan(["/usr/local/bin/vllm", "bench", "serve", "--host", "x"], VENV, ENV)[1][1:] == \
        ["bench", "serve", "--host", "x"]  # the bench's --host names the server; --base-url wins anyway
    exe, argv, _ = plan(["python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m"], VENV, ENV)
    assert exe == "/opt/vllm-venv/bin/python"
    assert argv == [exe, "-m", "vllm.entrypoints.openai.api_server", "--model", "/m", "--host", "127.40.0.7"]
    assert plan([], VENV, ENV)[1][1:] == ["serve", "--host", "127.40.0.7"]
    # A pod that sets the KV-cache size itself keeps it.
    assert plan(["serve"], VENV, {**ENV, "VLLM_CPU_KVCACHE_SPACE": "1"})[2]["VLLM_CPU_KVCACHE_SPACE"] == "1"
    with pytest.raises(ValueError, match="loopback"):
        plan(["serve"], VENV, {**ENV, "BATCHTUNE_POD_IP": "10.0.0.1"})


def test_empty_dir_mounts_and_path_rewriting(tmp_path):
    spec = {"volumes": [{"name": "tmp", "emptyDir": {}}, {"name": "cfg", "configMap": {"name": "c"}}]}
    container = {"volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, {"name": "cfg", "mountPath": "/etc/x"},
                                  {"name": "tmp", "mountPath": "/scratch/", "subPath": "a"}]}
    mounts = empty_dir_mounts(spec, container, tmp_path)
    assert mounts == {"/tmp": tmp_path / "tmp", "/scratch": tmp_path / "tmp" / "a"}
    assert rewrite_path("/tmp/result.json", mounts) == f"{tmp_path}/tmp/result.json"
    assert rewrite_path("/tmp", mounts) == f"{tmp_path}/tmp"
    assert rewrite_path("--result-dir=/tmp/r", mounts) == f"--result-dir={tmp_path}/tmp/r"
    assert rewrite_path("/tmpfoo", mounts) == "/tmpfoo"
    assert rewrite_path("/etc/x/y", mounts) == "/etc/x/y"
    assert rewrite_path("x=/tmp", mounts) == "x=/tmp"  # only flags are split at "="


def test_a_pods_containers_share_its_empty_dir_and_not_the_hosts(tmp_path):
    """An init container writes /tmp/out on an emptyDir, the app container reads it: a per-pod directory."""
    images = load_image_map(_test_map(tmp_path))
    settings = NodeSettings(node="gpu-node-0", gpu_product="NVIDIA-L4", gpus_per_node=1, image_map=images,
                            state_dir=tmp_path, base_env={"PATH": "/usr/bin:/bin"})
    mount = [{"name": "tmp", "mountPath": "/tmp"}]
    pod = {"metadata": {"name": "p", "namespace": "t", "uid": str(uuid.uuid4())},
           "spec": {"nodeName": "gpu-node-0", "restartPolicy": "Never", "volumes": [{"name": "tmp", "emptyDir": {}}],
                    "initContainers": [{"name": "write", "image": "batchtune.test/sh", "volumeMounts": mount,
                                        "command": [sys.executable, "-c",
                                                    "import sys; open(sys.argv[1], 'w').write('hi')", "/tmp/out"]}],
                    "containers": [{"name": "read", "image": "batchtune.test/sh", "volumeMounts": mount,
                                    "env": [{"name": "OUT", "value": "/tmp/out"}],
                                    "command": [sys.executable, "-c",
                                                "import os; assert open(os.environ['OUT']).read() == 'hi'"]}]},
           "status": {"phase": "Pending"}}

    class Api:
        def patch_status(self, namespace, name, status):
            self.last = status

        def config_map(self, namespace, name):
            return None

        secret = config_map

        def event(self, *args):
            pass

        def delete_pod(self, *args):
            pass

    api = Api()
    worker = PodWorker(pod, settings, StateStore(tmp_path, "127.43.0.0/16"), api)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and getattr(api, "last", {}).get("phase") not in ("Succeeded", "Failed"):
        worker.tick()
        time.sleep(0.05)
    assert api.last["phase"] == "Succeeded", api.last
    assert (tmp_path / "pods" / worker.dir_name / "volumes" / "tmp" / "out").read_text() == "hi"
    worker.shutdown()
    worker.tick()


def _test_map(tmp_path: Path) -> Path:
    path = tmp_path / "images.yaml"
    path.write_text("images:\n  - match: 'batchtune.test/*'\n    run: []\n")
    return path


def test_real_vllm_image_map_comes_first_and_keeps_the_base_rules(tmp_path, monkeypatch):
    monkeypatch.setattr(cluster, "real_vllm_paths", lambda: {"VLLM_PYTHON": "/opt/vllm-venv/bin/python"})
    path = cluster.write_real_vllm_image_map(tmp_path / "map.yaml", cluster.DEFAULT_IMAGE_MAP)
    images = load_image_map(path)
    argv = images.argv_for({"name": "vllm", "image": "vllm/vllm-openai:v0.32.0-cpu", "args": ["/m", "--port", "8000"]},
                           python="/py")
    assert argv == ["/py", "-m", "batchtune_local.realvllm", "--venv", "/opt/vllm-venv", "--", "vllm", "serve", "/m",
                    "--port", "8000"]
    bench = images.argv_for({"name": "bench", "image": "vllm/vllm-openai:v0.32.0-cpu", "command": ["vllm"],
                             "args": ["bench", "serve"]}, python="/py")
    assert bench[-3:] == ["vllm", "bench", "serve"]
    assert images.argv_for({"name": "x", "image": "batchtune.test/sh", "command": ["true"]}) == ["true"]
    assert images.argv_for({"name": "x", "image": "batchtune:dev", "command": ["batchtune"], "args": ["loadgen"]},
                           python="/py") == ["/py", "-m", "batchtune", "loadgen"]
    assert yaml.safe_load(path.read_text())["images"][0]["match"] == "*vllm*"


def test_unknown_engine_is_refused():
    with pytest.raises(cluster.ClusterError, match="engine"):
        cluster.up(cluster.ClusterConfig(engine="sglang"))


# --- the twin's CPU node ------------------------------------------------------------------------------------
def test_the_tiers_node_label_is_the_twins_cpu_node():
    gpu = gpu_from_product_label(cluster.REAL_VLLM_GPU_PRODUCT)
    assert gpu.is_cpu and gpu.name == "CPU-node"
    assert product_for_label(cluster.REAL_VLLM_GPU_PRODUCT).model_name == "batchtune CPU node"
    assert get_model("/home/me/.cache/batchtune/models/tiny-llama-v1").num_layers == 2


def _cpu(gmu: float, **kw) -> ServeConfig:
    return ServeConfig(model="tiny-llama-v1", gpu="CPU-node", max_num_seqs=16, gpu_memory_utilization=gmu,
                       max_model_len=2048, enforce_eager=True, **kw)


def test_cpu_node_memory_reads_as_vllm_cpu():
    """gmu is the share of the NUMA node for the worker; the KV pool is that less the worker's own memory.
    Real (gmu 0.10, tiny model): "Auto set (0.8/17.09) GiB for KV cache ... 0.91 GiB ... non-kv usages"."""
    plan10 = plan_memory(_cpu(0.10))
    assert 0.7 <= plan10.kv_cache_gib <= 0.9
    assert plan10.cudagraph_gib == 0 and plan10.runtime_oom_tokens is None
    with pytest.raises(StartupFailure, match=r"on startup is less than desired CPU memory utilization \(0.95"):
        plan_memory(_cpu(0.95))
    with pytest.raises(StartupFailure, match="less than requested memory for kv"):
        plan_memory(_cpu(0.04))
    assert plan_memory(_cpu(0.85)).kv_cache_gib > 13  # the twin assumes the node to itself


def test_memory_prefilter_prunes_gmu_95_on_the_cpu_node_with_vllms_reason():
    from batchtune.twin.prefilter import memory_fit

    container = {"name": "vllm", "image": "vllm/vllm-openai:v0.32.0-cpu",
                 "args": ["/cache/models/tiny-llama-v1", "--max-model-len", "2048", "--enforce-eager",
                          "--max-num-seqs", "16", "--gpu-memory-utilization", "0.10"]}
    fits, note = memory_fit(VLLM, VLLM.read(container), cluster.REAL_VLLM_GPU_PRODUCT)
    assert fits is not None and "tiny-llama-v1 on CPU-node" in note
    from batchtune.core.settings import Setting

    verdicts: dict[int, FitVerdict] = {g: fits(Setting(8, g)) for g in (10, 85, 95)}
    assert verdicts[10].fits and verdicts[85].fits
    assert not verdicts[95].fits and "desired CPU memory utilization" in verdicts[95].reason
    assert verdicts[95].memory_reason is not None and verdicts[95].memory_reason.value == "GpuMemoryUtilizationTooHigh"


def test_the_real_engine_cluster_runs_its_pods_nicer_than_the_twin_lanes_beside_it(tmp_path):
    real = cluster.ClusterConfig(state_dir=tmp_path, engine="vllm")
    assert cluster.pod_niceness(real) == cluster.REAL_ENGINE_NICENESS == 10
    assert cluster.pod_niceness(cluster.ClusterConfig(state_dir=tmp_path)) == 0  # the twin measures wall-clock
    assert cluster.pod_niceness(cluster.ClusterConfig(state_dir=tmp_path, engine="vllm", pod_niceness=0)) == 0
    with pytest.raises(cluster.ClusterError, match="pod_niceness 20"):
        cluster.pod_niceness(cluster.ClusterConfig(state_dir=tmp_path, pod_niceness=20))

