"""dcgm-exporter-style metrics rendering."""

from __future__ import annotations

import re
import urllib.request

from batchtune_local.nodeagent.metrics import GpuHolder, GpuSample, MetricsServer, gpu_uuid, pick_activity, render
from batchtune_local.nodeagent.products import PRODUCTS, product_for_label

H100 = PRODUCTS["NVIDIA-H100-80GB-HBM3"]
BUSY = {"index": 0, "gpu_util_pct": 97.0, "sm_active": 0.62, "sm_occupancy": 0.31, "tensor_active": 0.2,
        "dram_active": 0.55, "fb_used_mib": 72000, "power_w": 540.0}


def series(text: str, name: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name):].rsplit(" ", 1)
            out[labels] = float(value)
    return out


def test_idle_and_busy_gpus():
    samples = [
        GpuSample("gpu-node-0", 0, H100, GpuHolder("team", "vllm-0", "vllm", 0), BUSY),
        GpuSample("gpu-node-0", 1, H100, None, None),
    ]
    text = render(samples)
    util = series(text, "DCGM_FI_DEV_GPU_UTIL")
    busy_labels = (f'{{gpu="0",UUID="{gpu_uuid("gpu-node-0", 0)}",pci_bus_id="00000000:18:00.0",device="nvidia0",'
                   'modelName="NVIDIA H100 80GB HBM3",Hostname="gpu-node-0",container="vllm",namespace="team",'
                   'pod="vllm-0"}')
    assert util[busy_labels] == 97
    idle = [k for k in util if 'gpu="1"' in k][0]
    assert util[idle] == 0 and "pod=" not in idle
    assert series(text, "DCGM_FI_DEV_FB_USED")[busy_labels] == 72000
    assert series(text, "DCGM_FI_DEV_FB_FREE")[busy_labels] == H100.fb_total_mib - H100.fb_reserved_mib - 72000
    assert series(text, "DCGM_FI_DEV_POWER_USAGE")[idle] == H100.idle_power_w
    assert series(text, "DCGM_FI_PROF_SM_ACTIVE")[busy_labels] == 0.62
    for name in ("DCGM_FI_PROF_SM_OCCUPANCY", "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "DCGM_FI_PROF_DRAM_ACTIVE"):
        assert f"# TYPE {name} gauge" in text and len(series(text, name)) == 2


def test_held_but_silent_gpu_reads_idle_with_pod_labels():
    text = render([GpuSample("n", 3, H100, GpuHolder("ns", "p", "c", 0), None)])
    (labels, value), = series(text, "DCGM_FI_DEV_GPU_UTIL").items()
    assert value == 0 and 'pod="p"' in labels and 'device="nvidia3"' in labels


def test_uuid_is_stable_and_distinct():
    assert gpu_uuid("a", 0) == gpu_uuid("a", 0) != gpu_uuid("a", 1) != gpu_uuid("b", 0)
    assert re.fullmatch(r"GPU-[0-9a-f-]{36}", gpu_uuid("a", 0))


def test_pick_activity_by_position():
    report = [dict(BUSY, index=0), dict(BUSY, index=1, gpu_util_pct=5.0)]
    assert pick_activity(report, 1)["gpu_util_pct"] == 5.0
    assert pick_activity(report, 2) is None and pick_activity(None, 0) is None


def test_unknown_product_gets_a_model_name():
    assert product_for_label("NVIDIA-B200").model_name == "NVIDIA B200"


def test_server_serves_metrics():
    server = MetricsServer("127.0.0.1:0", lambda: [GpuSample("n", 0, H100, None, None)])
    server.start()
    try:
        body = urllib.request.urlopen(f"http://{server.address}/metrics", timeout=5).read().decode()
    finally:
        server.stop()
    assert 'DCGM_FI_DEV_GPU_UTIL{gpu="0"' in body
