"""dcgm-exporter-style GPU metrics, fed by the activity reports of the processes holding the GPUs."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from batchtune_local.nodeagent.products import GpuProduct

# (name, help) in dcgm-exporter's default-counters order; all gauges.
FIELDS: tuple[tuple[str, str, str], ...] = (
    ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", "gpu_util_pct"),
    ("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", ""),
    ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", "fb_used_mib"),
    ("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", "power_w"),
    ("DCGM_FI_PROF_SM_ACTIVE", "The ratio of cycles an SM has at least 1 warp assigned.", "sm_active"),
    ("DCGM_FI_PROF_SM_OCCUPANCY", "The ratio of number of warps resident on an SM.", "sm_occupancy"),
    ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "Ratio of cycles the tensor (HMMA) pipe is active.", "tensor_active"),
    ("DCGM_FI_PROF_DRAM_ACTIVE",
     "Ratio of cycles the device memory interface is active sending or receiving data.", "dram_active"),
)


@dataclass(frozen=True)
class GpuHolder:
    namespace: str
    pod: str
    container: str
    position: int
    """The GPU's index within the container's NVIDIA_VISIBLE_DEVICES (the report's `index`)."""


@dataclass(frozen=True)
class GpuSample:
    node: str
    index: int
    product: GpuProduct
    holder: GpuHolder | None
    activity: Mapping[str, float] | None
    """The holder's report for this GPU, None when idle, missing or stale."""


def gpu_uuid(node: str, index: int) -> str:
    """A stable made-up UUID per node and GPU, shaped like NVML's."""
    return "GPU-" + str(uuid.uuid5(uuid.NAMESPACE_DNS, f"{node}.gpu{index}.batchtune.io"))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def sample_values(sample: GpuSample) -> dict[str, float]:
    """Field values for one GPU: the report, or idle (0, FB free = total - reserved, idle power)."""
    product = sample.product
    usable = product.fb_total_mib - product.fb_reserved_mib
    act = sample.activity or {}
    fb_used = min(max(float(act.get("fb_used_mib", 0.0)), 0.0), float(usable))
    power = float(act.get("power_w", 0.0)) if sample.activity else 0.0
    return {
        "DCGM_FI_DEV_GPU_UTIL": float(round(act.get("gpu_util_pct", 0.0))),
        "DCGM_FI_DEV_FB_FREE": float(int(usable - fb_used)),
        "DCGM_FI_DEV_FB_USED": float(int(fb_used)),
        "DCGM_FI_DEV_POWER_USAGE": max(power, product.idle_power_w),
        "DCGM_FI_PROF_SM_ACTIVE": float(act.get("sm_active", 0.0)),
        "DCGM_FI_PROF_SM_OCCUPANCY": float(act.get("sm_occupancy", 0.0)),
        "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": float(act.get("tensor_active", 0.0)),
        "DCGM_FI_PROF_DRAM_ACTIVE": float(act.get("dram_active", 0.0)),
    }


def render(samples: Iterable[GpuSample]) -> str:
    """Prometheus text exposition in dcgm-exporter's shape (with Kubernetes pod mapping)."""
    rows = list(samples)
    values = [sample_values(s) for s in rows]
    out: list[str] = []
    for name, help_text, _ in FIELDS:
        out.append(f"# HELP {name} {help_text}")
        out.append(f"# TYPE {name} gauge")
        for sample, vals in zip(rows, values, strict=True):
            labels = [
                ("gpu", str(sample.index)),
                ("UUID", gpu_uuid(sample.node, sample.index)),
                ("pci_bus_id", f"00000000:{0x18 + sample.index * 0x10:02X}:00.0"),
                ("device", f"nvidia{sample.index}"),
                ("modelName", sample.product.model_name),
                ("Hostname", sample.node),
            ]
            if sample.holder is not None:
                labels += [("container", sample.holder.container), ("namespace", sample.holder.namespace),
                           ("pod", sample.holder.pod)]
            text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
            out.append(f"{name}{{{text}}} {_number(vals[name])}")
    return "\n".join(out) + "\n"


def pick_activity(report: list[dict[str, Any]] | None, position: int) -> dict[str, Any] | None:
    """The entry for one GPU position out of a container's report."""
    for entry in report or []:
        if entry.get("index") == position:
            return entry
    return None


class MetricsServer:
    """Serves `render(collect())` on /metrics from a daemon thread."""

    def __init__(self, address: str, collect: Callable[[], Iterable[GpuSample]]) -> None:
        host, _, port = address.rpartition(":")
        collect_fn = collect

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                if self.path.split("?")[0] not in ("/metrics", "/"):
                    self.send_error(404)
                    return
                body = render(collect_fn()).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # scrapes every 2 s would flood the log
                pass

        self.server = ThreadingHTTPServer((host or "127.0.0.1", int(port)), Handler)
        self.server.daemon_threads = True
        self.address = f"{self.server.server_address[0]}:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, name="metrics", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
