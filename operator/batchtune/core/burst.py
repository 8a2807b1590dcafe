"""The burst probe: a runtime-OOM risk is not a fit, so a setting is chosen only once a full token-budget burst held.

A trial's load runs hold their SLO on a settled queue, whose prefills are spread over steps; the step that fills
`--max-num-batched-tokens` comes with a burst of long prompts, and where the memory left outside the gmu budget is
too small for its activations the engine dies (`torch.OutOfMemoryError`). A memory prefilter keeps such settings as
"fit unknown", and no trial provokes the step. So before a setting is chosen it is probed: requests sent at once
(at most max-num-seqs), long enough that together they fill the token budget (one output token each). A setting whose
burst fails is excluded, and with it every setting the failure implies: the burst fills the budget whatever the
batch size, and a higher gmu leaves less memory outside its budget, so any max-num-seqs at the same or higher gmu
with the same or larger token budget fails too.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from batchtune.core.outcomes import TrialOutcome, TrialState, Verdict
from batchtune.core.settings import Setting
from batchtune.core.vocabulary import Reason

BURST_OUTPUT_TOKENS = 1
"""The burst is a prefill test: one generated token per request ends it as soon as the budget-filling step ran."""


@dataclass(frozen=True)
class Burst:
    """The load of a burst probe: `concurrency` requests sent at once, each `prompt_tokens` long."""

    concurrency: int
    prompt_tokens: int
    output_tokens: int = BURST_OUTPUT_TOKENS

    @property
    def tokens(self) -> int:
        return self.concurrency * self.prompt_tokens


def burst_of(setting: Setting, budget_tokens: int, max_model_len: int | None = None) -> Burst:
    """The burst that fills `budget_tokens` (the setting's `--max-num-batched-tokens`, or the engine's default when it
    leaves it unset) in one scheduler step: prompts as long as the budget and `max_model_len` allow (chunked prefill
    packs a long prompt's chunks up to the budget), enough of them to fill the budget twice over, at most max-num-seqs.
    Long prompts, not many short ones: the API server hands requests to the engine one by one, so the first ready
    prompt must fill the step on its own."""
    if budget_tokens < 1:
        raise ValueError(f"burst budget_tokens must be >= 1, got {budget_tokens!r} for {setting.label()}")
    if max_model_len is not None and max_model_len <= BURST_OUTPUT_TOKENS:
        raise ValueError(f"burst max_model_len must be > {BURST_OUTPUT_TOKENS}, got {max_model_len!r}")
    prompt = budget_tokens if max_model_len is None else min(budget_tokens, max_model_len - BURST_OUTPUT_TOKENS)
    return Burst(min(setting.max_num_seqs, 2 * math.ceil(budget_tokens / prompt)), prompt)


def burst_failed(setting: Setting, burst: Burst, failure: str) -> TrialOutcome:
    """What the search and selection learn when the setting's burst failed: Infeasible, BurstOutOfMemory."""
    message = (f"{setting.label()} failed a full token-budget burst ({burst.concurrency} prompts of "
               f"{burst.prompt_tokens} tokens at once): {failure}")
    return TrialOutcome(TrialState.INFEASIBLE, Verdict.VIOLATED, reason=Reason.BURST_OUT_OF_MEMORY.value,
                        message=message[:500])


def _budget_at_least(candidate: int | None, failed: int | None) -> bool:
    if candidate is None or failed is None:  # the engine's default budget: only comparable with itself
        return candidate is None and failed is None
    return candidate >= failed


def burst_excluded(setting: Setting, history: Iterable[tuple[Setting, TrialOutcome]]) -> str | None:
    """Why a failed burst in the history rules this setting out, or None."""
    for failed, outcome in history:
        if outcome.reason != Reason.BURST_OUT_OF_MEMORY.value:
            continue
        if (setting.gpu_memory_utilization_percent >= failed.gpu_memory_utilization_percent
                and _budget_at_least(setting.max_num_batched_tokens, failed.max_num_batched_tokens)):
            if setting == failed:
                return f"excluded: its full token-budget burst ran out of memory ({outcome.message or failed.label()})"
            return (f"excluded: gmu {setting.gpu_memory_utilization_percent}% >= "
                    f"{failed.gpu_memory_utilization_percent}% with a token budget at least {failed.label()}'s, whose "
                    "full token-budget burst ran out of memory")
    return None
