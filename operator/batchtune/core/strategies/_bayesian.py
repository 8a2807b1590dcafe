"""Bayesian: Optuna's TPE over the discrete candidate space, rebuilt from the history on each ask.

The study lives only in memory: every ask creates it, adds the finished trials, and asks once, so
the next setting depends only on (plan, seed, history). Trials that met the SLO score their
objective; violated or memory-infeasible trials score 0 (worse than any feasible one); unknown
verdicts and unrelated failures are recorded as failed trials, which TPE ignores.
"""

from __future__ import annotations

import math
import warnings

from batchtune.core.objective import objective_value
from batchtune.core.outcomes import HistoryEntry, TrialState, Verdict
from batchtune.core.settings import Setting
from batchtune.core.strategies._base import Strategy

_SEQS = "max_num_seqs_index"
_GMU = "gpu_memory_utilization_percent"
_MBT = "max_num_batched_tokens"


class Bayesian(Strategy):
    kind = "Bayesian"

    def _space(self) -> tuple[list[int], list[int], list[int]]:
        seqs = sorted({s.max_num_seqs for s in self.plan.candidates})
        gmus = sorted({s.gpu_memory_utilization_percent for s in self.plan.candidates})
        mbts = sorted({-1 if s.max_num_batched_tokens is None else s.max_num_batched_tokens
                       for s in self.plan.candidates})
        return seqs, gmus, mbts

    def _next(self, history: list[HistoryEntry], pending: frozenset[Setting]) -> Setting | None:
        import optuna  # heavy: only when a Bayesian tuning asks

        tried = {s for s, _ in history} | pending
        remaining = [s for s in self.plan.candidates if s not in tried]
        if not remaining:
            return None
        seqs, gmus, mbts = self._space()
        # max-num-seqs as an ordinal index: TPE then learns "smaller/larger", not unrelated labels.
        distributions = {
            _SEQS: optuna.distributions.IntDistribution(0, len(seqs) - 1),
            _GMU: optuna.distributions.CategoricalDistribution(gmus),
            _MBT: optuna.distributions.CategoricalDistribution(mbts),
        }
        # A fresh seed per history length: the same history always asks the same, and startup
        # (random) asks differ from one another.
        sampler = optuna.samplers.TPESampler(
            seed=(self.seed * 1_000_003 + len(history)) % (2**32),
            n_startup_trials=max(2, min(5, self.max_trials // 3)),
        )
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = optuna.create_study(direction="maximize", sampler=sampler)
        for setting, outcome in history:
            params = {
                _SEQS: seqs.index(setting.max_num_seqs) if setting.max_num_seqs in seqs else None,
                _GMU: setting.gpu_memory_utilization_percent,
                _MBT: -1 if setting.max_num_batched_tokens is None else setting.max_num_batched_tokens,
            }
            if params[_SEQS] is None or params[_GMU] not in gmus or params[_MBT] not in mbts:
                continue  # not in this plan (the spec changed): the history point cannot be expressed
            value = self._score(outcome)
            state = optuna.trial.TrialState.COMPLETE if value is not None else optuna.trial.TrialState.FAIL
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                study.add_trial(optuna.trial.create_trial(
                    params=params, distributions=distributions, value=value, state=state,
                ))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trial = study.ask(distributions)
        wanted = Setting(
            seqs[trial.params[_SEQS]],
            trial.params[_GMU],
            None if trial.params[_MBT] == -1 else trial.params[_MBT],
        )
        return min(remaining, key=lambda s: (_distance(s, wanted, seqs, gmus, mbts), s.sort_key()))

    def _score(self, outcome) -> float | None:  # type: ignore[no-untyped-def]
        if outcome.met:
            value = outcome.objective
            if value is None:
                value = objective_value(self.objective, outcome.metrics)
            return value if value is not None else None
        if outcome.state is TrialState.DONE and outcome.verdict is Verdict.VIOLATED:
            return 0.0
        if outcome.state is TrialState.INFEASIBLE:
            return 0.0
        return None


def _distance(a: Setting, b: Setting, seqs: list[int], gmus: list[int], mbts: list[int]) -> float:
    """Distance in grid steps, so a sampled point that was pruned or tried maps to its neighbour."""
    def mbt(s: Setting) -> int:
        return -1 if s.max_num_batched_tokens is None else s.max_num_batched_tokens

    return math.fsum((
        abs(seqs.index(a.max_num_seqs) - seqs.index(b.max_num_seqs)),
        abs(gmus.index(a.gpu_memory_utilization_percent) - gmus.index(b.gpu_memory_utilization_percent)),
        abs(mbts.index(mbt(a)) - mbts.index(mbt(b))),
    ))
