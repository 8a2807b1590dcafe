"""Typed, frozen models of the BatchTuning v1alpha1 resource (spec and status).

Attributes are snake_case; the wire form (CRD, YAML, status patches) is camelCase through
aliases. `crds/batchtune.io_batchtunings.yaml` is the source of truth for the API and
`tests/unit/test_api_crd_drift.py` keeps these models in step with it: field paths, enums,
defaults, required fields and numeric bounds.

Spec models forbid unknown fields (a typo must not be ignored silently) and take integers
strictly (the API server rejects `"12"` for an integer, so the models do too). Status models
ignore unknown fields so an operator can read status written by a newer or older version.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    Strict,
    WithJsonSchema,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from batchtune import API_GROUP, API_VERSION
from batchtune.core import tuning
from batchtune.core.gitops import Manager
from batchtune.core.gitwrite import ForgeType
from batchtune.core.gitwrite import Layout as GitLayout
from batchtune.core.manifests import MAX_NAME
from batchtune.core.objective import Objective
from batchtune.core.planning import SearchSpace as CoreSearchSpace
from batchtune.core.planning import doublings
from batchtune.core.promql import LabelNames as CoreLabelNames
from batchtune.core.promql import MetricNames as CoreMetricNames
from batchtune.core.protocol import MAX_STEPS_PER_TRIAL
from batchtune.core.recommend import (
    MAX_COMMAND_LINE_CHARACTERS,
    MAX_COMMAND_LINE_WORD_LENGTH,
    MAX_COMMAND_LINE_WORDS,
    command_line_characters,
)
from batchtune.core.recommend import ContainerArgs as CoreContainerArgs
from batchtune.core.retune import RetunePolicy
from batchtune.core.settings import Setting as CoreSetting
from batchtune.core.slo import PERCENTILES, SloTargets
from batchtune.core.trial_loop import KEPT_STEPS
from batchtune.core.verify import InconclusivePolicy
from batchtune.core.vocabulary import (
    PREDICTED_METRICS,
    STEP_METRICS,
    TRIAL_METRICS,
    M,
    Phase,
    StepPurpose,
    TrialState,
    Verdict,
)
from batchtune.core.warmup import WarmupMode
from batchtune.core.workload import ArrivalProfile as CoreArrivalProfile
from batchtune.core.workload import DriftThresholds

if TYPE_CHECKING:
    from batchtune.engines import MetricConventions
from batchtune.core.workload import LengthDistribution as CoreLengthDistribution
from batchtune.core.workload import WorkloadProfile as CoreWorkloadProfile

API_VERSION_FULL = f"{API_GROUP}/{API_VERSION}"


def camel(name: str) -> str:
    """`e2e_latency_milliseconds` -> `e2eLatencyMilliseconds` (pydantic's to_camel gives `e2ELatency...`)."""
    head, *rest = name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


# ---------------------------------------------------------------------------------------------
# Enums


class StrategyType(StrEnum):
    """How trials are chosen."""

    GRID = "Grid"
    """Every candidate in the search space: the exhaustive baseline."""
    ADAPTIVE = "Adaptive"
    """Bracketing and bisection on maxNumSeqs, exploiting that latency grows with it."""
    BAYESIAN = "Bayesian"
    """Optuna's sampler over the search space."""
    TWIN_GUIDED = "TwinGuided"
    """The twin calibrated on a real trial ranks every candidate; the best are confirmed on real trials."""


ObjectiveType = Objective
"""What "best" means among trials that meet every SLO (the core's `Objective`)."""


class Percentile(StrEnum):
    """The latency percentile the SLO targets apply to."""

    P50 = "P50"
    P90 = "P90"
    P95 = "P95"
    P99 = "P99"

    @property
    def quantile(self) -> float:
        """0.95 for P95: the argument of PromQL's histogram_quantile."""
        return int(self.value[1:]) / 100


class Generator(StrEnum):
    """Which load generator drives a trial."""

    VLLM_BENCH = "VllmBench"
    """`vllm bench serve` from the target's own image."""
    BUILTIN = "Builtin"
    """The project's own load generator."""


class CurveLoadType(StrEnum):
    """Which common offered load every trial is also measured at, for the report's curves."""

    PRODUCTION_PEAK = "ProductionPeak"
    """Production's peak 1-minute request rate per replica over the last hour, as an open loop; unknown
    (or too quiet to measure): a closed loop at the largest maxNumSeqs the plan holds."""
    CONCURRENCY = "Concurrency"
    """A closed loop at `concurrency` requests in flight (unset: the largest maxNumSeqs the plan holds)."""
    REQUESTS_PER_MINUTE = "RequestsPerMinute"
    """An open loop at `requestsPerMinute`."""
    OFF = "Off"
    """No extra step: the report draws the capacity panel only."""


class ApplyMode(StrEnum):
    """What happens to production once the best setting is known."""

    AUTO = "Auto"
    """Patch production, verify for a window, roll back on regression."""
    RECOMMEND = "Recommend"
    """Write the recommendation and ready patches only; production is untouched."""
    PULL_REQUEST = "PullRequest"
    """Write the change into a Git repository on a branch of its own (spec.apply.git), open a pull request where
    a forge is configured, and verify production once it runs the merged change."""


class ConditionStatus(StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


# ---------------------------------------------------------------------------------------------
# Reusable field types

T = TypeVar("T")

# Strict: YAML `"12"` or `true` is not an integer to the API server, so not to us either.
Int = Annotated[int, Strict()]
Str = Annotated[str, Strict()]
Bool = Annotated[bool, Strict()]

# A reason code (docs/troubleshooting.md): UpperCamelCase, not an enum, so an older operator reads a newer one's.
ReasonCode = Annotated[str, Field(pattern=r"^[A-Z][A-Za-z0-9]*$", max_length=64)]


def _cut(limit: int) -> Callable[[Any], Any]:
    """A status string longer than its bound is cut to it: a status write must never fail on a long message."""
    def cut(value: Any) -> Any:
        return value[:limit] if isinstance(value, str) else value
    return cut


def _first(limit: int) -> Callable[[Any], Any]:
    """A status list longer than its bound keeps its first items."""
    def first(value: Any) -> Any:
        return list(value)[:limit] if isinstance(value, (list, tuple)) else value
    return first


# Status strings, each with a bound the CRD carries (issue 22: the largest object must fit in etcd).
Word = Annotated[str, BeforeValidator(_cut(64)), Field(max_length=64)]
"""A state, source or hash."""
Name = Annotated[str, BeforeValidator(_cut(253)), Field(max_length=253)]
"""A Kubernetes object name (or a Git commit or ref)."""
ChildName = Annotated[str, BeforeValidator(_cut(MAX_NAME)), Field(max_length=MAX_NAME)]
"""The name of an object batchtune creates for a tuning (`core.manifests.child_name`: at most 63 characters)."""
Line = Annotated[str, BeforeValidator(_cut(500)), Field(max_length=500)]
"""One line of explanation."""
Paragraph = Annotated[str, BeforeValidator(_cut(2000)), Field(max_length=2000)]
"""A message."""
NOTE_LENGTH = 200
Note = Annotated[str, BeforeValidator(_cut(NOTE_LENGTH)), Field(max_length=NOTE_LENGTH)]
"""A short note that status keeps many of (one per load step or run): a verdict's reason, a cross-check."""
Url = Annotated[str, BeforeValidator(_cut(2048)), Field(max_length=2048)]
"""A URL (spec's URLs are at most 2048 characters)."""
Patch = Annotated[str, BeforeValidator(_cut(16384)), Field(max_length=16384)]
"""A ready-made patch or values snippet (its container's command line and the setting)."""
Timestamp = Annotated[datetime, WithJsonSchema({"type": "string", "format": "date-time", "maxLength": 64})]
"""An RFC 3339 time (the API server bounds only what the schema bounds, so this says how long one may be)."""
COMMAND_LINE_TOTAL_RULE = f"self.map(w, size(w)).sum() <= {MAX_COMMAND_LINE_CHARACTERS}"
"""The CRD's bound on a command line's characters together (Kubernetes' CEL list library: `sum`)."""


def _command_line_total(words: list[str]) -> list[str]:
    total = command_line_characters(words)
    if total > MAX_COMMAND_LINE_CHARACTERS:
        raise ValueError(f"a command line of {total} characters, more than {MAX_COMMAND_LINE_CHARACTERS}")
    return words


CommandLine = Annotated[list[Annotated[str, Field(max_length=MAX_COMMAND_LINE_WORD_LENGTH)]],
                        Field(max_length=MAX_COMMAND_LINE_WORDS, json_schema_extra={"x-kubernetes-validations": [
                            {"rule": COMMAND_LINE_TOTAL_RULE,
                             "message": f"a command line has at most {MAX_COMMAND_LINE_CHARACTERS} characters"}]}),
                        AfterValidator(_command_line_total)]
"""A container's command, its args, both together, or an engine's argv, whole: planning refuses a target whose command line (or the
recommended one) is longer (`core.recommend.command_line_problem`), since a cut one would restore a different
container; so this is never cut."""
MAX_CONDITIONS = 8
"""Progressing, Succeeded, Failed, Degraded: one each, with room for types a newer operator adds."""

DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
PROM_METRIC_NAME = r"^[a-zA-Z_:][a-zA-Z0-9_:]*$"
PROM_LABEL_NAME = r"^[a-zA-Z_][a-zA-Z0-9_]*$"
SECRET_KEY = r"^[-._a-zA-Z0-9]+$"

# One extra engine flag: --name or --name=value, spelled in full (no abbreviation, no underscores, no $(VAR)).
# Values are printable ASCII without space or $: Go's \s is ASCII-only, so a range agrees on both sides.
EXTRA_ARG = re.compile(r"^--[a-z0-9][a-z0-9-]*(=[!-#%-~]+)?$")

MAX_NUM_SEQS_LIMIT = 65536
MAX_NUM_BATCHED_TOKENS_LIMIT = 16_777_216
MAX_TRIALS_LIMIT = 32
"""spec.strategy.maxTrials: status keeps every trial of a tuning (issue 22: the trials are most of the largest object)."""
MAX_PARALLEL_TRIALS_LIMIT = 8
"""spec.strategy.maxParallelTrials: each running trial keeps every step in status (issue 22, section 9)."""
MAX_TRIAL_INDEX = 2_147_483_647
"""Trial indexes (and the counter) stay int32: a forged counter past it is unreadable status, not an API error."""
MAX_TRIALS_IN_STATUS = MAX_TRIALS_LIMIT + 1
"""spec.strategy.maxTrials, plus a retune round's trial 0 (production's own command line)."""
MAX_STEPS_IN_STATUS = MAX_STEPS_PER_TRIAL
"""Load steps of one trial: the capacity search's steps, its extra steps when misled, confirmations and the curve step
(`core.protocol.MAX_STEPS_PER_TRIAL`, 10)."""
MAX_REPEATS = 5
"""spec.trial.repeats: the results a step keeps (each running trial keeps its open step's runs in status)."""
MAX_PRUNED_IN_STATUS = 200
MAX_RUNNING_IN_STATUS = MAX_PARALLEL_TRIALS_LIMIT + 1
"""Running trials: spec.strategy.maxParallelTrials, plus a retune round's trial 0."""


def _no_duplicates(items: list[T]) -> list[T]:
    seen: set[Any] = set()
    for item in items:
        if item in seen:
            raise PydanticCustomError("duplicate", "duplicate value {value} (values must be unique)", {"value": item})
        seen.add(item)
    return items


def _extra_flag_form(arg: str) -> str:
    # The same rule as the CRD's pattern. Which flags, and their values, are the engine's and the install's
    # to say (batchtune.admission): an install may allow more than the default list, which no CRD can know.
    if not EXTRA_ARG.match(arg) or arg.endswith("\n"):
        raise PydanticCustomError(
            "extra_arg_form", "must be one flag per item, --name or --name=value (printable ASCII, no spaces, no $)", {"arg": arg})
    return arg


# Prometheus reserves label names that start with "__"; `le` and `quantile` are the bucket and quantile labels
# every histogram and summary query groups by, so a pod or model label by that name would read the wrong series.
RESERVED_LABEL_MESSAGE = "is a label name Prometheus reserves (__*) or batchtune's queries use (le, quantile)"


def label_name_problem(name: str) -> str | None:
    """Why `name` cannot name a label on the engine's or the GPU exporter's series, or None."""
    return RESERVED_LABEL_MESSAGE if name.startswith("__") or name in ("le", "quantile") else None


def _unreserved_label(name: str) -> str:
    if label_name_problem(name):
        raise PydanticCustomError("reserved_label", RESERVED_LABEL_MESSAGE, {})
    return name


# Kubernetes refuses these Secret and ConfigMap keys (validation.IsConfigMapKey: a volume would write them
# as a path component): ".", "..", and any key that starts with "..".
KEY_MESSAGE = "is not a Secret or ConfigMap key Kubernetes allows (not '.', and not starting with '..')"


def _object_key(key: str) -> str:
    if key == "." or key.startswith(".."):
        raise PydanticCustomError("object_key", KEY_MESSAGE, {})
    return key


def _image_reference(image: str) -> str:
    from batchtune.core.policy import image_reference_problem

    problem = image_reference_problem(image)
    if problem:
        raise PydanticCustomError("image_reference", problem, {})
    return image


def _http_url(url: str) -> str:
    if not (url.startswith("http://") or url.startswith("https://")):
        raise PydanticCustomError("url_scheme", "must start with http:// or https://", {})
    return url


def _nan_is_absent(value: Any) -> Any:
    # JSON cannot carry NaN, and unknown must read as absent, never as a number that passes.
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


MaxNumSeqs = Annotated[Int, Field(ge=1, le=MAX_NUM_SEQS_LIMIT)]
GpuPercent = Annotated[Int, Field(ge=10, le=99)]
BatchedTokens = Annotated[Int, Field(ge=16, le=MAX_NUM_BATCHED_TOKENS_LIMIT)]
ExtraArg = Annotated[Str, Field(min_length=3, max_length=512, pattern=EXTRA_ARG.pattern), AfterValidator(_extra_flag_form)]
Milliseconds = Annotated[Int, Field(ge=1, le=3_600_000)]
MetricName = Annotated[Str, Field(min_length=1, max_length=256, pattern=PROM_METRIC_NAME)]
LabelName = Annotated[Str, Field(min_length=1, max_length=128, pattern=PROM_LABEL_NAME), AfterValidator(_unreserved_label)]
ObjectKey = Annotated[Str, Field(min_length=1, max_length=253, pattern=SECRET_KEY), AfterValidator(_object_key)]
Metric = Annotated[float | None, BeforeValidator(_nan_is_absent)]


def _cross_field(violations: list[tuple[str, Any, str]]) -> None:
    """Raise one error carrying every (field, value, message) a cross-field rule found."""
    if violations:
        raise PydanticCustomError(
            "cross_field",
            "{summary}",
            {"summary": "; ".join(msg for _, _, msg in violations), "violations": violations},
        )


class _Spec(BaseModel):
    model_config = ConfigDict(
        frozen=True,
        populate_by_name=True,
        alias_generator=camel,
        extra="forbid",
        use_attribute_docstrings=True,
    )

    def to_wire(self) -> dict[str, Any]:
        """The camelCase JSON form for the API server; unset fields are left out (the CRD has no nulls)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


class _Status(BaseModel):
    # Mutable: the reconcile works on one typed status per tick and writes what changed.
    model_config = ConfigDict(
        frozen=False,
        validate_assignment=True,
        populate_by_name=True,
        alias_generator=camel,
        extra="ignore",
        use_attribute_docstrings=True,
    )

    def to_wire(self) -> dict[str, Any]:
        """The camelCase JSON form for the API server; unset fields are left out (the CRD has no nulls)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


# ---------------------------------------------------------------------------------------------
# Spec


class TargetRef(_Spec):
    """The production vLLM Deployment to tune, in the BatchTuning's namespace."""

    name: Annotated[Str, Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)]
    """Name of the Deployment."""
    container_name: Annotated[Str, Field(min_length=1, max_length=63, pattern=DNS_LABEL)] | None = None
    """Container that runs vLLM; unset: the container whose command or args run vLLM."""


class MaxNumSeqsSpec(_Spec):
    """Candidate values of vLLM's --max-num-seqs: a list, or min/max with doubling."""

    values: Annotated[list[MaxNumSeqs], Field(min_length=1, max_length=64), AfterValidator(_no_duplicates)] | None = None
    """Explicit candidates, each 1..65536, unique, any order."""
    min: MaxNumSeqs | None = None
    """Smallest candidate; the candidates are min, 2*min, 4*min, ... up to max."""
    max: MaxNumSeqs | None = None
    """Largest allowed candidate; a doubling past it is not tried (max itself is tried only when it is a doubling of min)."""

    @model_validator(mode="after")
    def _one_form(self) -> MaxNumSeqsSpec:
        errors: list[tuple[str, Any, str]] = []
        has_range = self.min is not None or self.max is not None
        if self.values is not None and has_range:
            errors.append(("", None, f"set either values or min/max, not both (values={self.values}, min={self.min}, max={self.max})"))
        elif self.values is None and not has_range:
            errors.append(("", None, "set either values or both min and max"))
        elif self.values is None and self.min is None:
            errors.append(("min", None, f"required with max (max is {self.max})"))
        elif self.values is None and self.max is None:
            errors.append(("max", None, f"required with min (min is {self.min})"))
        elif self.min is not None and self.max is not None and self.min > self.max:
            errors.append(("min", self.min, f"must not exceed max {self.max}"))
        _cross_field(errors)
        return self

    def candidates(self) -> list[int]:
        """The candidate values, ascending: the explicit values, or doublings of min not above max."""
        if self.values is not None:
            return sorted(self.values)
        assert self.min is not None and self.max is not None
        out, value = [], self.min
        while value <= self.max:
            out.append(value)
            value *= 2
        return out


class SearchSpec(_Spec):
    """The settings trials explore."""

    max_num_seqs: MaxNumSeqsSpec
    """Candidates for --max-num-seqs (the most sequences vLLM runs in one batch)."""
    gpu_memory_utilization_percent: Annotated[
        list[GpuPercent], Field(min_length=1, max_length=16), AfterValidator(_no_duplicates)
    ] = Field(default_factory=lambda: [90])
    """Candidates for --gpu-memory-utilization in integer percent (90 means 0.90), each 10..99."""
    max_num_batched_tokens: Annotated[
        list[BatchedTokens], Field(min_length=1, max_length=16), AfterValidator(_no_duplicates)
    ] | None = None
    """Candidates for --max-num-batched-tokens (the token budget of one scheduler step); unset: keep production's."""
    extra_args: Annotated[list[ExtraArg], Field(max_length=64)] | None = None
    """Fixed engine flags added to every trial (and so to production), one flag per item as --name or
    --name=value (e.g. "--enforce-eager", "--max-model-len=4096"); only flags that change scheduling or
    memory behaviour, never ones that load code, change identity or set a tuned knob."""

    def max_num_seqs_candidates(self) -> list[int]:
        """The --max-num-seqs candidates, ascending."""
        return self.max_num_seqs.candidates()

    def core(self) -> CoreSearchSpace:
        seqs = self.max_num_seqs
        values = tuple(seqs.values) if seqs.values else doublings(int(seqs.min or 1), int(seqs.max or 1))
        return CoreSearchSpace(values, tuple(self.gpu_memory_utilization_percent or (90,)),
                               tuple(self.max_num_batched_tokens or ()))


class StrategySpec(_Spec):
    """How trials are chosen."""

    type: StrategyType = StrategyType.ADAPTIVE
    """Grid (exhaustive), Adaptive (bracketing/bisection on maxNumSeqs), Bayesian (Optuna) or TwinGuided (the
    twin calibrated on real trials searches every candidate; its best are confirmed on real trials)."""
    max_trials: Annotated[Int, Field(ge=1, le=MAX_TRIALS_LIMIT)] = 12
    """Most trials run (repeats of one setting count once)."""
    max_parallel_trials: Annotated[Int, Field(ge=1, le=MAX_PARALLEL_TRIALS_LIMIT)] = 1
    """Most trials that run at the same time (each holds the target's GPUs)."""
    seed: Annotated[Int, Field(ge=0, le=2_147_483_647)] = 0
    """Seed of every random choice, so the same history gives the same next trial."""
    max_gpu_minutes: Annotated[Int, Field(ge=1, le=10_000_000)] | None = None
    """GPU-minutes the trials may hold in all (GPUs x time); reached, the tuning decides on what it has.
    Unset: the install's ceiling (Helm value maxGpuMinutesPerTuning); never above it."""

    @model_validator(mode="after")
    def _parallel_within_budget(self) -> StrategySpec:
        errors: list[tuple[str, Any, str]] = []
        if self.max_parallel_trials > self.max_trials:
            errors.append(("maxParallelTrials", self.max_parallel_trials,
                           f"must not exceed maxTrials {self.max_trials}"))
        _cross_field(errors)
        return self

    def core(self) -> tuning.StrategyChoice:
        return tuning.StrategyChoice(self.type.value, self.max_trials, self.max_parallel_trials, self.seed,
                                     self.max_gpu_minutes)


class ObjectiveSpec(_Spec):
    """What "best" means among trials that meet every SLO."""

    type: ObjectiveType = ObjectiveType.SLO_CAPACITY
    """SloCapacity, OutputThroughput, GpuUtilization, TokensPerJoule or Goodput (requests per second that met every
    SLO target each, at the SLO capacity under production's shape)."""


class SloSpec(_Spec):
    """Latency and error targets a trial must meet to be feasible."""

    percentile: Percentile = Percentile.P95
    """Percentile the latency targets apply to."""
    ttft_milliseconds: Milliseconds | None = None
    """Time to first token at the percentile, in milliseconds."""
    inter_token_latency_milliseconds: Milliseconds | None = None
    """Inter-token latency (time per output token) at the percentile, in milliseconds."""
    e2e_latency_milliseconds: Milliseconds | None = None
    """End-to-end request latency at the percentile, in milliseconds."""
    max_error_rate_percent: Annotated[Int, Field(ge=0, le=100)] = 1
    """Most failed requests tolerated, in percent of all requests."""
    headroom_percent: Annotated[Int, Field(ge=0, le=90)] = 10
    """Margin kept below the knee and the SLO, for traffic peaks, in percent."""

    @model_validator(mode="after")
    def _some_latency_target(self) -> SloSpec:
        errors: list[tuple[str, Any, str]] = []
        if not self.latency_targets_ms():
            errors.append(("", None, "set at least one of ttftMilliseconds, interTokenLatencyMilliseconds, e2eLatencyMilliseconds"))
        _cross_field(errors)
        return self

    def latency_targets_ms(self) -> dict[str, int]:
        """The set latency targets keyed by the TrialMetrics attribute they bound: ttft_ms, itl_ms, e2e_ms."""
        targets = {
            "ttft_ms": self.ttft_milliseconds,
            "itl_ms": self.inter_token_latency_milliseconds,
            "e2e_ms": self.e2e_latency_milliseconds,
        }
        return {name: ms for name, ms in targets.items() if ms is not None}

    def core(self) -> SloTargets:
        return SloTargets(percentile=PERCENTILES[self.percentile.value], ttft_ms=self.ttft_milliseconds,
                          itl_ms=self.inter_token_latency_milliseconds, e2e_ms=self.e2e_latency_milliseconds,
                          max_error_rate_percent=self.max_error_rate_percent, headroom_percent=self.headroom_percent)


class ProductionWorkloadSpec(_Spec):
    """How production's workload is measured (with fromProduction, and by spec.retune's drift watch)."""

    lookback_seconds: Annotated[Int, Field(ge=600, le=2_592_000)] = 3600
    """How far back production's traffic is measured: its length histograms, request rate and burstiness."""
    min_requests: Annotated[Int, Field(ge=1, le=10_000_000)] = 100
    """Requests the lookback must hold before a profile is trusted; fewer: the tuning waits (WaitingForProductionData)."""


class ConfigMapKeyRef(_Spec):
    """A key in a ConfigMap in the BatchTuning's namespace."""

    name: Annotated[Str, Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)]
    """Name of the ConfigMap."""
    key: ObjectKey = "trace.jsonl"
    """Key in the ConfigMap."""


