"""TwinGuided: calibrate the twin on one real trial, search every candidate on it, confirm the best on real trials.

1. **Calibrate.** The first trial is the catalog twin's best candidate (`advice.calibration_setting`):
   its capacity search spans loads below and above where the answer lies, so its steps say most
   about the deployment where it matters. If the calibration on it is Untrusted (residuals beyond
   tolerance, a parameter pressed against its physical bound, a measurement the inputs cannot produce),
   the twin does not steer: Adaptive picks the next trial (mode `measure`, and why), and the twin,
   recalibrated on every trial, steers again once its calibration is Trusted.
2. **Search.** The caller recalibrates the twin on every finished trial and ranks every candidate on
   it off the reconcile path (`batchtune.twin.guide.advise`); the strategy reads that `TwinAdvice`.
3. **Confirm.** The best untried candidate is measured next while the twin predicts it beats the best
   measured one by more than `CONFIRM_MARGIN` (in the twin's own terms, so both sides carry the same
   bias); its capacity search starts at the predicted capacity, so its first step tests the prediction.
   Before it stops, a token budget (max-num-batched-tokens) no trial has measured gets one trial when the
   twin ranks its best within `COLUMN_MARGIN` of the best: calibration on one budget says least about
   another.
4. **Distrust.** After `MAX_MISSES` confirmations whose first step disagreed with their prediction
   (`core.guidance.agreement`), or while the calibration is Untrusted, the twin is not trusted and the
   search falls back to measuring: Adaptive, on the same history.

Trials run one at a time: each one recalibrates the next decision. Settings ruled out by memory failures
in the history (Adaptive's rules) are never proposed. Selection afterwards is the usual one.
"""

from __future__ import annotations

from collections.abc import Callable

from batchtune.core.burst import burst_excluded
from batchtune.core.guidance import TwinAdvice, measured
from batchtune.core.objective import Objective
from batchtune.core.outcomes import History, HistoryEntry
from batchtune.core.planning import Plan, PrunedSetting
from batchtune.core.settings import Setting
from batchtune.core.slo import SloTargets
from batchtune.core.strategies._adaptive import Adaptive
from batchtune.core.strategies._base import Strategy
from batchtune.core.vocabulary import Reason, TrialState

CONFIRM_MARGIN = 0.02
"""A candidate is worth a trial when predicted better than the best measured one by more than this."""
MAX_MISSES = 2
"""Confirmations that miss their prediction before the twin is distrusted."""
MAX_CONFIRMATIONS = 4
"""Trials after the calibration trial at most (maxTrials caps it too)."""
COLUMN_MARGIN = 0.05
"""A token budget nothing was measured at gets a trial when the twin ranks its best within this share of the best."""


def memory_blocked(setting: Setting, history: History) -> str | None:
    """Why a memory failure in the history rules this setting out, or None.

    vLLM found less free memory than the gmu asks: every gmu at or above fails. The KV pool could not hold
    one request (startup): more seqs at the same or lower gmu (less memory) and no smaller budget fail too.
    Out of memory under load (the runtime headroom outside the gmu budget ran out): more seqs at the same
    or higher gmu (less headroom) and no smaller budget fail too; a lower gmu has more headroom, so the
    twin, recalibrated on the failure, decides about those. A failed full token-budget burst (`core.burst`): its
    column and every higher gmu with no smaller budget."""
    burst = burst_excluded(setting, history)
    if burst:
        return burst
    for failed, outcome in history:
        if outcome.state is not TrialState.INFEASIBLE or failed == setting:
            continue
        mbt_ok = setting.max_num_batched_tokens is None or failed.max_num_batched_tokens is None or \
            setting.max_num_batched_tokens >= failed.max_num_batched_tokens
        seqs, gmu = setting.max_num_seqs, setting.gpu_memory_utilization_percent
        if outcome.reason == Reason.GPU_MEMORY_UTILIZATION_TOO_HIGH and gmu >= failed.gpu_memory_utilization_percent:
            return f"gmu {gmu}% >= {failed.label()}, where vLLM found less free memory than asked"
        if outcome.reason == Reason.KV_CACHE_TOO_SMALL and mbt_ok and seqs >= failed.max_num_seqs and \
                gmu <= failed.gpu_memory_utilization_percent:
            return f"needs at least the KV memory of {failed.label()}, which could not hold one request"
        if outcome.reason in (Reason.OUT_OF_MEMORY, Reason.OOM_KILLED) and mbt_ok and \
                seqs >= failed.max_num_seqs and gmu >= failed.gpu_memory_utilization_percent:
            return f"leaves no more runtime headroom than {failed.label()}, which ran out of memory ({outcome.reason})"
    return None


