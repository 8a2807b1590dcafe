"""The candidates of a search space less what the engine or memory rules out (pure; controller/plan.py calls it)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from batchtune.core.settings import Setting
from batchtune.core.vocabulary import Reason


def doublings(minimum: int, maximum: int) -> tuple[int, ...]:
    """minimum, 2*minimum, ... while <= maximum (maximum itself only when it is a doubling)."""
    if minimum < 1:
        raise ValueError(f"maxNumSeqs.min {minimum!r} must be >= 1")
    if maximum < minimum:
        raise ValueError(f"maxNumSeqs.max {maximum!r} is below maxNumSeqs.min {minimum!r}")
    values = []
    value = minimum
    while value <= maximum:
        values.append(value)
        value *= 2
    return tuple(values)


@dataclass(frozen=True)
class SearchSpace:
    max_num_seqs: tuple[int, ...]
    """Explicit values (doublings already expanded)."""
    gpu_memory_utilization_percent: tuple[int, ...] = (90,)
    max_num_batched_tokens: tuple[int, ...] = ()
    """Empty: leave the target's own `--max-num-batched-tokens` (or vLLM's default)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "max_num_seqs", tuple(sorted(set(self.max_num_seqs))))
        object.__setattr__(
            self, "gpu_memory_utilization_percent", tuple(sorted(set(self.gpu_memory_utilization_percent)))
        )
        object.__setattr__(self, "max_num_batched_tokens", tuple(sorted(set(self.max_num_batched_tokens))))
        if not self.max_num_seqs:
            raise ValueError("searchSpace.maxNumSeqs is empty")
        if not self.gpu_memory_utilization_percent:
            raise ValueError("searchSpace.gpuMemoryUtilizationPercent is empty")

    def contains(self, setting: Setting) -> bool:
        """Whether the setting is a point of this space (no batched-tokens values: the setting leaves it unset)."""
        return (setting.max_num_seqs in self.max_num_seqs
                and setting.gpu_memory_utilization_percent in self.gpu_memory_utilization_percent
                and (setting.max_num_batched_tokens in self.max_num_batched_tokens if self.max_num_batched_tokens
                     else setting.max_num_batched_tokens is None))


@dataclass(frozen=True)
class EngineLimits:
    """What the target's engine configuration implies for every trial (read from its args by the engine)."""

    max_model_len: int | None = None
    """`--max-model-len` when the target sets it; None: derived from the model, unknown here."""
    chunked_prefill: bool = True
    """Whether the engine splits long prefills over steps (vLLM V1: on unless `--no-enable-chunked-prefill`)."""
    max_num_batched_tokens: int | None = None
    """The target's own `--max-num-batched-tokens`, used when the search space leaves it alone."""


@dataclass(frozen=True)
class FitVerdict:
    """A memory estimator's answer for one setting."""

    fits: bool | None
    """True fits, False does not (pruned), None unknown (kept)."""
    reason: str = ""
    memory_reason: Reason | None = None
    """When it does not fit: the failure a start would give (KvCacheTooSmall, GpuMemoryUtilizationTooHigh)."""


FitCheck = Callable[[Setting], FitVerdict]


@dataclass(frozen=True)
class PrunedSetting:
    setting: Setting
    reason: Reason
    """A code: EngineInvariant, DoesNotFitMemory (see `memory_reason`) or Dominated."""
    message: str
    memory_reason: Reason | None = None
    """For DoesNotFitMemory: what a failed start would have said (KvCacheTooSmall, GpuMemoryUtilizationTooHigh)."""


@dataclass(frozen=True)
class Plan:
    candidates: tuple[Setting, ...]
    """Sorted by column (gmu, mbt) then max-num-seqs."""
    pruned: tuple[PrunedSetting, ...] = ()
    notes: tuple[str, ...] = field(default=())

    @property
    def error(self) -> str | None:
        """Why nothing can be tried, or None when there are candidates."""
        if self.candidates:
            return None
        reasons = sorted({p.message for p in self.pruned})
        shown = "; ".join(reasons[:3]) + (f"; and {len(reasons) - 3} more" if len(reasons) > 3 else "")
        return f"no candidate setting is left after {len(self.pruned)} were pruned: {shown or 'empty search space'}"

    def columns(self) -> dict[tuple[int, int | None], tuple[Setting, ...]]:
        """(gmu, mbt) -> its candidates ordered by max-num-seqs."""
        out: dict[tuple[int, int | None], list[Setting]] = {}
        for setting in self.candidates:
            out.setdefault(setting.column, []).append(setting)
        return {column: tuple(sorted(settings)) for column, settings in sorted(out.items(), key=_column_key)}


def _column_key(item: tuple[tuple[int, int | None], Any]) -> tuple[int, int]:
    (gmu, mbt), _ = item
    return (gmu, -1 if mbt is None else mbt)


Invariant = Callable[[Setting], str | None]
"""The engine's refusal to start a setting, quoted (`Engine.invariant_violation` with the target's limits)."""


def plan_candidates(
    space: SearchSpace,
    invariant: Invariant | None = None,
    fits: FitCheck | None = None,
    limits: EngineLimits = EngineLimits(),
) -> Plan:
    """Every combination of the search space, less engine-invalid and memory-infeasible settings.

    `fits` is the memory-fit prefilter (the twin's estimator); None skips it.
    """
    mbt_values: Sequence[int | None] = space.max_num_batched_tokens or (None,)
    candidates: list[Setting] = []
    pruned: list[PrunedSetting] = []
    unknown_fit: list[str] = []
    for gmu in space.gpu_memory_utilization_percent:
        for mbt in mbt_values:
            for seqs in space.max_num_seqs:
                setting = Setting(seqs, gmu, mbt)
                violation = invariant(setting) if invariant is not None else None
                if violation:
                    pruned.append(PrunedSetting(setting, Reason.ENGINE_INVARIANT, violation))
                    continue
                if fits is not None:
                    verdict = fits(setting)
                    if verdict.fits is False:
                        pruned.append(PrunedSetting(setting, Reason.DOES_NOT_FIT_MEMORY,
                                                    f"does not fit in GPU memory: {verdict.reason}",
                                                    verdict.memory_reason or Reason.KV_CACHE_TOO_SMALL))
                        continue
                    if verdict.fits is None:
                        unknown_fit.append(verdict.reason)
                candidates.append(setting)
    notes: list[str] = []
    if not space.max_num_batched_tokens and limits.max_num_batched_tokens is None:
        notes.append(
            "max-num-batched-tokens is neither searched nor set on the target: the engine's hardware "
            "default applies, so the token budget against max-num-seqs is not checked here"
        )
    if unknown_fit:
        first = sorted(set(unknown_fit))[0] or "no estimate"
        notes.append(f"memory fit unknown for {len(unknown_fit)} candidate(s), kept: {first}")
    if fits is None:
        notes.append("no memory-fit estimator: settings that do not fit are found by trying them")
    return Plan(tuple(sorted(candidates)), tuple(pruned), tuple(notes))