class LoadSpec(_Spec):
    """The load driven at each trial."""

    generator: Generator = Generator.BUILTIN
    """VllmBench (`vllm bench serve` from the target's image) or Builtin (the project's own)."""
    image: Annotated[Str, Field(min_length=1, max_length=512), AfterValidator(_image_reference)] | None = None
    """Load-generator image; unset: the target's image for VllmBench, the operator's for Builtin."""
    concurrency: Annotated[Int, Field(ge=1, le=100_000)] | None = None
    """Closed loop: requests in flight at once. Unset with requestsPerMinute unset: the trial's maxNumSeqs."""
    requests_per_minute: Annotated[Int, Field(ge=1, le=10_000_000)] | None = None
    """Open loop: Poisson arrivals at this mean rate per minute."""
    input_tokens: Annotated[Int, Field(ge=1, le=1_000_000)] = 512
    """Prompt length in tokens."""
    output_tokens: Annotated[Int, Field(ge=1, le=1_000_000)] = 128
    """Output length in tokens."""
    from_production: Bool = False
    """Drive production's own workload: prompt and output lengths sampled from its length histograms and, with
    neither concurrency nor requestsPerMinute set, open-loop arrivals at its peak rate with its burstiness."""
    production: ProductionWorkloadSpec = Field(default_factory=ProductionWorkloadSpec)
    """How production's workload is measured."""
    num_prompts: Annotated[Int, Field(ge=1, le=10_000_000)] | None = None
    """Requests to send per load run (then the run ends when they are answered) instead of running for
    trial.measureSeconds after the warm-up."""
    trace_config_map_ref: ConfigMapKeyRef | None = None
    """A JSONL trace (offset_seconds, prompt_tokens, output_tokens per line) every load run replays as is, its
    arrivals and lengths instead of generated ones; the load Job mounts the ConfigMap, the operator never reads it."""

    @model_validator(mode="after")
    def _one_loop_one_length(self) -> LoadSpec:
        errors: list[tuple[str, Any, str]] = []
        if self.concurrency is not None and self.requests_per_minute is not None:
            errors.append(("requestsPerMinute", self.requests_per_minute,
                           f"set concurrency or requestsPerMinute, not both (concurrency is {self.concurrency})"))
        if self.trace_config_map_ref is not None:
            if self.concurrency is not None or self.requests_per_minute is not None:
                errors.append(("traceConfigMapRef", None, "a trace brings its own arrivals: unset concurrency and "
                                                          "requestsPerMinute"))
            if self.from_production:
                errors.append(("traceConfigMapRef", None, "set traceConfigMapRef or fromProduction, not both"))
            if self.generator is Generator.VLLM_BENCH:
                errors.append(("traceConfigMapRef", None, "only the Builtin generator replays a trace"))
        _cross_field(errors)
        return self

    def core(self) -> tuning.Load:
        ref = self.trace_config_map_ref
        return tuning.Load(self.input_tokens, self.output_tokens, self.concurrency, self.requests_per_minute,
                           self.num_prompts, self.from_production,
                           tuning.Trace(ref.name, ref.key) if ref is not None else None,
                           self.generator is Generator.BUILTIN, self.image)


