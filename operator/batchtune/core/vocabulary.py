"""The one definition of batchtune's words: phases, trial states, verdicts, reasons and status metric keys.

The API models, the core, the controller, the bench and the CLI all import these; none spells them
again. Enums are `StrEnum`s, so a member equals its wire text (`Verdict.MET == "Met"`).
"""

from __future__ import annotations

from enum import StrEnum


class Phase(StrEnum):
    """Where a BatchTuning is in its life."""

    PENDING = "Pending"
    PLANNING = "Planning"
    TRIALING = "Trialing"
    SELECTING = "Selecting"
    APPLYING = "Applying"
    PROPOSING = "Proposing"
    """PullRequest mode: writing the change to its branch in Git (and opening the pull request)."""
    AWAITING_MERGE = "AwaitingMerge"
    """PullRequest mode: the change is in Git; waiting until production runs it (merged and synced)."""
    VERIFYING = "Verifying"
    SUCCEEDED = "Succeeded"
    RECOMMENDED = "Recommended"
    ROLLED_BACK = "RolledBack"
    FAILED = "Failed"

    @property
    def terminal(self) -> bool:
        """True once the operator takes no further step for this generation."""
        return self in TERMINAL_PHASES

    @property
    def touches_production(self) -> bool:
        """Phases in which production may run a setting batchtune applied but has not verified."""
        return self in (Phase.APPLYING, Phase.VERIFYING)


TERMINAL_PHASES = frozenset({Phase.SUCCEEDED, Phase.RECOMMENDED, Phase.ROLLED_BACK, Phase.FAILED})


class TrialState(StrEnum):
    """Where one trial is."""

    PENDING = "Pending"
    DEPLOYING = "Deploying"
    WARMING = "Warming"
    MEASURING = "Measuring"
    DONE = "Done"
    INFEASIBLE = "Infeasible"
    """The setting cannot work (memory, the engine refused it): informs pruning."""
    FAILED = "Failed"
    """Something else went wrong (timeout, load generator, metrics): tells nothing about the setting."""

    @property
    def finished(self) -> bool:
        return self in FINISHED_TRIAL_STATES

    @property
    def active(self) -> bool:
        return not self.finished


FINISHED_TRIAL_STATES = frozenset({TrialState.DONE, TrialState.INFEASIBLE, TrialState.FAILED})


class StepPurpose(StrEnum):
    """Why a trial runs a load step (unset in status: a full-window step of the search)."""

    CURVE = "Curve"
    """Measured at the common curve load for the report; outside the trial's search and verdict."""
    BRACKET = "Bracket"
    """A short step of the capacity search (spec.trial.bracketSeconds): it brackets the capacity, and a load
    it passes counts only once a full-window step there passes too."""


class Verdict(StrEnum):
    """Whether the SLO held. Missing data, NaN or too few samples is Unknown, never Met."""

    MET = "Met"
    VIOLATED = "Violated"
    UNKNOWN = "Unknown"


class ConditionType(StrEnum):
    PROGRESSING = "Progressing"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    DEGRADED = "Degraded"


