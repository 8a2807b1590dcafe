"""ServeConfig: the vLLM serving settings the twin simulates, and parsing them from a vLLM argv."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from batchtune.twin.catalog import GpuSpec, ModelSpec, get_gpu, get_model

FOUR_BIT_QUANTIZATIONS = frozenset({"awq", "awq_marlin", "gptq", "gptq_marlin", "bitsandbytes", "int4", "w4a16",
                                    "compressed-tensors-w4a16", "marlin"})
FP8_QUANTIZATIONS = frozenset({"fp8", "fbgemm_fp8", "modelopt", "fp8_e4m3"})
DTYPES = {"auto": "bfloat16", "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "half": "float16",
          "fp16": "float16", "float32": "float32", "float": "float32", "fp8": "fp8"}


def default_max_num_seqs(gpu: GpuSpec) -> int:
    """vLLM `get_batch_defaults`: 1024 on >=70 GiB GPUs that are not A100, else 256."""
    return 1024 if gpu.memory_gib >= 70 and not gpu.is_a100 else 256


def default_max_num_batched_tokens(gpu: GpuSpec) -> int:
    """vLLM `get_batch_defaults` for `vllm serve`: 8192 on >=70 GiB non-A100 GPUs, else 2048."""
    return 8192 if gpu.memory_gib >= 70 and not gpu.is_a100 else 2048


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """One vLLM serving setting on one GPU type. Strings for `model`/`gpu` are resolved in the catalog."""

    # Fields are typed as what they hold once `__post_init__` has run: a catalog entry for a name, vLLM's
    # default for None. The `__init__` declared for the type checker below says what the constructor takes.
    model: ModelSpec
    gpu: GpuSpec
    max_num_seqs: int = cast(int, None)
    """None = vLLM's hardware default (1024 on big non-A100 GPUs, else 256)."""
    gpu_memory_utilization: float = 0.9
    max_num_batched_tokens: int = cast(int, None)
    """None = vLLM's `vllm serve` default for the GPU (8192 or 2048)."""
    max_model_len: int = cast(int, None)
    """None = the model's context length."""
    tensor_parallel_size: int = 1
    dtype: str = "auto"
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    enable_chunked_prefill: bool = True
    enforce_eager: bool = False
    model_id: str = ""
    """The model name as given (HF id); the served model name defaults to it."""

    if TYPE_CHECKING:
        # Only for the type checker (at runtime the dataclass writes __init__): the same fields, in order,
        # with the inputs __post_init__ resolves.
        def __init__(
            self, model: str | ModelSpec, gpu: str | GpuSpec, max_num_seqs: int | None = None,
            gpu_memory_utilization: float = 0.9, max_num_batched_tokens: int | None = None,
            max_model_len: int | None = None, tensor_parallel_size: int = 1, dtype: str = "auto",
            quantization: str | None = None, kv_cache_dtype: str = "auto", block_size: int = 16,
            enable_chunked_prefill: bool = True, enforce_eager: bool = False, model_id: str = "",
        ) -> None: ...

    def __post_init__(self) -> None:
        model_given = self.model
        object.__setattr__(self, "model", get_model(self.model))
        object.__setattr__(self, "gpu", get_gpu(self.gpu))
        if not self.model_id:
            object.__setattr__(self, "model_id", model_given if isinstance(model_given, str) else self.model.hf_ids[0])
        if self.max_num_seqs is None:
            seqs = default_max_num_seqs(self.gpu)
            if self.max_num_batched_tokens is not None:
                seqs = min(seqs, self.max_num_batched_tokens)  # vLLM caps the default by the token budget
            object.__setattr__(self, "max_num_seqs", seqs)
        if self.max_num_batched_tokens is None:
            tokens = default_max_num_batched_tokens(self.gpu)
            if not self.enable_chunked_prefill:
                tokens = max(tokens, self.max_model_len or self.model.max_model_len)
            object.__setattr__(self, "max_num_batched_tokens", tokens)
        if self.max_model_len is None:
            object.__setattr__(self, "max_model_len", self.model.max_model_len)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "tensor_parallel_size", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype not in ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2"):
            raise ValueError(f"kv_cache_dtype must be auto, bfloat16, float16 or fp8*, got {self.kv_cache_dtype!r}")

    # Derived quantities used by the memory and step-time models.
    @property
    def weight_bits(self) -> float:
        """Bits per parameter of the transformer-layer weights."""
        q = (self.quantization or "").lower()
        if q in FOUR_BIT_QUANTIZATIONS:
            return 4.25  # 4-bit values plus group scales/zeros (group size 128)
        if q in FP8_QUANTIZATIONS or DTYPES[self.dtype] == "fp8":
            return 8.0
        return 32.0 if DTYPES[self.dtype] == "float32" else 16.0

    @property
    def fp8_compute(self) -> bool:
        """Whether GEMMs run on FP8 tensor cores (fp8 weights and activations on a GPU that has them)."""
        return self.weight_bits == 8.0 and bool(self.gpu.fp8_tflops)

    @property
    def kv_bytes_per_element(self) -> int:
        if self.kv_cache_dtype.startswith("fp8"):
            return 1
        return 4 if DTYPES[self.dtype] == "float32" else 2

    @property
    def kv_heads_per_gpu(self) -> int:
        # KV heads are split across TP ranks and replicated when there are fewer heads than ranks
        return max(1, self.model.num_kv_heads // self.tensor_parallel_size)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes per token on one GPU: 2 (K and V) x layers x kv heads x head dim x dtype bytes."""
        m = self.model
        return 2 * m.num_layers * self.kv_heads_per_gpu * m.head_dim * self.kv_bytes_per_element

    def replace(self, **changes: object) -> ServeConfig:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]  # fields by name; __post_init__ checks values

    @classmethod
    def from_vllm_argv(cls, argv: list[str], gpu: str | GpuSpec,
                       on_unknown: Callable[[str], None] | None = None) -> ServeConfig:
        """Build the config a `vllm serve MODEL [flags]` (or api_server --model MODEL) argv would run."""
        return parse_vllm_argv(argv, on_unknown=on_unknown).to_config(gpu)