class TrialSpec(_Spec):
    """Timing of one trial."""

    warmup_seconds: Annotated[Int, Field(ge=0, le=3600)] = 30
    """Load before measuring starts (fills caches, compiles graphs)."""
    warmup: WarmupMode = WarmupMode.STEADY
    """Steady: the first load run of a trial warms up for warmupSeconds, later ones (the server is warm, only the queue
    must settle at the new load) until the load has settled, at most warmupSeconds (Builtin generator only; not
    for a trace). Fixed: every load run warms up for warmupSeconds."""
    measure_seconds: Annotated[Int, Field(ge=5, le=7200)] = 60
    """Measurement window of each load run, after the warm-up (the load runs warm-up plus this)."""
    readiness_timeout_seconds: Annotated[Int, Field(ge=10, le=7200)] = 900
    """How long a trial pod may take to become ready (model load) before it counts as failed."""
    repeats: Annotated[Int, Field(ge=1, le=MAX_REPEATS)] = 1
    """Measurements per setting; more repeats smooth noise."""
    bracket_seconds: Annotated[Int, Field(ge=0, le=7200)] | None = None
    """Measurement window of the capacity search's bracketing steps; only the load it settles on is measured for
    measureSeconds before it counts. Unset: a quarter of measureSeconds (at least 5 s and 3 Prometheus scrape
    intervals; off when that is over half of measureSeconds); 0: off, every step runs measureSeconds."""

    @model_validator(mode="after")
    def _bracket_below_window(self) -> TrialSpec:
        if self.bracket_seconds and self.bracket_seconds >= self.measure_seconds:
            _cross_field([("bracketSeconds", self.bracket_seconds,
                           f"must be below measureSeconds ({self.measure_seconds}); 0 turns bracketing off")])
        return self

    def core(self) -> tuning.TrialTiming:
        return tuning.TrialTiming(self.warmup_seconds, self.warmup, self.measure_seconds,
                                  self.readiness_timeout_seconds, self.repeats, self.bracket_seconds)


class CurveLoadSpec(_Spec):
    """The common offered load of the report's curves. It costs one extra load run per trial (warm-up plus
    measure window, on the trial's GPUs) and is never part of a trial's verdict or the decision."""

    type: CurveLoadType | None = None
    """ProductionPeak, Concurrency, RequestsPerMinute or Off; unset: Concurrency when concurrency is set,
    RequestsPerMinute when requestsPerMinute is, else ProductionPeak."""
    concurrency: Annotated[Int, Field(ge=1, le=100_000)] | None = None
    """Closed loop: requests in flight at once (type Concurrency; unset there: the largest maxNumSeqs planned)."""
    requests_per_minute: Annotated[Int, Field(ge=1, le=10_000_000)] | None = None
    """Open loop: mean arrival rate per minute, Poisson (type RequestsPerMinute)."""

    @property
    def kind(self) -> CurveLoadType:
        """The type, with unset read from the load given."""
        if self.type is not None:
            return self.type
        if self.concurrency is not None:
            return CurveLoadType.CONCURRENCY
        if self.requests_per_minute is not None:
            return CurveLoadType.REQUESTS_PER_MINUTE
        return CurveLoadType.PRODUCTION_PEAK

    @model_validator(mode="after")
    def _load_matches_type(self) -> CurveLoadSpec:
        errors: list[tuple[str, Any, str]] = []
        if self.concurrency is not None and self.requests_per_minute is not None:
            errors.append(("requestsPerMinute", self.requests_per_minute,
                           f"set concurrency or requestsPerMinute, not both (concurrency is {self.concurrency})"))
        elif self.concurrency is not None and self.type not in (None, CurveLoadType.CONCURRENCY):
            errors.append(("concurrency", self.concurrency, f"is for type Concurrency (type is {self.kind.value})"))
        elif self.requests_per_minute is not None and self.type not in (None, CurveLoadType.REQUESTS_PER_MINUTE):
            errors.append(("requestsPerMinute", self.requests_per_minute,
                           f"is for type RequestsPerMinute (type is {self.kind.value})"))
        if self.type is CurveLoadType.REQUESTS_PER_MINUTE and self.requests_per_minute is None:
            errors.append(("requestsPerMinute", None, "is required with type RequestsPerMinute"))
        _cross_field(errors)
        return self


class ReportSpec(_Spec):
    """What the report shows beyond what the search measures."""

    curve_load: CurveLoadSpec = Field(default_factory=CurveLoadSpec)
    """The one offered load the GPU-utilization, throughput and latency curves are measured at."""


class SecretKeyRef(_Spec):
    """A key in a Secret in the BatchTuning's namespace."""

    name: Annotated[Str, Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)]
    """Name of the Secret."""
    key: ObjectKey = "token"
    """Key in the Secret whose value is the bearer token."""