class Reason(StrEnum):
    """Every reason batchtune writes: on conditions, Events, trials and pruned settings.

    docs/troubleshooting.md has one entry per member (a unit test keeps them in step).
    """

    # Spec and target
    INVALID_SPEC = "InvalidSpec"
    SPEC_CHANGED = "SpecChanged"
    TARGET_NOT_FOUND = "TargetNotFound"
    TARGET_CHANGED = "TargetChanged"
    NO_ENGINE_CONTAINER = "NoEngineContainer"
    UNSUPPORTED_ARGS = "UnsupportedArgs"
    COMMAND_LINE_TOO_LONG = "CommandLineTooLong"
    UNCOUNTED_ACCELERATOR = "UncountedAccelerator"
    NOT_ALLOWED = "NotAllowed"
    EMPTY_SEARCH_SPACE = "EmptySearchSpace"
    STATUS_UNREADABLE = "StatusUnreadable"
    UNMEASURED_RECOMMENDATION = "UnmeasuredRecommendation"
    WAITING_FOR_PRODUCTION_DATA = "WaitingForProductionData"
    # Planning and trials
    PLANNED = "Planned"
    WAITING_FOR_GPUS = "WaitingForGPUs"
    GPU_BUDGET_EXHAUSTED = "GpuBudgetExhausted"
    TRIAL_STARTED = "TrialStarted"
    TRIAL_COMPLETED = "TrialCompleted"
    TRIAL_INFEASIBLE = "TrialInfeasible"
    TRIAL_FAILED = "TrialFailed"
    TRIALS_DONE = "TrialsDone"
    TWIN_SEARCHING = "TwinSearching"
    TWIN_DISTRUSTED = "TwinDistrusted"
    # Why a trial ended
    MEASURED = "Measured"
    NO_CAPACITY = "NoCapacity"
    NOT_MEASURED = "NotMeasured"
    OOM_KILLED = "OOMKilled"
    OUT_OF_MEMORY = "OutOfMemory"
    BURST_OUT_OF_MEMORY = "BurstOutOfMemory"
    KV_CACHE_TOO_SMALL = "KvCacheTooSmall"
    GPU_MEMORY_UTILIZATION_TOO_HIGH = "GpuMemoryUtilizationTooHigh"
    ENGINE_REFUSED_ARGS = "EngineRefusedArgs"
    CRASH_LOOP_BACK_OFF = "CrashLoopBackOff"
    UNSCHEDULABLE = "Unschedulable"
    IMAGE_PULL_BACK_OFF = "ImagePullBackOff"
    READINESS_TIMEOUT = "ReadinessTimeout"
    TRIAL_POD_LOST = "TrialPodLost"
    LOAD_GENERATOR_FAILED = "LoadGeneratorFailed"
    MEASUREMENT_UNAVAILABLE = "MeasurementUnavailable"
    MEASUREMENT_WINDOW_TOO_SHORT = "MeasurementWindowTooShort"
    # Pruned before any GPU is spent
    ENGINE_INVARIANT = "EngineInvariant"
    DOES_NOT_FIT_MEMORY = "DoesNotFitMemory"
    DOMINATED = "Dominated"
    # Prometheus
    PROMETHEUS_UNREACHABLE = "PrometheusUnreachable"
    PROMETHEUS_REACHABLE = "PrometheusReachable"
    # Selection and production
    NO_FEASIBLE_SETTING = "NoFeasibleSetting"
    SELECTED = "Selected"
    RECOMMENDATION_READY = "RecommendationReady"
    TARGET_OWNED = "TargetOwned"
    """A controller owns the target (ownerReference with controller: true): recommended, never patched."""
    ALREADY_OPTIMAL = "AlreadyOptimal"
    COOLDOWN_ACTIVE = "CooldownActive"
    APPLY_CONFLICT = "ApplyConflict"
    APPLIED = "Applied"
    RECOMMENDATION_APPLIED = "RecommendationApplied"
    WAITING_FOR_ROLLOUT = "WaitingForRollout"
    WAITING_FOR_TRAFFIC = "WaitingForTraffic"
    VERIFIED = "Verified"
    VERIFY_INCONCLUSIVE = "VerifyInconclusive"
    KEPT_UNVERIFIED = "KeptUnverified"
    REGRESSION = "Regression"
    ROLLOUT_STUCK = "RolloutStuck"
    ROLLED_BACK = "RolledBack"
    PRODUCTION_CHANGED_BY_OTHERS = "ProductionChangedByOthers"
    DELETED = "Deleted"
    # PullRequest mode and who manages the target
    BRANCH_PUSHED = "BranchPushed"
    PULL_REQUEST_OPENED = "PullRequestOpened"
    WAITING_FOR_MERGE = "WaitingForMerge"
    MERGED_CHANGE_RUNNING = "MergedChangeRunning"
    PULL_REQUEST_CLOSED = "PullRequestClosed"
    SUPERSEDED = "Superseded"
    GIT_UNAVAILABLE = "GitUnavailable"
    GIT_EDIT_FAILED = "GitEditFailed"
    AUTO_DOWNGRADED = "AutoDowngraded"
    # Continuous tuning (spec.retune)
    ROUND_STARTED = "RoundStarted"
    ROUND_ENDED = "RoundEnded"
    KEPT_CURRENT = "KeptCurrent"


# Trial reasons the strategies prune on: the setting, not the circumstances, made the trial fail.
MEMORY_REASONS = frozenset({Reason.KV_CACHE_TOO_SMALL, Reason.OUT_OF_MEMORY, Reason.OOM_KILLED})


