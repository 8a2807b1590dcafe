"""A node agent standing in for kubelets: GPU nodes whose pods run as local processes.

Run it as ``python -m batchtune_local.nodeagent --kubeconfig PATH --state-dir DIR``. See
``docs/node-agent.md`` for the process contract and what it leaves out compared to a kubelet.

Public pieces: `AgentConfig` and `NodeAgent` (the agent), `ImageMap`/`load_image_map`
(image -> local command), `PodWorker` (one pod), `render` (dcgm-style metrics text).
"""

from __future__ import annotations

from batchtune_local.nodeagent.images import ImageMap, ImageNotMapped, load_image_map
from batchtune_local.nodeagent.metrics import render
from batchtune_local.nodeagent.products import PRODUCTS, GpuProduct, product_for_label

__all__ = [
    "AgentConfig",
    "GpuProduct",
    "ImageMap",
    "ImageNotMapped",
    "NodeAgent",
    "PRODUCTS",
    "load_image_map",
    "product_for_label",
    "render",
]


def __getattr__(name: str) -> object:
    # The agent pulls in the kubernetes client; import it only when asked for.
    if name in ("AgentConfig", "NodeAgent"):
        from batchtune_local.nodeagent import agent

        return getattr(agent, name)
    raise AttributeError(name)
