"""The tuning core: pure, typed functions with no I/O (the clock and the seed are passed in).

    plan = plan_candidates(SearchSpace.from_spec(spec.search_space), limits, fits)
    strategy = make_strategy("Adaptive", plan, SloTargets.from_spec(spec.slo), "SloCapacity", seed, max_trials)
    setting = strategy.ask(history, pending)          # history: [(Setting, TrialOutcome), ...]
    verdict = evaluate_slo(metrics, slo)              # Met only on finite numbers within limits
    selection = select_best(trials, objective, slo)   # best, knee, reasons
"""

from batchtune.core.args import (
    ArgsError,
    UnsafeShell,
    VllmInvocation,
    canonical_flag,
    find_vllm_container,
    parse_flag_list,
    read_vllm_settings,
    rewrite_vllm_args,
    vllm_port,
)
from batchtune.core.knee import KNEE_GAIN_PERCENT, CurvePoint, Knee, curve_point, find_knee
from batchtune.core.manifests import (
    LABEL_COMPONENT,
    LABEL_MANAGED_BY,
    LABEL_TRIAL,
    LABEL_TUNING,
    LoadProfile,
    build_load_job,
    build_trial_deployment,
    child_name,
    load_job_name,
    load_profile_from_spec,
    owner_reference,
    trial_name,
)
from batchtune.core.objective import Objective, objective_value
from batchtune.core.outcomes import (
    MEMORY_REASONS,
    REASON_GPU_MEMORY_UTILIZATION_TOO_HIGH,
    REASON_KV_CACHE_TOO_SMALL,
    REASON_OUT_OF_MEMORY,
    History,
    HistoryEntry,
    TrialOutcome,
    TrialState,
    Verdict,
)
from batchtune.core.planning import (
    EngineLimits,
    FitCheck,
    FitVerdict,
    Plan,
    PrunedSetting,
    SearchSpace,
    doublings,
    plan_candidates,
)
from batchtune.core.promql import LabelNames, MetricNames, escape_label_value, selector, trial_queries
from batchtune.core.selection import CompletedTrial, Selection, select_best
from batchtune.core.settings import Setting, percent_to_fraction
from batchtune.core.slo import SloTargets, SloVerdict, evaluate_slo
from batchtune.core.strategies import STRATEGIES, Adaptive, Bayesian, Grid, Strategy, make_strategy

__all__ = [
    "Adaptive", "ArgsError", "UnsafeShell", "Bayesian", "CompletedTrial", "CurvePoint", "EngineLimits", "FitCheck",
    "FitVerdict", "Grid", "History", "HistoryEntry", "KNEE_GAIN_PERCENT", "Knee", "LABEL_COMPONENT",
    "LABEL_MANAGED_BY", "LABEL_TRIAL", "LABEL_TUNING", "LabelNames", "LoadProfile", "MEMORY_REASONS",
    "MetricNames", "Objective", "Plan", "PrunedSetting", "REASON_GPU_MEMORY_UTILIZATION_TOO_HIGH",
    "REASON_KV_CACHE_TOO_SMALL", "REASON_OUT_OF_MEMORY", "STRATEGIES", "SearchSpace", "Selection",
    "Setting", "SloTargets", "SloVerdict", "Strategy", "TrialOutcome", "TrialState", "Verdict",
    "VllmInvocation", "build_load_job", "build_trial_deployment", "canonical_flag", "child_name",
    "curve_point", "doublings", "escape_label_value", "evaluate_slo", "find_knee", "find_vllm_container",
    "load_job_name", "load_profile_from_spec", "make_strategy", "objective_value", "owner_reference",
    "parse_flag_list", "percent_to_fraction", "plan_candidates", "read_vllm_settings", "rewrite_vllm_args",
    "select_best", "selector", "trial_name", "trial_queries", "vllm_port",
]