# vLLM flag (canonical, as the engine adapter resolves it) -> (ServeConfig field, parser)
def _switch(value: str | None) -> bool:
    return value is None or value.lower() in ("1", "true", "yes", "on")


def _model_len(value: str) -> int:
    return int(float(value.lower().replace("k", "e3"))) if value.lower().endswith("k") else int(value)


_VALUE_FLAGS: dict[str, tuple[str, Callable[[str], object]]] = {
    "max-num-seqs": ("max_num_seqs", int),
    "gpu-memory-utilization": ("gpu_memory_utilization", float),
    "max-num-batched-tokens": ("max_num_batched_tokens", int),
    "max-model-len": ("max_model_len", _model_len),
    "tensor-parallel-size": ("tensor_parallel_size", int),
    "dtype": ("dtype", str),
    "quantization": ("quantization", str),
    "kv-cache-dtype": ("kv_cache_dtype", str),
    "block-size": ("block_size", int),
}
_SWITCHES = {"enable-chunked-prefill": ("enable_chunked_prefill", True),
             "no-enable-chunked-prefill": ("enable_chunked_prefill", False),
             "enforce-eager": ("enforce_eager", True),
             "no-enforce-eager": ("enforce_eager", False)}


@dataclass(frozen=True, slots=True)
class VllmArgv:
    """A parsed `vllm serve` command line: model, config fields, server flags and ignored flags."""

    model: str
    settings: dict[str, object] = field(default_factory=dict)
    host: str | None = None
    port: int = 8000
    served_model_name: str | None = None
    unknown: tuple[str, ...] = ()

    def to_config(self, gpu: str | GpuSpec) -> ServeConfig:
        return ServeConfig(model=self.model, gpu=gpu, model_id=self.model,
                           **self.settings)  # type: ignore[arg-type]  # values typed by each flag's parser; __post_init__ checks them


def parse_vllm_argv(argv: list[str], on_unknown: Callable[[str], None] | None = None) -> VllmArgv:
    """Parse `vllm serve MODEL ...`, `serve MODEL ...` or `python3 -m vllm.entrypoints.openai.api_server --model M`.

    The engine adapter's one vLLM grammar reads the argv (`--flag v`, `--flag=v`, underscores, the
    prefixes vLLM accepts); flags the twin does not model go to `unknown` (and `on_unknown`).
    """
    from batchtune.engines.vllm import VLLM

    args = list(argv)
    if args and args[0] == "serve":
        args = ["vllm", *args]
    model, flags, extra = VLLM.parse_argv(args)
    settings: dict[str, object] = {}
    unknown: list[str] = [*extra]
    for name, value in flags.items():
        if name in _VALUE_FLAGS:
            field_name, parse = _VALUE_FLAGS[name]
            if value is None:
                raise ValueError(f"--{name} needs a value")
            try:
                settings[field_name] = parse(value)
            except ValueError:
                raise ValueError(f"--{name}: invalid value {value!r}") from None
        elif name in _SWITCHES:
            field_name, on = _SWITCHES[name]
            settings[field_name] = on if _switch(value) else not on
        elif name not in ("model", "host", "port", "served-model-name"):
            unknown.append(f"--{name}" if value is None else f"--{name} {value}")
    for text in unknown:
        if on_unknown:
            on_unknown(text)
    if not model:
        raise ValueError(f"no model in vLLM argv {argv!r}: expected `vllm serve MODEL` or `--model MODEL`")
    port = flags.get("port")
    served = flags.get("served-model-name")
    try:
        port_number = int(port) if port else 8000
    except ValueError:
        raise ValueError(f"--port: invalid value {port!r}") from None
    return VllmArgv(model=model, settings=settings, host=flags.get("host"), port=port_number,
                    served_model_name=served.split()[0] if served else None, unknown=tuple(unknown))