class MetricNames(_Spec):
    """Metric-name overrides; unset fields use vLLM's and dcgm-exporter's current names (with fallbacks)."""

    e2e_request_latency: MetricName | None = None
    """Histogram of end-to-end latency (default vllm:e2e_request_latency_seconds)."""
    time_to_first_token: MetricName | None = None
    """Histogram of time to first token (default vllm:time_to_first_token_seconds)."""
    inter_token_latency: MetricName | None = None
    """Histogram of inter-token latency (default vllm:inter_token_latency_seconds)."""
    request_queue_time: MetricName | None = None
    """Histogram of queueing time (default vllm:request_queue_time_seconds)."""
    generation_tokens: MetricName | None = None
    """Counter of output tokens (default vllm:generation_tokens_total)."""
    prompt_tokens: MetricName | None = None
    """Counter of prompt tokens (default vllm:prompt_tokens_total)."""
    request_success: MetricName | None = None
    """Counter of finished requests (default vllm:request_success_total)."""
    num_preemptions: MetricName | None = None
    """Counter of preemptions (default vllm:num_preemptions_total)."""
    num_requests_running: MetricName | None = None
    """Gauge of running requests (default vllm:num_requests_running)."""
    num_requests_waiting: MetricName | None = None
    """Gauge of waiting requests (default vllm:num_requests_waiting)."""
    kv_cache_usage: MetricName | None = None
    """Gauge of KV-cache usage, 0..1 (default vllm:kv_cache_usage_perc, older vLLM: vllm:gpu_cache_usage_perc)."""
    cache_config_info: MetricName | None = None
    """Info metric with the KV-cache configuration (default vllm:cache_config_info)."""
    request_prompt_tokens: MetricName | None = None
    """Histogram of prompt tokens per request (default vllm:request_prompt_tokens)."""
    request_generation_tokens: MetricName | None = None
    """Histogram of generated tokens per request (default vllm:request_generation_tokens)."""
    prefix_cache_queries: MetricName | None = None
    """Counter of prompt tokens looked up in the prefix cache (default vllm:prefix_cache_queries_total)."""
    prefix_cache_hits: MetricName | None = None
    """Counter of prompt tokens found in the prefix cache (default vllm:prefix_cache_hits_total)."""
    gpu_util: MetricName | None = None
    """GPU utilization in percent (default DCGM_FI_DEV_GPU_UTIL)."""
    sm_active: MetricName | None = None
    """SM activity ratio (default DCGM_FI_PROF_SM_ACTIVE)."""
    sm_occupancy: MetricName | None = None
    """SM occupancy ratio (default DCGM_FI_PROF_SM_OCCUPANCY)."""
    tensor_active: MetricName | None = None
    """Tensor-pipe activity ratio (default DCGM_FI_PROF_PIPE_TENSOR_ACTIVE)."""
    dram_active: MetricName | None = None
    """Memory-bandwidth activity ratio (default DCGM_FI_PROF_DRAM_ACTIVE)."""
    fb_used: MetricName | None = None
    """Framebuffer used in MiB (default DCGM_FI_DEV_FB_USED)."""
    fb_free: MetricName | None = None
    """Framebuffer free in MiB (default DCGM_FI_DEV_FB_FREE)."""
    power_usage: MetricName | None = None
    """Power draw in watts (default DCGM_FI_DEV_POWER_USAGE)."""

    def overrides(self) -> dict[str, str]:
        """The set overrides keyed by snake_case role (e.g. "kv_cache_usage")."""
        return {name: value for name, value in self if value is not None}

    def core(self, engine: MetricConventions) -> CoreMetricNames:
        """The engine's and the GPU exporter's names with these overrides."""
        return CoreMetricNames.build(engine, self.overrides())


class VllmLabels(_Spec):
    """Label names on vLLM's metrics."""

    pod: LabelName = "pod"
    """Label holding the pod name (Prometheus relabelling)."""
    namespace: LabelName = "namespace"
    """Label holding the namespace."""
    model: LabelName = "model_name"
    """Label holding the served model name."""

    def core(self) -> CoreLabelNames:
        return CoreLabelNames(self.pod, self.namespace, self.model)


class GpuLabels(_Spec):
    """Label names on dcgm-exporter's metrics (they differ with and without Kubernetes pod mapping)."""

    pod: LabelName = "pod"
    """Label holding the pod that uses the GPU."""
    namespace: LabelName = "namespace"
    """Label holding that pod's namespace."""

    def core(self) -> CoreLabelNames:
        return CoreLabelNames(self.pod, self.namespace, None)


class PrometheusSpec(_Spec):
    """Where trial and production metrics are read."""

    url: Annotated[Str, Field(min_length=1, max_length=2048), AfterValidator(_http_url)]
    """Base URL of the Prometheus HTTP API, http:// or https://."""
    auth_secret_ref: SecretKeyRef | None = None
    """Secret key holding a bearer token; unset: no authentication."""
    metric_names: MetricNames = Field(default_factory=MetricNames)
    """Metric-name overrides (vLLM renamed metrics across versions)."""
    labels: VllmLabels = Field(default_factory=VllmLabels)
    """Label names on vLLM's metrics."""
    gpu_labels: GpuLabels = Field(default_factory=GpuLabels)
    """Label names on dcgm-exporter's metrics."""


GIT_PATH = r"^[A-Za-z0-9_-][A-Za-z0-9_.-]*(/[A-Za-z0-9_-][A-Za-z0-9_.-]*)*$"
VALUES_KEY = r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$"


class ForgeSpec(_Spec):
    """The forge API that opens pull requests for the branches batchtune pushes."""

    type: ForgeType
    """GitHub, Gitea (also Forgejo) or GitLab."""
    api_url: Annotated[Str, Field(min_length=1, max_length=2048), AfterValidator(_http_url)] | None = None
    """Base URL of the forge's REST API; unset: derived from git.url (api.github.com or <host>/api/v3, <host>/api/v1,
    <host>/api/v4). Must be under a Git URL the install allows."""


class GitSpec(_Spec):
    """The Git repository PullRequest mode writes the recommendation into."""

    url: Annotated[Str, Field(min_length=1, max_length=2048), AfterValidator(_http_url)]
    """The repository's smart-HTTP URL (https://host/owner/repo.git); must be under a Git URL the install allows."""
    branch: Annotated[Str, Field(min_length=1, max_length=200, pattern=GIT_PATH)] = "main"
    """The base branch: what production is deployed from, and what pull requests target."""
    path: Annotated[Str, Field(min_length=1, max_length=1024, pattern=GIT_PATH)]
    """In the repository: the kustomization's directory (Kustomize), the values file (HelmValues) or the manifest
    file (Manifest)."""
    layout: GitLayout
    """Kustomize, HelmValues or Manifest."""
    values_key: Annotated[Str, Field(min_length=1, max_length=256, pattern=VALUES_KEY)] | None = None
    """HelmValues: the dotted key of the list holding the engine's flags (e.g. vllm.args)."""
    credentials_secret_ref: SecretKeyRef | None = None
    """Secret key holding the token (HTTP password for Git, and the forge API's token); the Secret must carry
    the label batchtune.io/git-credentials: "true" in a namespace the install lets batchtune read Secrets in."""
    username: Annotated[Str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._@-]+$")] = "batchtune"
    """HTTP user name sent with the token (GitHub: any; GitLab: oauth2 or the token's user)."""
    branch_prefix: Annotated[Str, Field(min_length=1, max_length=100, pattern=GIT_PATH)] = "batchtune"
    """Branches are <branchPrefix>/<namespace>/<name>/g<generation>-r<round>."""
    forge: ForgeSpec | None = None
    """Open a pull request through this forge's API; unset: push the branch only."""

    @model_validator(mode="after")
    def _values_key_for_helm(self) -> GitSpec:
        errors: list[tuple[str, Any, str]] = []
        if self.layout is GitLayout.HELM_VALUES and not self.values_key:
            errors.append(("valuesKey", None, "layout HelmValues needs valuesKey"))
        _cross_field(errors)
        return self


class ApplySpec(_Spec):
    """What happens to production once the best setting is known."""

    mode: ApplyMode | None = None
    """Auto, Recommend or PullRequest; unset: PullRequest when git is set, else Recommend (changing production is an
    explicit choice). An Auto on a managed target runs only when autoUnderManagers lists the manager."""
    git: GitSpec | None = None
    """The Git repository PullRequest mode writes to."""
    auto_under_managers: Annotated[list[Manager], AfterValidator(_no_duplicates), Field(max_length=3)] | None = None
    """Managers (ArgoCD, Flux, Helm) set up to leave batchtune's fields alone (docs/gitops.md): Auto patches a
    Deployment they manage; otherwise Auto becomes PullRequest (git set) or Recommend, with a condition naming them."""
    verify_seconds: Annotated[Int, Field(ge=10, le=86_400)] = 300
    """How long production is watched after a change, at least, before it counts as verified."""
    verify_min_requests: Annotated[Int, Field(ge=1, le=10_000_000)] = 50
    """Production requests the verify window must hold before it judges; a quieter production is waited for."""
    verify_timeout_seconds: Annotated[Int, Field(ge=60, le=604_800)] = 3600
    """How long after the rollout verify waits for verifyMinRequests; then onInconclusiveVerify decides."""
    on_inconclusive_verify: InconclusivePolicy = InconclusivePolicy.KEEP
    """Keep (the setting met the SLO in its trials) or RollBack, when production stayed too quiet to judge."""
    cooldown_seconds: Annotated[Int, Field(ge=0, le=2_592_000)] = 3600
    """Least time between two changes to production."""
    max_regression_percent: Annotated[Int, Field(ge=0, le=100)] = 10
    """Latency rise, error-rate rise or drop in the served share of offered requests tolerated during verification, in percent."""
    allow_numerics_change: Bool = False
    """Let Auto apply extra args that change what production outputs (e.g. --kv-cache-dtype); false: such a tuning
    ends Recommended (or opens a pull request) instead of patching production."""

    @model_validator(mode="after")
    def _timeout_covers_window(self) -> ApplySpec:
        errors: list[tuple[str, Any, str]] = []
        if self.verify_timeout_seconds < self.verify_seconds:
            errors.append(("verifyTimeoutSeconds", self.verify_timeout_seconds,
                           f"must be at least verifySeconds ({self.verify_seconds})"))
        if self.mode is ApplyMode.PULL_REQUEST and self.git is None:
            errors.append(("git", None, "mode PullRequest needs git (the repository to write to)"))
        _cross_field(errors)
        return self


class DriftSpec(_Spec):
    """How far production's traffic may move from what the last decision was made for before a new round."""

    length_shift_percent: Annotated[Int, Field(ge=1, le=100)] | None = None
    """A new round when the prompt- or output-length distribution moved this far from the decision's profile:
    the largest gap between the two cumulative shares (Kolmogorov-Smirnov distance), in percent."""
    peak_rate_change_percent: Annotated[Int, Field(ge=1, le=10_000)] | None = None
    """A new round when production's peak request rate changed by this much, up or down, in percent."""

    @model_validator(mode="after")
    def _some_threshold(self) -> DriftSpec:
        errors: list[tuple[str, Any, str]] = []
        if self.length_shift_percent is None and self.peak_rate_change_percent is None:
            errors.append(("", None, "set lengthShiftPercent, peakRateChangePercent or both"))
        _cross_field(errors)
        return self


