"""The three vLLM batching knobs a trial varies, as one frozen value."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

FLAG_MAX_NUM_SEQS = "--max-num-seqs"
FLAG_GPU_MEMORY_UTILIZATION = "--gpu-memory-utilization"
FLAG_MAX_NUM_BATCHED_TOKENS = "--max-num-batched-tokens"


def percent_to_fraction(percent: int) -> str:
    """90 -> "0.90": exact decimal text, no float rounding in the args vLLM reads."""
    if not 1 <= percent <= 100:
        raise ValueError(f"gpu memory utilization percent {percent!r} is outside 1..100")
    return f"{percent // 100}.{percent % 100:02d}"


@dataclass(frozen=True)
class Setting:
    """One point of the search space."""

    max_num_seqs: int
    """vLLM `--max-num-seqs`: the most sequences in one running batch."""
    gpu_memory_utilization_percent: int
    """vLLM `--gpu-memory-utilization` in integer percent (90 = 0.90)."""
    max_num_batched_tokens: int | None = None
    """vLLM `--max-num-batched-tokens`; None keeps whatever the target uses."""

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs {self.max_num_seqs!r} must be >= 1")
        if not 1 <= self.gpu_memory_utilization_percent <= 100:
            raise ValueError(
                f"gpu_memory_utilization_percent {self.gpu_memory_utilization_percent!r} is outside 1..100"
            )
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens {self.max_num_batched_tokens!r} must be >= 1")

    # Ordering: by column (gmu, mbt) then max-num-seqs; None mbt sorts first.
    def sort_key(self) -> tuple[int, int, int]:
        mbt = -1 if self.max_num_batched_tokens is None else self.max_num_batched_tokens
        return (self.gpu_memory_utilization_percent, mbt, self.max_num_seqs)

    def __lt__(self, other: Setting) -> bool:
        return self.sort_key() < other.sort_key()

    def __le__(self, other: Setting) -> bool:
        return self.sort_key() <= other.sort_key()

    def __gt__(self, other: Setting) -> bool:
        return self.sort_key() > other.sort_key()

    def __ge__(self, other: Setting) -> bool:
        return self.sort_key() >= other.sort_key()

    @property
    def column(self) -> tuple[int, int | None]:
        """The (gmu, mbt) column a setting belongs to; max-num-seqs varies along it."""
        return (self.gpu_memory_utilization_percent, self.max_num_batched_tokens)

    def as_args(self) -> list[str]:
        args = [
            FLAG_MAX_NUM_SEQS, str(self.max_num_seqs),
            FLAG_GPU_MEMORY_UTILIZATION, percent_to_fraction(self.gpu_memory_utilization_percent),
        ]
        if self.max_num_batched_tokens is not None:
            args += [FLAG_MAX_NUM_BATCHED_TOKENS, str(self.max_num_batched_tokens)]
        return args

    def as_flags(self) -> dict[str, str]:
        """Canonical flag name (no dashes) -> value text, as `args.rewrite_vllm_args` takes them."""
        flags = {
            "max-num-seqs": str(self.max_num_seqs),
            "gpu-memory-utilization": percent_to_fraction(self.gpu_memory_utilization_percent),
        }
        if self.max_num_batched_tokens is not None:
            flags["max-num-batched-tokens"] = str(self.max_num_batched_tokens)
        return flags

    def label(self) -> str:
        text = f"seqs={self.max_num_seqs} gmu={self.gpu_memory_utilization_percent}%"
        if self.max_num_batched_tokens is not None:
            text += f" mbt={self.max_num_batched_tokens}"
        return text

    def to_status(self) -> dict[str, int]:
        """camelCase dict as stored in `status.trials[].setting`."""
        out = {
            "maxNumSeqs": self.max_num_seqs,
            "gpuMemoryUtilizationPercent": self.gpu_memory_utilization_percent,
        }
        if self.max_num_batched_tokens is not None:
            out["maxNumBatchedTokens"] = self.max_num_batched_tokens
        return out

    @classmethod
    def from_status(cls, data: Mapping[str, Any]) -> Setting:
        """Inverse of `to_status`; also accepts snake_case keys."""
        def pick(camel: str, snake: str) -> Any:
            return data[camel] if camel in data else data.get(snake)

        seqs = pick("maxNumSeqs", "max_num_seqs")
        gmu = pick("gpuMemoryUtilizationPercent", "gpu_memory_utilization_percent")
        mbt = pick("maxNumBatchedTokens", "max_num_batched_tokens")
        if seqs is None or gmu is None:
            raise ValueError(f"setting {dict(data)!r} lacks maxNumSeqs or gpuMemoryUtilizationPercent")
        return cls(int(seqs), int(gmu), None if mbt is None else int(mbt))

    def __str__(self) -> str:
        return self.label()
