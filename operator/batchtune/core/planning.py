"""Planning: the candidate settings of a search space, less what vLLM or GPU memory rules out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from batchtune.core.settings import Setting


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

    @classmethod
    def from_spec(cls, space: Any) -> SearchSpace:
        """From the api model's `spec.search_space` (attribute access, snake_case)."""
        seqs = space.max_num_seqs
        values = getattr(seqs, "values", None)
        if values:
            seq_values = tuple(values)
        else:
            seq_values = doublings(int(seqs.min), int(seqs.max))
        gmu = getattr(space, "gpu_memory_utilization_percent", None) or (90,)
        mbt = getattr(space, "max_num_batched_tokens", None) or ()
        return cls(seq_values, tuple(gmu), tuple(mbt))


@dataclass(frozen=True)
class EngineLimits:
    """What the target's vLLM configuration implies for every trial (from its args)."""

    max_model_len: int | None = None
    """`--max-model-len` when the target sets it; None: derived from the model, unknown here."""
    chunked_prefill: bool = True
    """V1 always enables chunked prefill unless `--no-enable-chunked-prefill`."""
    max_num_batched_tokens: int | None = None
    """The target's own `--max-num-batched-tokens`, used when the search space leaves it alone."""

    @classmethod
    def from_flags(cls, flags: dict[str, str | None]) -> EngineLimits:
        """From canonical flags (see `args.read_vllm_settings(...).flags`)."""
        def as_int(name: str) -> int | None:
            value = flags.get(name)
            try:
                return int(value) if value is not None else None
            except ValueError:
                return None

        chunked = True
        if "no-enable-chunked-prefill" in flags:
            chunked = False
        elif "enable-chunked-prefill" in flags:
            chunked = str(flags["enable-chunked-prefill"]).lower() not in ("false", "0", "no")
        return cls(as_int("max-model-len"), chunked, as_int("max-num-batched-tokens"))


@dataclass(frozen=True)
class FitVerdict:
    """A memory estimator's answer for one setting."""

    fits: bool | None
    """True fits, False does not (pruned), None unknown (kept)."""
    reason: str = ""


FitCheck = Callable[[Setting], FitVerdict]


@dataclass(frozen=True)
class PrunedSetting:
    setting: Setting
    reason: str

    def to_status(self) -> dict[str, Any]:
        return {"setting": self.setting.to_status(), "reason": self.reason}


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
        reasons = sorted({p.reason for p in self.pruned})
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


def _invariant_violation(setting: Setting, limits: EngineLimits) -> str | None:
    """vLLM's own SchedulerConfig checks, quoted, or None."""
    mbt = setting.max_num_batched_tokens
    if mbt is None:
        mbt = limits.max_num_batched_tokens
    if mbt is None:
        return None
    if mbt < setting.max_num_seqs:
        return (
            f"vLLM would refuse to start: max_num_batched_tokens ({mbt}) must be greater than or equal "
            f"to max_num_seqs ({setting.max_num_seqs})."
        )
    if not limits.chunked_prefill and limits.max_model_len is not None and mbt < limits.max_model_len:
        return (
            f"vLLM would refuse to start: max_num_batched_tokens ({mbt}) is smaller than max_model_len "
            f"({limits.max_model_len}). This effectively limits the maximum sequence length to "
            "max_num_batched_tokens and makes vLLM reject longer sequences. Please increase "
            "max_num_batched_tokens or decrease max_model_len."
        )
    return None


def plan_candidates(
    space: SearchSpace,
    limits: EngineLimits = EngineLimits(),
    fits: FitCheck | None = None,
) -> Plan:
    """Every combination of the search space, less vLLM-invalid and memory-infeasible settings.

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
                violation = _invariant_violation(setting, limits)
                if violation:
                    pruned.append(PrunedSetting(setting, violation))
                    continue
                if fits is not None:
                    verdict = fits(setting)
                    if verdict.fits is False:
                        pruned.append(PrunedSetting(setting, f"does not fit in GPU memory: {verdict.reason}"))
                        continue
                    if verdict.fits is None:
                        unknown_fit.append(verdict.reason)
                candidates.append(setting)
    notes: list[str] = []
    if not space.max_num_batched_tokens and limits.max_num_batched_tokens is None:
        notes.append(
            "max-num-batched-tokens is neither searched nor set on the target: vLLM's hardware "
            "default applies (2048 or 8192), so max_num_batched_tokens >= max_num_seqs is not checked here"
        )
    if unknown_fit:
        first = sorted(set(unknown_fit))[0] or "no estimate"
        notes.append(f"memory fit unknown for {len(unknown_fit)} candidate(s), kept: {first}")
    if fits is None:
        notes.append("no memory-fit estimator: settings that do not fit are found by trying them")
    return Plan(tuple(sorted(candidates)), tuple(pruned), tuple(notes))


def limit_note(plan: Plan, max_trials: int) -> str | None:
    if len(plan.candidates) > max_trials:
        return f"{len(plan.candidates)} candidates but maxTrials is {max_trials}: the strategy chooses which to try"
    return None


def settings_of(entries: Iterable[tuple[Setting, Any]]) -> set[Setting]:
    return {setting for setting, _ in entries}