class RetuneSpec(_Spec):
    """Continuous tuning: after a decision, keep watching production and tune again when it changes."""

    interval_seconds: Annotated[Int, Field(ge=600, le=31_536_000)] | None = None
    """A new round this long after the last one ended (a schedule), whatever the traffic."""
    drift: DriftSpec | None = None
    """A new round when production's workload drifts from the profile the last decision was made for
    (needs load.fromProduction)."""
    check_interval_seconds: Annotated[Int, Field(ge=60, le=86_400)] = 300
    """How often production's workload is measured while watching (one profile's Prometheus queries)."""
    min_improvement_percent: Annotated[Int, Field(ge=0, le=1000)] = 5
    """A later round changes production (Auto) or recommends a setting only when it beats production's current
    setting, measured in the same round as its trial 0, by this much on the objective."""

    @model_validator(mode="after")
    def _some_trigger(self) -> RetuneSpec:
        errors: list[tuple[str, Any, str]] = []
        if self.interval_seconds is None and self.drift is None:
            errors.append(("", None, "set intervalSeconds, drift or both"))
        _cross_field(errors)
        return self

    def core(self) -> RetunePolicy:
        drift = self.drift
        thresholds = None if drift is None else DriftThresholds(drift.length_shift_percent,
                                                               drift.peak_rate_change_percent)
        return RetunePolicy(self.interval_seconds, thresholds, self.check_interval_seconds,
                            self.min_improvement_percent)


class BatchTuningSpec(_Spec):
    """The desired tuning of one vLLM Deployment."""

    target_ref: TargetRef
    """The production Deployment to tune."""
    search_space: SearchSpec
    """The settings trials explore."""
    strategy: StrategySpec = Field(default_factory=StrategySpec)
    """How trials are chosen."""
    objective: ObjectiveSpec = Field(default_factory=ObjectiveSpec)
    """What is maximised among trials that meet every SLO."""
    slo: SloSpec
    """Latency and error targets."""
    load: LoadSpec = Field(default_factory=LoadSpec)
    """The load driven at each trial."""
    trial: TrialSpec = Field(default_factory=TrialSpec)
    """Timing of one trial."""
    report: ReportSpec = Field(default_factory=ReportSpec)
    """What the report shows beyond what the search measures (the curves' common load)."""
    prometheus: PrometheusSpec
    """Where metrics are read."""
    apply: ApplySpec = Field(default_factory=ApplySpec)
    """What happens to production."""
    retune: RetuneSpec | None = None
    """Continuous tuning after the first decision; unset: the tuning ends at its decision."""

    @model_validator(mode="after")
    def _drift_needs_a_profile(self) -> BatchTuningSpec:
        errors: list[tuple[str, Any, str]] = []
        if self.retune is not None and self.retune.drift is not None and not self.load.from_production:
            errors.append(("retune.drift", None, "drift is measured against production's profile: set "
                                                 "load.fromProduction"))
        _cross_field(errors)
        return self

    def core(self) -> tuning.TuningSpec:
        """The spec in core types: what the operator's phases and the bench read."""
        return tuning.TuningSpec(Objective(self.objective.type), self.slo.core(), self.search_space.core(),
                                 self.load.core(), self.trial.core(), self.strategy.core(),
                                 tuple(self.search_space.extra_args or ()),
                                 self.retune.core() if self.retune is not None else None)


# ---------------------------------------------------------------------------------------------
# Status


class Condition(_Status):
    """A Kubernetes condition (metav1.Condition)."""

    type: Annotated[str, Field(min_length=1, max_length=316)]
    """Progressing, Succeeded, Failed or Degraded."""
    status: ConditionStatus
    """True, False or Unknown."""
    reason: Annotated[str, Field(min_length=1, max_length=1024)]
    """Why, in UpperCamelCase."""
    message: Paragraph = ""
    """Human-readable detail."""
    last_transition_time: Timestamp
    """When status last changed."""
    observed_generation: Annotated[int, Field(ge=0)] | None = None
    """The spec generation this condition was computed from."""


class Setting(_Status):
    """One point of the search space. Frozen, so hashable: usable as a dict key."""

    model_config = ConfigDict(frozen=True)

    max_num_seqs: Annotated[int, Field(ge=1)]
    """--max-num-seqs (unbounded above: a retune round's trial 0 holds production's own, whatever it is)."""
    gpu_memory_utilization_percent: Annotated[int, Field(ge=1, le=100)]
    """--gpu-memory-utilization in percent."""
    max_num_batched_tokens: Annotated[int, Field(ge=1)] | None = None
    """--max-num-batched-tokens; unset: the engine's or production's value."""

    def core(self) -> CoreSetting:
        """The core's value type for the same setting."""
        return CoreSetting(self.max_num_seqs, self.gpu_memory_utilization_percent, self.max_num_batched_tokens)

    @classmethod
    def of(cls, setting: CoreSetting) -> Setting:
        return cls(max_num_seqs=setting.max_num_seqs,
                   gpu_memory_utilization_percent=setting.gpu_memory_utilization_percent,
                   max_num_batched_tokens=setting.max_num_batched_tokens)

    def summary(self) -> str:
        """Short form for printer columns and logs: "seqs=64 gmu=90%" (+ " mbt=8192")."""
        return self.core().label()


BEYOND_LAST_BUCKET_MS = 1e12
"""How status holds a latency of +inf (a quantile beyond the histogram's last bucket): still a violation."""


def _finite_metrics(value: Any) -> Any:
    # JSON cannot carry NaN or inf: unknown (NaN) reads as absent, never as a number that passes; an
    # infinite latency stays a latency no SLO meets.
    if not isinstance(value, dict):
        return value
    out = {}
    for k, v in value.items():
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            continue
        if isinstance(v, int) and abs(v) > 1e308:  # float() would overflow: as big as a float gets, infinity
            v = math.inf if v > 0 else -math.inf
        if math.isnan(v):
            continue
        if math.isinf(v):
            if v > 0 and str(k).endswith("Ms"):
                out[k] = BEYOND_LAST_BUCKET_MS
            continue
        out[k] = float(v)
    return out


def _figures_schema(keys: Sequence[str], what: str) -> dict[str, Any]:
    # Fixed properties, no open map: the API server prunes any other key, and the object's largest size is known.
    return {"type": "object", "additionalProperties": False,
            "properties": {k: {"type": "number", "description": f"{what} {k}."} for k in keys}}


def _known(keys: Sequence[str]) -> Callable[[Any], Any]:
    """Only the known keys (what the CRD keeps; the API server would prune the rest)."""
    wanted = frozenset(keys)

    def known(value: Any) -> Any:
        return {k: v for k, v in value.items() if k in wanted} if isinstance(value, dict) else value
    return known


METRIC_KEYS = tuple(str(m.value) for m in M)
Metrics = Annotated[dict[str, float], BeforeValidator(_known(METRIC_KEYS)), BeforeValidator(_finite_metrics),
                    WithJsonSchema(_figures_schema(METRIC_KEYS, "The figure"))]
"""Status metric keys (`batchtune.core.vocabulary.M`: ttftMs, outputThroughput, ...) -> finite numbers; any other
key is dropped. Production's figures (applied.before/after); the records status keeps many of hold fewer keys, each
what its writer can write (issue 22: a figure costs 41 bytes on average at its widest, in every step, run and prediction)."""
STEP_METRIC_KEYS = tuple(str(m.value) for m in STEP_METRICS)
StepMetrics = Annotated[dict[str, float], BeforeValidator(_known(STEP_METRIC_KEYS)), BeforeValidator(_finite_metrics),
                        WithJsonSchema(_figures_schema(STEP_METRIC_KEYS, "The figure"))]
"""A load run's figures, and a step's (the worst case over its runs): `vocabulary.STEP_METRICS`, no trial conclusion
(SLO capacity, peaks: drawn from all steps) and no production-only count."""
TRIAL_METRIC_KEYS = tuple(str(m.value) for m in TRIAL_METRICS)
TrialMetrics = Annotated[dict[str, float], BeforeValidator(_known(TRIAL_METRIC_KEYS)),
                         BeforeValidator(_finite_metrics), WithJsonSchema(_figures_schema(TRIAL_METRIC_KEYS, "The figure"))]
"""A trial's figures: its deciding step's and its conclusions (`vocabulary.TRIAL_METRICS`)."""
PREDICTED_METRIC_KEYS = tuple(str(m.value) for m in PREDICTED_METRICS)
PredictedMetrics = Annotated[dict[str, float], BeforeValidator(_known(PREDICTED_METRIC_KEYS)),
                             BeforeValidator(_finite_metrics),
                             WithJsonSchema(_figures_schema(PREDICTED_METRIC_KEYS, "The predicted figure"))]
"""A prediction's figures (`vocabulary.PREDICTED_METRICS`): what a twin predicts (latencies, throughputs, the running
batch) and what the report holds a prediction against."""
TWIN_PARAMETER_KEYS = (
    "bwScale", "flopsScale", "stepOverheadS", "seqOverheadS", "layerFloorS", "memoryOffsetGib", "activationScale",
    "runtimeFragmentFraction", "runtimeFixedGib", "frontendPerRequestS", "frontendPerPromptTokenS", "responsePathS",
    "prefillTokenOverheadS", "kvReadEfficiency", "maxPrefillsPerStep", "kvPoolTokens",
    "genericFixedS", "genericPerSeqS", "genericPerTokenS", "genericPerKvTokenS")
"""`twin.params.TwinParams`' fields as `controller.records.twin_record` names them (tests/unit/test_api_object_size.py
holds the two together)."""
TwinParameters = Annotated[dict[str, float], BeforeValidator(_known(TWIN_PARAMETER_KEYS)),
                           BeforeValidator(_finite_metrics), WithJsonSchema(_figures_schema(TWIN_PARAMETER_KEYS,
                                                                                            "Fitted parameter"))]
DRIFT_KEYS = ("promptShiftPercent", "outputShiftPercent", "peakChangePercent")
"""`core.workload.Drift.to_metrics`'s keys."""
DriftFigures = Annotated[dict[str, float], BeforeValidator(_known(DRIFT_KEYS)), BeforeValidator(_finite_metrics),
                         WithJsonSchema(_figures_schema(DRIFT_KEYS, "Drift:"))]


class RunRecord(_Status):
    """One load run of a step (a repeat)."""

    metrics: StepMetrics = Field(default_factory=dict)
    """What the run measured (latencies at the SLO percentile, in milliseconds)."""
    cross_check: Note | None = None
    """Where Prometheus and the load generator disagreed."""


