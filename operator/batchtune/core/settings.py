"""The three batching knobs a trial varies, as one frozen value (each engine spells them its own way)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


def percent_to_fraction(percent: int) -> str:
    """90 -> "0.90": exact decimal text, no float rounding in the args vLLM reads."""
    if not 1 <= percent <= 100:
        raise ValueError(f"gpu memory utilization percent {percent!r} is outside 1..100")
    return f"{percent // 100}.{percent % 100:02d}"


@dataclass(frozen=True)
class Setting:
    """One point of the search space."""

    max_num_seqs: int
    """The most sequences in one running batch (vLLM `--max-num-seqs`)."""
    gpu_memory_utilization_percent: int
    """The share of accelerator memory the engine may take, in integer percent (vLLM `--gpu-memory-utilization`, 90 = 0.90)."""
    max_num_batched_tokens: int | None = None
    """The token budget of one scheduler step (vLLM `--max-num-batched-tokens`); None keeps the target's."""

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