class TwinGuided(Strategy):
    kind = "TwinGuided"

    def __init__(self, plan: Plan, slo: SloTargets, objective: Objective | str = Objective.SLO_CAPACITY,
                 seed: int = 0, max_trials: int = 12, advice: TwinAdvice | None = None) -> None:
        super().__init__(plan, slo, objective, seed, max_trials)
        self.advice = advice
        self.fallback = Adaptive(plan, slo, objective, seed, max_trials)

    def mode(self, history: History) -> tuple[str, str]:
        """("measure" | "calibrate" | "confirm", why): what the next trial is for."""
        advice = self.advice
        if advice is None:
            return "measure", "no twin advice was given"
        if not advice.available:
            return "measure", f"no twin for this deployment: {advice.reason}"
        done = measured(history)
        # The calibration trial ran on the catalog twin's prediction: that one missing is what calibration is for.
        confirmations = [s for s, _ in done[1:]]
        misses = [s for s in confirmations if s in advice.agreements and not advice.agreements[s].agrees]
        if len(misses) >= MAX_MISSES:
            return "measure", (f"{len(misses)} confirmations missed their prediction "
                               f"({advice.agreements[misses[-1]].worst}): the twin is not trusted")
        if not done:
            return "calibrate", "nothing measured yet"
        if not advice.trusted:
            return "measure", (f"the calibration on {len(done)} trial(s) is Untrusted, so the twin does not steer: "
                               f"Adaptive picks the next trial, and the twin recalibrates on it ({advice.reason})")
        return "confirm", advice.reason

    def _next(self, history: list[HistoryEntry], pending: frozenset[Setting]) -> Setting | None:
        mode, _ = self.mode(history)
        if mode == "measure":
            return self.fallback._next(history, pending)
        if pending:
            return None  # every trial recalibrates the next decision
        advice = self.advice
        assert advice is not None
        candidates = set(self.plan.candidates)
        tried = {s for s, _ in history}
        done = measured(history)

        def open_(setting: Setting) -> bool:
            return setting in candidates and setting not in tried and memory_blocked(setting, history) is None

        if mode == "calibrate":
            first = advice.calibration_setting
            return first if first is not None and open_(first) else self.fallback._next(history, pending)
        if len(done) - 1 >= MAX_CONFIRMATIONS:
            return None
        reference = self._reference(done)
        for predicted in advice.ranked:
            if not open_(predicted.setting):
                continue
            if predicted.objective > reference * (1 + CONFIRM_MARGIN):
                return predicted.setting
            break
        return self._uncovered_budget(done, open_)

    def _uncovered_budget(self, done: list[HistoryEntry], open_: Callable[[Setting], bool]) -> Setting | None:
        """Before stopping: the best candidate of a token budget no trial measured, when the twin ranks it
        within COLUMN_MARGIN of its best. A budget changes how prefills share a step, which calibration on
        another budget says least about."""
        assert self.advice is not None
        budgets = {s.max_num_batched_tokens for s in self.plan.candidates}
        if len(budgets) < 2 or not self.advice.ranked:
            return None
        covered = {s.max_num_batched_tokens for s, _ in done}
        top = self.advice.ranked[0].objective
        for predicted in self.advice.ranked:
            if predicted.objective < top * (1 - COLUMN_MARGIN):
                return None
            if predicted.setting.max_num_batched_tokens not in covered and open_(predicted.setting):
                return predicted.setting
        return None

    def _reference(self, done: list[HistoryEntry]) -> float:
        """The best measured setting's objective as the twin sees it (its measured one where the twin has none)."""
        assert self.advice is not None
        best = 0.0
        for setting, outcome in done:
            if not outcome.met:
                continue
            predicted = self.advice.predicted(setting)
            value = predicted.objective if predicted is not None else outcome.objective
            best = max(best, value or 0.0)
        return best

    def skipped(self, history: History | None = None) -> list[PrunedSetting]:
        entries = list(self._told if history is None else history)
        mode, _ = self.mode(entries)
        if mode == "measure" or self.advice is None:
            return self.fallback.skipped(entries)
        tried = {s for s, _ in entries}
        ranked = {p.setting: p for p in self.advice.ranked}
        out = []
        for setting in self.plan.candidates:
            if setting in tried:
                continue
            predicted = ranked.get(setting)
            why = "the calibrated twin predicts it cannot hold the SLO" if predicted is None else \
                f"the calibrated twin predicts {predicted.objective:.4g}, below the best measured"
            out.append(PrunedSetting(setting, Reason.DOMINATED, f"dominated: {why}"))
        return out