class StepRecord(_Status):
    """One load level as status keeps it once closed (and a running trial's steps on the wire): its window and its
    judged result, without the bookkeeping of its runs."""

    load: Annotated[int, Field(ge=1)]
    """Closed-loop concurrency, or open-loop requests per minute."""
    measure_seconds: Annotated[int, Field(ge=1)] | None = None
    """This step's measurement window when it is not spec.trial.measureSeconds: a bracketing step's, or runs
    lengthened (too few requests)."""
    lengthened: Annotated[int, Field(ge=0)] = 0
    """How many of the attempts were lengthened runs rather than failed ones."""
    metrics: StepMetrics | None = None
    """The step's metrics (worst case over repeats)."""
    verdict: Verdict | None = None
    """Met, Violated or Unknown against the SLO at this load; unset while the step runs."""
    verdict_reason: Note | None = None
    """Why, target by target."""
    margin: float | None = None
    """Worst relative margin under the SLO limits (negative when exceeded; unset when not measured)."""
    cross_check: Note | None = None
    """Where Prometheus and the load generator's own numbers disagree."""
    purpose: StepPurpose | None = None
    """Curve: the extra step at the common curve load (status.plan.curveLoad), for the report only, never
    part of the trial's verdict; Bracket: a short step of the search; unset: a full-window step of the search."""


class RunBookkeeping(_Status):
    """The bookkeeping of a step while it is open: its runs so far and its Job (dropped once it closes)."""

    repeat: Annotated[int, Field(ge=0)] = 0
    """Repeat in progress, from 0."""
    attempt: Annotated[int, Field(ge=0)] = 0
    """Measurement attempt of the current repeat, from 0 (a run without data is run again)."""
    job: ChildName | None = None
    """Name of the current load-generator Job."""
    results: Annotated[list[RunRecord], Field(max_length=MAX_REPEATS)] = Field(default_factory=list)
    """Per-repeat measurements, kept until the step is closed."""
    unavailable_since: Timestamp | None = None
    """When Prometheus first failed to give this step's run (the trial fails past a deadline)."""


class OpenStepRecord(RunBookkeeping):
    """The one step a running trial is measuring: which, and its runs' bookkeeping."""

    step: Annotated[int, Field(ge=0, le=MAX_STEPS_IN_STATUS - 1)]
    """Index in the running trial's steps of the open step."""


class LoadStepRecord(StepRecord, RunBookkeeping):
    """One load level as a tick works on it: the kept record and, while it is open, its runs' bookkeeping (on the
    wire, the bookkeeping is the running trial's `open`, status.running[])."""


class RunningTrialRecord(_Status):
    """A running trial's load steps on the wire: every step its search needs while it runs (a finished trial keeps
    at most KEPT_STEPS of them in status.trials[].steps)."""

    index: Annotated[int, Field(ge=0, le=MAX_TRIAL_INDEX)]
    """The trial's index (status.trials[].index)."""
    steps: Annotated[list[StepRecord], Field(max_length=MAX_STEPS_IN_STATUS)] = Field(default_factory=list)
    """Its load steps so far, in order (the open one's verdict unset)."""
    open: OpenStepRecord | None = None
    """The open step's runs and Job; unset between steps."""


class TrialPrediction(_Status):
    """The twin's prediction for a trial, and how its first step (run at the predicted capacity) compared."""

    objective: Annotated[float, Field(ge=0)]
    """Predicted objective (the objective's unit; sloCapacity: requests per second)."""
    capacity_load: Annotated[int, Field(ge=1)] | None = None
    """Predicted capacity: the load the trial's search starts at (concurrent requests, or requests per minute)."""
    metrics: PredictedMetrics = Field(default_factory=dict)
    """Predicted figures at that load (status metric keys, latencies at the SLO percentile)."""
    simulated: bool = False
    """The event simulation confirmed it (else the fast path's estimate)."""
    agrees: bool | None = None
    """Whether the first step's figures fell within tolerance of the prediction; unset until measured."""
    comparison: Line | None = None
    """The figure furthest from its prediction, relative to its tolerance."""


def _kept_steps(steps: list[LoadStepRecord]) -> list[StepRecord]:
    return [StepRecord.model_validate(step.model_dump(exclude=set(RunBookkeeping.model_fields))) for step in steps]


KeptSteps = Annotated[list[StepRecord], Field(max_length=KEPT_STEPS)]
"""On the wire a trial's own steps are a finished trial's kept ones (`trial_loop.KEPT_STEPS`, without the runs'
bookkeeping): the CRD says so, so the largest status is bounded by the finished trials' few steps and the running
trials' many (status.running, at most spec.strategy.maxParallelTrials of them)."""


class TrialRecord(_Status):
    """One trial: a setting, its progress and what it measured."""

    index: Annotated[int, Field(ge=0, le=MAX_TRIAL_INDEX)]
    """Position in the order trials were started (never reused by the BatchTuning)."""
    name: Annotated[ChildName, Field(min_length=1)]
    """Name of the trial Deployment (<bt>-trial-<index>)."""
    setting: Setting
    """The setting tried."""
    state: TrialState = TrialState.PENDING
    """Pending, Deploying, Warming, Measuring, Done, Infeasible or Failed."""
    reason: ReasonCode | None = None
    """Why the trial is in its state (e.g. OOMKilled, KvCacheTooSmall, Measured; docs/troubleshooting.md)."""
    message: Line | None = None
    """Human-readable detail."""
    gpus: Annotated[int, Field(ge=0)] = 0
    """GPUs the trial pod holds."""
    started_at: Timestamp | None = None
    """When the trial was decided (its Deployment is created right after)."""
    finished_at: Timestamp | None = None
    """When the trial reached Done, Infeasible or Failed."""
    metrics: TrialMetrics | None = None
    """What the trial measured."""
    verdict: Verdict | None = None
    """Met, Violated or Unknown against the SLO."""
    verdict_reason: Line | None = None
    """Which target was violated or which data was missing."""
    pod_ip: Word | None = Field(default=None, alias="podIP")
    """IP of the trial pod the load generator targets (Service routing is not assumed)."""
    port: Annotated[int, Field(ge=1, le=65535)] | None = None
    """Port the engine serves on in the trial pod."""
    ready_at: Timestamp | None = None
    """When the trial pod became ready."""
    steps: Annotated[list[LoadStepRecord], Field(max_length=MAX_STEPS_IN_STATUS),
                     PlainSerializer(_kept_steps, return_type=KeptSteps)] = Field(default_factory=list)
    """Load runs of this trial (one per load level of the SLO-capacity search, with repeats). On the wire: a finished
    trial's at most 4 closed ones (its curve point, its capacity step, its first or the one at the twin's prediction,
    where the SLO broke); a running trial's are in status.running (here: none)."""
    current: bool | None = None
    """Production's own command line, as it runs, measured as a retune round's trial 0 (the setting is read
    from it, the engine's defaults filled in)."""
    prediction: TrialPrediction | None = None
    """What the calibrated twin predicted for this trial when it was started (strategy TwinGuided)."""
    curve_step: Annotated[int, Field(ge=0)] | None = None
    """Index in steps of the step measured at the common curve load (the extra Curve step, or a search step
    that ran at that very load); unset: not measured there."""

    @property
    def finished(self) -> bool:
        return self.state.finished


class Baseline(_Status):
    """Production's settings when tuning started."""

    engine: Word | None = None
    """The engine production runs (vllm)."""
    container_name: Name | None = None
    """The engine's container in production's pod template."""
    max_num_seqs: Annotated[int, Field(ge=1)] | None = None
    """--max-num-seqs in production; unset: the engine's default."""
    gpu_memory_utilization_percent: Annotated[int, Field(ge=1, le=100)] | None = None
    """--gpu-memory-utilization in production, percent; unset: the engine's default."""
    max_num_batched_tokens: Annotated[int, Field(ge=1)] | None = None
    """--max-num-batched-tokens in production; unset: the engine's default."""
    args: CommandLine = Field(default_factory=list)
    """Production's engine arguments as found."""
    fingerprint: Word | None = None
    """Hash of what the trials clone from production's container (image, command, args, env, resources):
    a different one means production changed under the tuning, and the measurements no longer hold."""


class PrunedSetting(_Status):
    """A setting never tried, and why."""

    setting: Setting
    """The setting left out."""
    reason: ReasonCode
    """EngineInvariant (the engine would refuse it), DoesNotFitMemory (the twin's memory model) or Dominated."""
    message: Line = ""
    """Why, in words (the engine's own message where it has one)."""
    memory_reason: ReasonCode | None = None
    """For DoesNotFitMemory: what a start would have failed with (KvCacheTooSmall, GpuMemoryUtilizationTooHigh)."""


class Knee(_Status):
    """Where more batching stopped paying."""

    max_num_seqs: Annotated[int, Field(ge=1)]
    """--max-num-seqs at the knee."""
    reason: Line
    """How the knee was found (marginal gain per doubling against the threshold)."""


class EngineLimitsRecord(_Status):
    """Engine limits read from production's args."""

    max_model_len: Annotated[int, Field(ge=1)] | None = None
    """--max-model-len, when set."""
    chunked_prefill: bool | None = None
    """Whether chunked prefill is on."""
    max_num_batched_tokens: Annotated[int, Field(ge=1)] | None = None
    """Production's --max-num-batched-tokens, when set."""


class CurveLoadRecord(_Status):
    """The common offered load of the report's curves, fixed at planning so every trial runs the same."""

    concurrency: Annotated[int, Field(ge=1)] | None = None
    """Closed loop: requests in flight at once."""
    requests_per_minute: Annotated[int, Field(ge=1)] | None = None
    """Open loop: mean arrival rate per minute."""
    source: Line = ""
    """Where the load came from, in words (production's peak, the spec, a fallback and why)."""


class ScrapeIntervalRecord(_Status):
    """The Prometheus scrape interval the tuning's windows are held to (two scrapes per window at least)."""

    seconds: Annotated[float, Field(gt=0)]
    """The interval."""
    source: Annotated[str, Field(max_length=500)] = ""
    """Where it came from: the install's override, Prometheus' targets API (naming the job), its configuration,
    or an assumption (saying why)."""


class PlanRecord(_Status):
    """What planning found (re-planning from spec and this is deterministic)."""

    gpu_product: Name | None = None
    """The target's GPU (node label nvidia.com/gpu.product), when known; trials are pinned to it."""
    model: Line | None = None
    """The model production serves."""
    served_model: Line | None = None
    """The model name requests use (--served-model-name or the model)."""
    engine_limits: EngineLimitsRecord | None = None
    """Engine limits read from production's args."""
    candidates: Annotated[int, Field(ge=0)] | None = None
    """Candidate settings after pruning."""
    notes: Annotated[list[Line], Field(max_length=20)] = Field(default_factory=list)
    """Planning notes (e.g. why the memory prefilter was skipped)."""
    started_at: Timestamp | None = None
    """When planning finished and trials could start."""
    curve_load: CurveLoadRecord | None = None
    """The common load every trial is also measured at for the report's curves; unset: none (type Off)."""
    scrape_interval: ScrapeIntervalRecord | None = None
    """The scrape interval found at planning, used by every later tick; unset in status written before it was
    recorded (then the install's override, else 15 s)."""