class M(StrEnum):
    """Status metric keys (`status.trials[].metrics`, step metrics, production windows).

    Latencies are milliseconds at the SLO percentile; rates are per second.
    """

    TTFT_MS = "ttftMs"
    ITL_MS = "itlMs"
    E2E_MS = "e2eMs"
    TTFT_MEAN_MS = "ttftMeanMs"
    """Mean TTFT (a histogram's sum over its count: exact, and smooth where percentiles jump)."""
    ITL_MEAN_MS = "itlMeanMs"
    """Mean inter-token latency (the same): what a twin calibrates on best."""
    QUEUE_MS = "queueMs"
    TTFT_HISTOGRAM_MS = "ttftHistogramMs"
    ITL_HISTOGRAM_MS = "itlHistogramMs"
    E2E_HISTOGRAM_MS = "e2eHistogramMs"
    REQUEST_THROUGHPUT = "requestThroughput"
    OUTPUT_THROUGHPUT = "outputThroughput"
    PROMPT_THROUGHPUT = "promptThroughput"
    OFFERED_REQUEST_RATE = "offeredRequestRate"
    """Requests per second the load generator sent (finished or not)."""
    PREEMPTIONS_PER_SECOND = "preemptionsPerSecond"
    RUNNING_REQUESTS = "runningRequests"
    WAITING_REQUESTS = "waitingRequests"
    WAITING_GROWTH = "waitingGrowth"
    """Waiting requests at the window's end less at its start: a queue that grows is no steady state."""
    KV_CACHE_USAGE_PERCENT = "kvCacheUsagePercent"
    KV_CACHE_USAGE_MAX_PERCENT = "kvCacheUsageMaxPercent"
    GPU_UTIL_PERCENT = "gpuUtilPercent"
    SM_ACTIVE_PERCENT = "smActivePercent"
    SM_OCCUPANCY_PERCENT = "smOccupancyPercent"
    TENSOR_ACTIVE_PERCENT = "tensorActivePercent"
    DRAM_ACTIVE_PERCENT = "dramActivePercent"
    POWER_WATTS = "powerWatts"
    """Power of all the trial's GPUs together."""
    FB_USED_MIB = "fbUsedMiB"
    FB_FREE_MIB = "fbFreeMiB"
    KV_POOL_TOKENS = "kvPoolTokens"
    """The engine's KV-cache pool: blocks x block size (vLLM's cache_config_info)."""
    GPUS = "gpus"
    """GPUs the measured pod holds (tensor parallel: more than one)."""
    ERROR_RATE_PERCENT = "errorRatePercent"
    SAMPLES = "samples"
    """Requests a step's latency percentiles rest on (finished plus still in flight)."""
    IN_FLIGHT = "inFlight"
    """Requests still running when the window ended (their elapsed time counts as a lower bound)."""
    REQUESTS = "requests"
    """Production requests counted in a verify window."""
    # Trial conclusions
    GOODPUT = "goodput"
    """Requests per second that met every SLO target, each request on its own (the load generator counts them)."""
    SLO_CAPACITY = "sloCapacity"
    SLO_CAPACITY_LOAD = "sloCapacityLoad"
    TOKENS_PER_JOULE = "tokensPerJoule"
    KV_CACHE_USAGE_PEAK_PERCENT = "kvCacheUsagePeakPercent"
    PREEMPTIONS_PEAK_PER_SECOND = "preemptionsPeakPerSecond"


CONCLUSION_METRICS = (M.SLO_CAPACITY, M.SLO_CAPACITY_LOAD, M.TOKENS_PER_JOULE, M.KV_CACHE_USAGE_PEAK_PERCENT,
                      M.PREEMPTIONS_PEAK_PER_SECOND)
"""A trial's figures drawn from all its steps (`protocol.conclude`): a trial has them, never a step or a run."""
PRODUCTION_METRICS = (M.REQUESTS,)
"""Figures only production's verify windows have (`promql.production_queries`), never a trial's run."""
UNKEPT_METRICS = (M.TTFT_HISTOGRAM_MS, M.ITL_HISTOGRAM_MS, M.E2E_HISTOGRAM_MS, M.IN_FLIGHT, M.OFFERED_REQUEST_RATE,
                  M.QUEUE_MS, M.PROMPT_THROUGHPUT, M.SM_OCCUPANCY_PERCENT, M.TENSOR_ACTIVE_PERCENT,
                  M.DRAM_ACTIVE_PERCENT, M.FB_USED_MIB, M.FB_FREE_MIB, M.GPUS)
"""Figures a run measures that no decision, twin fit or report reads once the run is judged (the histogram copies and
counts only cross-check the load generator then): status does not keep them, since each kept figure is paid for in
every step and run of the largest object (issue 22, section 9)."""
STEP_METRICS = tuple(m for m in M if m not in CONCLUSION_METRICS + PRODUCTION_METRICS + UNKEPT_METRICS)
"""What status keeps of a load run's figures (`promql.trial_queries` and the load generator's own counts, less
`UNKEPT_METRICS`), so what a run and a step (the worst case over its runs) can hold in status."""
TRIAL_METRICS = STEP_METRICS + CONCLUSION_METRICS
"""A trial's figures: its deciding step's (`STEP_METRICS`) and its conclusions."""
PREDICTED_METRICS = (M.TTFT_MS, M.ITL_MS, M.E2E_MS, M.TTFT_MEAN_MS, M.ITL_MEAN_MS, M.REQUEST_THROUGHPUT,
                     M.OUTPUT_THROUGHPUT, M.RUNNING_REQUESTS, M.SLO_CAPACITY, M.KV_CACHE_USAGE_PERCENT)
"""What a prediction in status holds: the figures a twin predicts for a setting (`twin.guide.bench_names`) and the
ones the report holds a prediction against (`report_html.COMPARED`)."""

LATENCY_METRICS = (M.TTFT_MS, M.ITL_MS, M.E2E_MS)
