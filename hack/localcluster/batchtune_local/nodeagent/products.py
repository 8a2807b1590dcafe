"""GPU products the node agent can pretend to have: the figures dcgm-exporter would report at idle."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuProduct:
    label: str
    """The `nvidia.com/gpu.product` node label, e.g. `NVIDIA-H100-80GB-HBM3`."""
    model_name: str
    """dcgm-exporter's `modelName` label (what NVML reports), e.g. `NVIDIA H100 80GB HBM3`."""
    fb_total_mib: int
    """Framebuffer memory the driver exposes (FB_USED + FB_FREE + reserved), MiB."""
    fb_reserved_mib: int
    """Memory the driver keeps for itself; never shows in FB_USED or FB_FREE."""
    idle_power_w: float
    """DCGM_FI_DEV_POWER_USAGE of an idle GPU."""


# Sizes are what nvidia-smi prints for the card; idle power is typical of a cool idle board.
_PRODUCTS = (
    GpuProduct("NVIDIA-H100-80GB-HBM3", "NVIDIA H100 80GB HBM3", 81559, 512, 70.0),
    GpuProduct("NVIDIA-H100-PCIe", "NVIDIA H100 PCIe", 81559, 512, 50.0),
    GpuProduct("NVIDIA-H200", "NVIDIA H200", 143771, 512, 75.0),
    GpuProduct("NVIDIA-A100-SXM4-80GB", "NVIDIA A100-SXM4-80GB", 81920, 512, 60.0),
    GpuProduct("NVIDIA-A100-SXM4-40GB", "NVIDIA A100-SXM4-40GB", 40960, 512, 55.0),
    GpuProduct("NVIDIA-A100-80GB-PCIe", "NVIDIA A100 80GB PCIe", 81920, 512, 45.0),
    GpuProduct("NVIDIA-L40S", "NVIDIA L40S", 46068, 512, 35.0),
    GpuProduct("NVIDIA-L4", "NVIDIA L4", 23034, 256, 16.0),
    GpuProduct("NVIDIA-A10G", "NVIDIA A10G", 23028, 256, 15.0),
    # The real-engine tier (up --engine vllm): vLLM's CPU backend on NUMA node 0 (17.09 GiB on the build machine).
    GpuProduct("batchtune-CPU-node", "batchtune CPU node", 17500, 0, 5.0),
)

PRODUCTS: dict[str, GpuProduct] = {p.label: p for p in _PRODUCTS}


def product_for_label(label: str) -> GpuProduct:
    """The product for a node label; unknown labels get an 80 GiB card named after the label."""
    known = PRODUCTS.get(label)
    if known is not None:
        return known
    return GpuProduct(label, label.replace("-", " "), 81920, 512, 60.0)