class LengthBucket(_Status):
    """One bucket of a length histogram."""

    le: Annotated[float, Field(gt=0)] | None = None
    """Upper bound in tokens; unset: +Inf (above every finite bound)."""
    count: Annotated[float, Field(ge=0)] = 0
    """Requests whose length fell in this bucket (above the previous bound, at most this one) over the lookback."""


class LengthDistributionRecord(_Status):
    """A token-length distribution (from the engine's histogram)."""

    mean: float | None = None
    """Mean tokens per request."""
    p50: float | None = None
    """Median, interpolated inside its bucket."""
    p90: float | None = None
    """90th percentile."""
    p99: float | None = None
    """99th percentile."""
    buckets: Annotated[list[LengthBucket], Field(max_length=64)] = Field(default_factory=list)
    """The histogram the load generator samples from."""

    @classmethod
    def of(cls, dist: CoreLengthDistribution) -> LengthDistributionRecord:
        def q(value: float | None) -> float | None:
            return None if value is None else round(value, 1)
        return cls(mean=q(dist.mean if dist.mean is not None else dist.bucket_mean()), p50=q(dist.quantile(0.5)),
                   p90=q(dist.quantile(0.9)), p99=q(dist.quantile(0.99)),
                   buckets=[LengthBucket(le=None if math.isinf(b) else b, count=round(c, 3))
                            for b, c in dist.buckets[:64]])

    def core(self) -> CoreLengthDistribution:
        buckets = sorted((b.le if b.le is not None else math.inf, b.count) for b in self.buckets)
        return CoreLengthDistribution(tuple(buckets), self.mean)


class WorkloadRecord(_Status):
    """The workload the trials drive, and every recommendation names: production's measured profile or the spec's."""

    source: Word | None = None
    """production (measured), spec (spec.load's fixed lengths) or trace (spec.load.trace)."""
    summary: Annotated[str, Field(max_length=1000)] | None = None
    """The workload in one line."""
    measured_at: Timestamp | None = None
    """When production's profile was measured (the end of its lookback)."""
    lookback_seconds: Annotated[int, Field(ge=1)] | None = None
    """How far back production was measured."""
    requests: Annotated[int, Field(ge=0)] | None = None
    """Requests production served over the lookback."""
    replicas: Annotated[int, Field(ge=1)] | None = None
    """Production's pods when measured: the rates below are theirs together, and a trial (one pod) faces its share."""
    input_tokens: Annotated[int, Field(ge=1)] | None = None
    """Mean prompt tokens per request."""
    output_tokens: Annotated[int, Field(ge=1)] | None = None
    """Mean generated tokens per request."""
    requests_per_minute: Annotated[int, Field(ge=1)] | None = None
    """Production's mean request rate over the lookback, per minute."""
    requests_per_second: Annotated[float, Field(ge=0)] | None = None
    """Production's mean request rate over the lookback."""
    peak_requests_per_second: Annotated[float, Field(ge=0)] | None = None
    """Production's highest rate over one rate window in the lookback."""
    burstiness: Annotated[float, Field(gt=0)] | None = None
    """Gamma shape of inter-arrival times (1: Poisson, below 1: burstier), as `vllm bench serve --burstiness`;
    unset: not measured (the load is Poisson)."""
    rate_window_seconds: Annotated[int, Field(ge=1)] | None = None
    """Width of the windows the rate, peak and burstiness are counted over."""
    prefix_cache_hit_percent: Annotated[float, Field(ge=0, le=100)] | None = None
    """Share of prompt tokens served from the prefix cache, where the engine exposes it."""
    prompt_lengths: LengthDistributionRecord | None = None
    """Prompt tokens per request."""
    output_lengths: LengthDistributionRecord | None = None
    """Generated tokens per request."""
    notes: Annotated[list[Line], Field(max_length=10)] = Field(default_factory=list)
    """What the profile could not measure and what was assumed instead."""

    @classmethod
    def of(cls, profile: CoreWorkloadProfile, measured_at: datetime) -> WorkloadRecord:
        arrivals = profile.arrivals
        mean_rate = arrivals.mean_per_second if arrivals else None
        return cls(
            source="production", summary=profile.summary()[:1000], measured_at=measured_at,
            lookback_seconds=profile.lookback_seconds, requests=profile.requests, replicas=profile.replicas,
            input_tokens=max(1, round(profile.prompt_mean)), output_tokens=max(1, round(profile.output_mean)),
            requests_per_minute=max(1, round(mean_rate * 60)) if mean_rate else None,
            requests_per_second=round(mean_rate, 4) if mean_rate is not None else None,
            peak_requests_per_second=round(arrivals.peak_per_second, 4) if arrivals else None,
            burstiness=arrivals.burstiness if arrivals else None,
            rate_window_seconds=arrivals.window_seconds if arrivals else None,
            prefix_cache_hit_percent=profile.prefix_cache_hit_percent,
            prompt_lengths=LengthDistributionRecord.of(profile.prompt),
            output_lengths=LengthDistributionRecord.of(profile.output),
            notes=[n[:300] for n in profile.notes[:10]])

    def profile(self) -> CoreWorkloadProfile | None:
        """The core profile back (for drift and the load generator); None unless measured from production."""
        if self.source != "production" or self.prompt_lengths is None or self.output_lengths is None:
            return None
        arrivals = None
        if self.requests_per_second is not None and self.peak_requests_per_second is not None:
            arrivals = CoreArrivalProfile(self.requests_per_second, self.peak_requests_per_second, self.burstiness,
                                          self.rate_window_seconds or 60, 0)
        return CoreWorkloadProfile(self.lookback_seconds or 0, self.requests or 0, self.prompt_lengths.core(),
                                   self.output_lengths.core(), arrivals, self.prefix_cache_hit_percent,
                                   tuple(self.notes), self.replicas or 1)


class ContainerArgs(_Status):
    """A container's command and args."""

    command: CommandLine | None = None
    """The container's command."""
    args: CommandLine | None = None
    """The container's args."""

    @classmethod
    def of(cls, args: CoreContainerArgs) -> ContainerArgs:
        return cls.model_validate(args.to_wire())

    def core(self) -> CoreContainerArgs:
        return CoreContainerArgs.of(self.model_dump(exclude_none=True))


class Recommendation(_Status):
    """The chosen setting and ready-made ways to apply it."""

    setting: Setting
    """The chosen setting."""
    args: CommandLine = Field(default_factory=list)
    """The engine container's command line with the setting (and the trials' extra args) applied."""
    reason: Paragraph
    """Why this setting, in words."""
    json_patch: Patch | None = None
    """RFC 6902 JSON patch for the target Deployment."""
    kustomize_patch: Patch | None = None
    """Kustomize strategic-merge patch."""
    helm_values: Patch | None = None
    """Helm values snippet, where the chart's layout is known."""
    workload: Annotated[str, Field(max_length=1000)] | None = None
    """The workload this recommendation holds for (status.workload's summary): a setting is best only for one."""
    replicas_hint: Annotated[int, Field(ge=1)] | None = None
    """Replicas that serve production's observed peak request rate at this setting's SLO capacity."""
    replicas_basis: Annotated[str, Field(max_length=500)] | None = None
    """How the replicas hint was reached (peak over capacity, headroom counted once), or why there is none."""
    container_name: Name | None = None
    """The engine container the setting applies to."""
    container: ContainerArgs | None = None
    """The container's command and args with the setting applied (for display; apply recomputes them)."""


class AppliedRecord(_Status):
    """What was changed in production, and when (the Deployment's batchtune.io/applied annotation mirrors it)."""

    generation: Annotated[int, Field(ge=0)] | None = None
    """The BatchTuning generation that applied it."""
    target: Name | None = None
    """The Deployment changed (a later spec may point elsewhere)."""
    previous: ContainerArgs | None = None
    """The container's command and args before the change (restored on rollback)."""
    new: ContainerArgs | None = None
    """The container's command and args after the change."""
    before: Metrics | None = None
    """Production's figures over a window before the change."""
    after: Metrics | None = None
    """Production's figures over the verify window."""
    applied_at: Timestamp | None = None
    """When production was patched."""
    rollout_completed_at: Timestamp | None = None
    """When the patched Deployment finished rolling out (the verify window starts here)."""
    verified_at: Timestamp | None = None
    """When the verify window passed without regression (or was kept by policy)."""
    rolled_back_at: Timestamp | None = None
    """When the change was rolled back."""


class PullRequestRecord(_Status):
    """PullRequest mode: the branch (and pull request) that carries the decision into Git."""

    branch: Url
    """The decision's branch (<branchPrefix>/<namespace>/<name>/g<generation>-r<round>)."""
    repository: Url | None = None
    """The repository URL (spec.apply.git.url when it was written)."""
    base: Name | None = None
    """The base branch's commit the change was made on."""
    commit: Name | None = None
    """The commit pushed to the branch; unset: not pushed yet."""
    files: Annotated[list[Line], BeforeValidator(_first(16)), Field(max_length=16)] = Field(
        default_factory=list)
    """The files the commit changes."""
    number: Annotated[int, Field(ge=1)] | None = None
    """The pull (merge) request's number, where a forge is configured."""
    url: Url | None = None
    """The pull request's web page."""
    state: Word | None = None
    """Open, Merged or Closed, as the forge last said (unset without a forge)."""
    checked_at: Timestamp | None = None
    """When the forge was last asked about the pull request."""
    generation: Annotated[int, Field(ge=0)] | None = None
    """The BatchTuning generation that proposed it."""
    round: Annotated[int, Field(ge=1)] | None = None
    """The round that proposed it."""


class RoundRecord(_Status):
    """One round of tuning: why it started, what production ran, what won, how it ended."""

    round: Annotated[int, Field(ge=1)]
    """1 for the first tuning, then one more for each retune."""
    trigger: Word
    """Initial, Schedule (spec.retune.intervalSeconds) or Drift (spec.retune.drift)."""
    reason: Annotated[str, Field(max_length=1000)] | None = None
    """Why the round started, in words."""
    started_at: Timestamp | None = None
    """When the round started."""
    ended_at: Timestamp | None = None
    """When the round reached its decision (and production is watched again)."""
    workload: Annotated[str, Field(max_length=1000)] | None = None
    """The workload the round measured against."""
    current_trial: ChildName | None = None
    """The trial that measured production's own setting (trial 0 of a retune)."""
    current_setting: Line | None = None
    """Production's setting when the round started."""
    current_objective: float | None = None
    """Its objective; unset: it did not meet the SLO (or was not measured)."""
    best_trial: ChildName | None = None
    """The best other setting's trial."""
    best_setting: Line | None = None
    """The best other setting."""
    best_objective: float | None = None
    """Its objective."""
    improvement_percent: float | None = None
    """How much the best setting beat production's (unset: production's missed the SLO, or no best)."""
    outcome: ReasonCode | None = None
    """How the round ended: the decision's reason (Verified, RecommendationReady, KeptCurrent, AlreadyOptimal, ...)."""
    message: Annotated[str, Field(max_length=2000)] | None = None
    """The decision in words."""


class RetuneRecord(_Status):
    """The watch between rounds."""

    last_check_at: Timestamp | None = None
    """When production's workload was last measured against the round's profile."""
    next_check_at: Timestamp | None = None
    """When it is measured next (or the schedule is looked at)."""
    drift: DriftFigures | None = None
    """The last check's drift: promptShiftPercent, outputShiftPercent (KS distance), peakChangePercent."""
    message: Annotated[str, Field(max_length=1000)] | None = None
    """The last check in words (a drift below its thresholds, too little data, ...)."""
class TwinPredictionRecord(_Status):
    """One candidate as the calibrated twin ranks it."""

    setting: Setting
    """The candidate."""
    objective: Annotated[float, Field(ge=0)]
    """Predicted objective."""
    capacity_load: Annotated[int, Field(ge=1)] | None = None
    """Predicted capacity load (concurrent requests, or requests per minute)."""
    metrics: PredictedMetrics = Field(default_factory=dict)
    """Predicted figures at that load."""
    simulated: bool = False
    """The event simulation confirmed it (else the fast path's estimate)."""


class TwinRecord(_Status):
    """The calibrated twin behind strategy TwinGuided: its verdict, its fit and its ranking."""

    basis: Word
    """Fingerprint of the measured trials the twin was calibrated on (a new finished trial recalibrates it)."""
    available: bool = True
    """False: no twin for this deployment (engine, model or GPU unknown to it); the strategy measures."""
    verdict: Word | None = None
    """Trusted, Untrusted (residuals beyond tolerance), Nominal (nothing measured yet) or Unavailable."""
    reason: Paragraph | None = None
    """Why, in words (the largest residual against its tolerance)."""
    mode: Word | None = None
    """What the next trial is for: calibrate, confirm, or measure (the twin is not trusted: Adaptive decides)."""
    calibration_setting: Setting | None = None
    """The first trial's setting: the catalog twin's best candidate."""
    parameters: TwinParameters = Field(default_factory=dict)
    """Fitted deployment parameters that differ from the catalog's (bwScale, stepOverheadS, ...)."""
    observations: Annotated[int, Field(ge=0)] = 0
    """Load steps the calibration was fitted on."""
    worst_residual_percent: float | None = None
    """The calibration's largest residual (event simulation against measurement), percent."""
    ranked: Annotated[int, Field(ge=0)] = 0
    """Candidates the twin ranked (those that start, do not run out of memory and hold the SLO somewhere)."""
    predictions: Annotated[list[TwinPredictionRecord], Field(max_length=40)] = Field(default_factory=list)
    """The best candidates and the measured ones, best first (what the strategy is asked with)."""
    search_seconds: float | None = None
    """Wall time of the calibration and the search."""
    notes: Annotated[list[Line], Field(max_length=10)] = Field(default_factory=list)
    """Calibration notes (e.g. the memory outside the KV pool the measured pool implies)."""


class BatchTuningStatus(_Status):
    """What the operator observed and did."""

    observed_generation: Annotated[int, Field(ge=0)] | None = None
    """The spec generation the status reflects."""
    phase: Phase | None = None
    """Where the tuning is."""
    mode: ApplyMode | None = None
    """The apply mode in effect: spec.apply.mode as resolved against the target (an unset mode is Recommend, or
    PullRequest with spec.apply.git; a managed or owned target may turn Auto into Recommend)."""
    conditions: Annotated[list[Condition], Field(max_length=MAX_CONDITIONS)] = Field(default_factory=list)
    """Progressing, Succeeded, Failed, Degraded."""
    trials_planned: Annotated[int, Field(ge=0)] = 0
    """Trials the plan holds."""
    trials_completed: Annotated[int, Field(ge=0)] = 0
    """Trials finished (Done, Infeasible or Failed)."""
    next_trial_index: Annotated[int, Field(ge=0, le=MAX_TRIAL_INDEX)] = 0
    """The index the next trial gets: trial names are never reused, not even across generations."""
    gpu_minutes: Annotated[float, Field(ge=0)] = 0
    """GPU-minutes this BatchTuning's trials held, every generation, round and plan together (devices x time from
    decision to end), in whole minutes: the figure its GPU budget bounds."""
    gpu_minutes_carried: Annotated[float, Field(ge=0)] = 0
    """GPU-minutes of trials no longer in status (earlier generations, rounds and plans), carried into the total."""
    target_missing_since: Timestamp | None = None
    """When the target Deployment was first found missing (cleared once it is found); past
    spec.trial.readinessTimeoutSeconds the tuning fails and its trials are freed."""
    baseline: Baseline | None = None
    """Production's settings when tuning started."""
    pruned: Annotated[list[PrunedSetting], Field(max_length=MAX_PRUNED_IN_STATUS)] = Field(default_factory=list)
    """Settings never tried, and why."""
    trials: Annotated[list[TrialRecord], Field(max_length=MAX_TRIALS_IN_STATUS)] = Field(default_factory=list)
    """Every trial started, in order."""
    running: Annotated[list[RunningTrialRecord], Field(max_length=MAX_RUNNING_IN_STATUS)] = Field(default_factory=list)
    """The load steps of the running trials, one record each (on the wire only: reading status puts them back on
    their trials, and writing it takes them from there)."""
    best_trial: ChildName | None = None
    """Name of the best trial."""
    best_setting: Line | None = None
    """The best trial's setting, short form (for kubectl get)."""
    knee: Knee | None = None
    """Where more batching stopped paying."""
    recommendation: Recommendation | None = None
    """The chosen setting and ready patches."""
    plan: PlanRecord | None = None
    """What planning found (re-planning from spec and this is deterministic)."""
    workload: WorkloadRecord | None = None
    """The workload the trials drive and the recommendation holds for."""
    pull_request: PullRequestRecord | None = None
    """PullRequest mode: the branch and pull request of the latest decision (kept across generations, so a later
    decision can supersede it)."""
    applied: AppliedRecord | None = None
    """What was changed in production."""
    round: Annotated[int, Field(ge=1)] | None = None
    """The round in progress or last decided (spec.retune); unset: 1."""
    rounds: Annotated[list[RoundRecord], Field(max_length=10)] = Field(default_factory=list)
    """The last rounds, oldest first (spec.retune)."""
    retune: RetuneRecord | None = None
    """The watch for the next round (spec.retune)."""
    twin: TwinRecord | None = None
    """The calibrated twin guiding the search (strategy TwinGuided)."""

    @model_validator(mode="after")
    def _running_steps_onto_trials(self) -> BatchTuningStatus:
        """The wire's running records back onto their trials, as a tick works on them."""
        if not self.running:
            return self
        trials = {t.index: t for t in self.trials}
        errors: list[tuple[str, Any, str]] = []
        seen: set[int] = set()
        for i, entry in enumerate(self.running):
            trial = trials.get(entry.index)
            if trial is None or trial.finished or entry.index in seen:
                errors.append((f"running[{i}].index", entry.index,
                               "names no running trial in status.trials, or one an earlier record names"))
                continue
            seen.add(entry.index)
            if entry.open is not None and (entry.open.step >= len(entry.steps)
                                           or entry.steps[entry.open.step].verdict is not None):
                errors.append((f"running[{i}].open.step", entry.open.step,
                               f"names no open step (verdict unset) among the trial's {len(entry.steps)}"))
                continue
            bookkeeping = entry.open.model_dump(exclude={"step"}) if entry.open is not None else {}
            opened = entry.open.step if entry.open is not None else None
            trial.steps = [LoadStepRecord.model_validate({**step.model_dump(), **(bookkeeping if n == opened else {})})
                           for n, step in enumerate(entry.steps)]
        _cross_field(errors)
        self.running = []
        return self

    @model_serializer(mode="wrap")
    def _running_steps_apart(self, handler: SerializerFunctionWrapHandler,  # type: ignore[no-untyped-def]
                             info: SerializationInfo):
        """On the wire a running trial's steps are a record of their own (status.running) and a finished trial keeps
        its few closed ones: so the CRD bounds the many steps of the few running trials apart from the few of the
        many finished ones."""
        data: dict[str, Any] = handler(self)
        running = []
        options: dict[str, Any] = {"mode": info.mode, "by_alias": info.by_alias, "exclude_none": info.exclude_none}
        for trial, wire in zip(self.trials, data.get("trials") or [], strict=True):
            if trial.finished:
                continue
            steps = wire.pop("steps", [])
            if not steps:
                continue
            entry: dict[str, Any] = {"index": trial.index, "steps": steps}
            opened = next((i for i, step in enumerate(trial.steps) if step.verdict is None), None)
            if opened is not None:
                entry["open"] = OpenStepRecord.model_validate(
                    {"step": opened, **trial.steps[opened].model_dump(include=set(RunBookkeeping.model_fields))}
                ).model_dump(**options)
            running.append(entry)
        if running:
            data["running"] = running
        else:
            data.pop("running", None)
        return data

    def condition(self, type_: str) -> Condition | None:
        """The condition of that type, if set."""
        return next((c for c in self.conditions if c.type == type_), None)


def steps_on_the_wire(status: Mapping[str, Any], trial: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A trial's load steps in a status as the API server holds it (camelCase dicts): a running trial's are its
    record in status.running, the open one with its runs and Job; a finished trial's are on the trial."""
    entry = next((r for r in status.get("running") or [] if isinstance(r, Mapping) and r.get("index") ==
                  trial.get("index")), None)
    if entry is None:
        return [dict(s) for s in trial.get("steps") or []]
    steps = [dict(s) for s in entry.get("steps") or []]
    opened = entry.get("open") or {}
    if isinstance(opened.get("step"), int) and 0 <= opened["step"] < len(steps):
        steps[opened["step"]].update({k: v for k, v in opened.items() if k != "step"})
    return steps


# ---------------------------------------------------------------------------------------------
# The object


class ObjectMeta(_Status):
    """The metadata fields batchtune reads; the rest is ignored."""

    name: str | None = None
    generate_name: str | None = None
    namespace: str | None = None
    uid: str | None = None
    generation: int | None = None
    resource_version: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _named(self) -> ObjectMeta:
        errors: list[tuple[str, Any, str]] = []
        if not self.name and not self.generate_name:
            errors.append(("name", None, "required (set name or generateName)"))
        _cross_field(errors)
        return self


class BatchTuning(_Status):
    """A whole BatchTuning object."""

    api_version: Literal["batchtune.io/v1alpha1"]
    """batchtune.io/v1alpha1."""
    kind: Literal["BatchTuning"]
    """BatchTuning."""
    metadata: ObjectMeta
    """Object metadata."""
    spec: BatchTuningSpec
    """The desired tuning."""
    status: BatchTuningStatus = Field(default_factory=BatchTuningStatus)
    """What the operator observed and did."""
