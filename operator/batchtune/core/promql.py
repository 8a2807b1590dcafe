"""PromQL for trials, production and workload, with every label value escaped and every name checked.

Metric names are roles (`time_to_first_token`, `gpu_util`, ...) resolved by `MetricNames`: the engine's
names and dcgm-exporter's, less what `spec.prometheus.metricNames` overrides. A current name with an
older alias is queried as `current or legacy`, so one query works across engine versions (unless the
user overrode the name). Latency histograms are in seconds; the queries return milliseconds.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from batchtune.core.vocabulary import M

if TYPE_CHECKING:
    from batchtune.engines import MetricConventions

_METRIC_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")

GPU_METRICS: Mapping[str, str] = {
    "gpu_util": "DCGM_FI_DEV_GPU_UTIL",
    "sm_active": "DCGM_FI_PROF_SM_ACTIVE",
    "sm_occupancy": "DCGM_FI_PROF_SM_OCCUPANCY",
    "tensor_active": "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
    "dram_active": "DCGM_FI_PROF_DRAM_ACTIVE",
    "fb_used": "DCGM_FI_DEV_FB_USED",
    "fb_free": "DCGM_FI_DEV_FB_FREE",
    "power_usage": "DCGM_FI_DEV_POWER_USAGE",
}
"""dcgm-exporter's names (the GPU Operator's default counters; PROF_* need the profiling counters on)."""


def _snake(key: str) -> str:
    return re.sub(r"(?<!^)([A-Z])", r"_\1", key).lower()


@dataclass(frozen=True)
class MetricNames:
    """Role -> metric name, for the engine's metrics and the GPU exporter's."""

    names: Mapping[str, str]
    aliases: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    overridden: frozenset[str] = frozenset()
    """Roles the user set: their legacy aliases are not queried."""

    def __post_init__(self) -> None:
        for role, name in self.names.items():
            check_metric_name(name, role)

    @classmethod
    def build(cls, engine: MetricConventions, overrides: Mapping[str, str | None] | None = None) -> MetricNames:
        """The engine's and the GPU exporter's names, then overrides by role (snake_case or camelCase)."""
        names = {**engine.names, **GPU_METRICS}
        changes: dict[str, str] = {}
        for key, value in (overrides or {}).items():
            role = _snake(key)
            if role not in names:
                raise ValueError(f"prometheus.metricNames.{key}: unknown metric key (known: {', '.join(sorted(names))})")
            if value is not None:
                changes[role] = value
        return cls({**names, **changes}, dict(engine.aliases), frozenset(changes))

    def __getitem__(self, role: str) -> str:
        return self.names[role]

    def candidates(self, role: str) -> tuple[str, ...]:
        """The name to query, then legacy aliases unless overridden."""
        name = self.names[role]
        if role in self.overridden:
            return (name,)
        return (name,) + tuple(a for a in self.aliases.get(role, ()) if a != name)


@dataclass(frozen=True)
class LabelNames:
    """Where pod, namespace and model sit on a series (they differ with and without pod mapping)."""

    pod: str = "pod"
    namespace: str = "namespace"
    model: str | None = "model_name"

    def __post_init__(self) -> None:
        for name in (self.pod, self.namespace) + ((self.model,) if self.model else ()):
            check_label_name(name)


def check_metric_name(name: str, what: str = "metric") -> str:
    if not isinstance(name, str) or not _METRIC_NAME.match(name):
        raise ValueError(f"{what}: {name!r} is not a valid Prometheus metric name")
    return name


def check_label_name(name: str) -> str:
    if not isinstance(name, str) or not _LABEL_NAME.match(name):
        raise ValueError(f"label name {name!r} is not a valid Prometheus label name")
    return name


def escape_label_value(value: str) -> str:
    """Escape for a double-quoted PromQL string: backslash, double quote, newline, CR, tab."""
    return (
        str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")
    )


def escape_regex(value: str) -> str:
    """A literal for a PromQL (RE2) regex: every metacharacter escaped."""
    return re.sub(r"([\\.^$|?*+()\[\]{}])", r"\\\1", value)


@dataclass(frozen=True)
class Selector:
    """Label matchers, rendered `{a="x",b=~"y|z"}` with names checked and values escaped."""

    equal: Mapping[str, str] = field(default_factory=dict)
    regex: Mapping[str, str] = field(default_factory=dict)

    def with_equal(self, **labels: str) -> Selector:
        return Selector({**self.equal, **labels}, self.regex)

    def render(self) -> str:
        parts = [f'{check_label_name(k)}="{escape_label_value(v)}"' for k, v in self.equal.items()]
        parts += [f'{check_label_name(k)}=~"{escape_label_value(v)}"' for k, v in self.regex.items()]
        return "{" + ",".join(parts) + "}"


def pods_selector(labels: LabelNames, namespace: str, pods: list[str], model: str | None = None) -> Selector:
    """Series of these pods (regex-escaped, then PromQL-escaped); no pod matches nothing."""
    equal = {labels.namespace: namespace}
    if labels.model and model is not None:
        equal[labels.model] = model
    regex = "|".join(escape_regex(p) for p in sorted(pods)) or "^$"
    return Selector(equal, {labels.pod: regex})


def _window(seconds: int) -> str:
    if int(seconds) < 1:
        raise ValueError(f"window {seconds!r} s must be >= 1")
    return f"[{int(seconds)}s]"


FIGURE_LABEL = "batchtune_figure"
"""The label `union` puts on each query's series: the key the query was asked under."""
_FIGURE_KEY = re.compile(r"[A-Za-z][A-Za-z0-9_]*")


UNION_CHARS = 3000
"""The most characters one `union` query takes (a single longer query goes alone): URL-encoded in a GET it stays
under 4 KB, well within the 8 KB request line that proxies in front of Prometheus commonly allow."""


def unions(queries: Mapping[str, str], limit: int = UNION_CHARS) -> list[str]:
    """Several instant queries as few: each query's series get `batchtune_figure="<key>"` (`label_replace`), and the
    labelled vectors are joined by `or` up to `limit` characters a query; no two of them can share a label set, so
    `or` keeps every series of each, and each key reads back exactly what its query alone would give. A trial run's
    26 queries go in 3 requests instead of 26."""
    parts = []
    for key, query in queries.items():
        if not _FIGURE_KEY.fullmatch(key):
            raise ValueError(f"query key {key!r} cannot be a label value here (letters, digits and _ only)")
        parts.append(f'label_replace({query}, "{FIGURE_LABEL}", "{key}", "", "")')
    out: list[str] = []
    for part in parts:
        if out and len(out[-1]) + len(" or ") + len(part) <= limit:
            out[-1] += " or " + part
        else:
            out.append(part)
    return out


def _or(queries: list[str]) -> str:
    return queries[0] if len(queries) == 1 else " or ".join(f"({q})" for q in queries)


def _prefix(scale: float) -> str:
    return f"{scale:g} * " if scale != 1 else ""


def histogram_quantile(metrics: tuple[str, ...], quantile: float, sel: Selector, window_s: int, scale: float = 1.0) -> str:
    if not 0 < quantile < 1:
        raise ValueError(f"quantile {quantile!r} is outside (0, 1)")
    s, w = sel.render(), _window(window_s)
    return _or([f"{_prefix(scale)}histogram_quantile({quantile:g}, sum by (le) (rate({check_metric_name(m)}_bucket{s}{w})))"
                for m in metrics])


def histogram_mean(metrics: tuple[str, ...], sel: Selector, window_s: int, scale: float = 1.0) -> str:
    s, w = sel.render(), _window(window_s)
    return _or([f"{_prefix(scale)}sum(rate({check_metric_name(m)}_sum{s}{w})) / sum(rate({m}_count{s}{w}))"
                for m in metrics])


def histogram_buckets(metrics: tuple[str, ...], sel: Selector, window_s: int) -> str:
    """Per-bucket increase over the window (`le` kept): a length distribution."""
    s, w = sel.render(), _window(window_s)
    return _or([f"sum by (le) (increase({check_metric_name(m)}_bucket{s}{w}))" for m in metrics])


def histogram_increase_mean(metrics: tuple[str, ...], sel: Selector, window_s: int) -> str:
    """The exact mean over the window: increase of `_sum` over increase of `_count`."""
    s, w = sel.render(), _window(window_s)
    return _or([f"sum(increase({check_metric_name(m)}_sum{s}{w})) / sum(increase({m}_count{s}{w}))"
                for m in metrics])


def counter_rate(metrics: tuple[str, ...], sel: Selector, window_s: int) -> str:
    s, w = sel.render(), _window(window_s)
    return _or([f"sum(rate({check_metric_name(m)}{s}{w}))" for m in metrics])


def counter_increase(metrics: tuple[str, ...], sel: Selector, window_s: int) -> str:
    s, w = sel.render(), _window(window_s)
    return _or([f"sum(increase({check_metric_name(m)}{s}{w}))" for m in metrics])


def gauge_avg(metrics: tuple[str, ...], sel: Selector, window_s: int, scale: float = 1.0, across: str = "avg") -> str:
    """The time average per series, then `across` series (avg for a ratio, sum for a total such as watts)."""
    s, w = sel.render(), _window(window_s)
    return _or([f"{_prefix(scale)}{across}(avg_over_time({check_metric_name(m)}{s}{w}))" for m in metrics])


def gauge_max(metrics: tuple[str, ...], sel: Selector, window_s: int, scale: float = 1.0) -> str:
    s, w = sel.render(), _window(window_s)
    return _or([f"{_prefix(scale)}max(max_over_time({check_metric_name(m)}{s}{w}))" for m in metrics])


def queue_growth(names: MetricNames, sel: Selector, window_s: int) -> str:
    """Waiting requests over the window's last fifth less over its first fifth (evaluated at the end)."""
    fifth = max(1, window_s // 5)

    def at(offset: str) -> str:
        return _or([f"sum(avg_over_time({check_metric_name(m)}{sel.render()}[{fifth}s]{offset}))"
                    for m in names.candidates("num_requests_waiting")])
    return f"({at('')}) - ({at(f' offset {window_s - fifth}s')})"


@dataclass(frozen=True)
class QueryContext:
    names: MetricNames
    labels: LabelNames
    gpu_labels: LabelNames
    percentile: int = 95

    @property
    def quantile(self) -> float:
        return self.percentile / 100


def trial_queries(ctx: QueryContext, namespace: str, pod: str, model: str | None, window_s: int) -> dict[str, str]:
    """Status metric key -> instant query, evaluated at the end of one load run's window.

    Engine series are selected by namespace, pod and model; GPU series by the GPU label names. SM
    active and KV usage come as 0..1 ratios and are returned in percent; power is summed over the
    pod's GPUs (a tensor-parallel pod draws on all of them).
    """
    names, q = ctx.names, ctx.quantile
    engine = Selector({ctx.labels.namespace: namespace, ctx.labels.pod: pod,
                       **({ctx.labels.model: model} if ctx.labels.model and model is not None else {})})
    gpu = Selector({ctx.gpu_labels.namespace: namespace, ctx.gpu_labels.pod: pod})
    c = names.candidates
    return {
        M.TTFT_MS: histogram_quantile(c("time_to_first_token"), q, engine, window_s, 1000),
        M.ITL_MS: histogram_quantile(c("inter_token_latency"), q, engine, window_s, 1000),
        M.E2E_MS: histogram_quantile(c("e2e_request_latency"), q, engine, window_s, 1000),
        M.QUEUE_MS: histogram_quantile(c("request_queue_time"), q, engine, window_s, 1000),
        M.TTFT_MEAN_MS: histogram_mean(c("time_to_first_token"), engine, window_s, 1000),
        M.ITL_MEAN_MS: histogram_mean(c("inter_token_latency"), engine, window_s, 1000),
        M.REQUEST_THROUGHPUT: counter_rate(c("request_success"), engine, window_s),
        M.OUTPUT_THROUGHPUT: counter_rate(c("generation_tokens"), engine, window_s),
        M.PROMPT_THROUGHPUT: counter_rate(c("prompt_tokens"), engine, window_s),
        M.PREEMPTIONS_PER_SECOND: counter_rate(c("num_preemptions"), engine, window_s),
        M.RUNNING_REQUESTS: gauge_avg(c("num_requests_running"), engine, window_s, across="sum"),
        M.WAITING_REQUESTS: gauge_avg(c("num_requests_waiting"), engine, window_s, across="sum"),
        M.WAITING_GROWTH: queue_growth(names, engine, window_s),
        M.KV_CACHE_USAGE_PERCENT: gauge_avg(c("kv_cache_usage"), engine, window_s, 100),
        M.KV_CACHE_USAGE_MAX_PERCENT: gauge_max(c("kv_cache_usage"), engine, window_s, 100),
        M.GPU_UTIL_PERCENT: gauge_avg(c("gpu_util"), gpu, window_s),
        M.SM_ACTIVE_PERCENT: gauge_avg(c("sm_active"), gpu, window_s, 100),
        M.SM_OCCUPANCY_PERCENT: gauge_avg(c("sm_occupancy"), gpu, window_s, 100),
        M.TENSOR_ACTIVE_PERCENT: gauge_avg(c("tensor_active"), gpu, window_s, 100),
        M.DRAM_ACTIVE_PERCENT: gauge_avg(c("dram_active"), gpu, window_s, 100),
        M.POWER_WATTS: gauge_avg(c("power_usage"), gpu, window_s, across="sum"),
        M.FB_USED_MIB: gauge_avg(c("fb_used"), gpu, window_s, across="sum"),
        M.FB_FREE_MIB: gauge_avg(c("fb_free"), gpu, window_s, across="sum"),
        M.GPUS: f"count(avg_over_time({check_metric_name(names['gpu_util'])}{gpu.render()}{_window(window_s)}))",
    }


def kv_pool_query(ctx: QueryContext, namespace: str, pod: str) -> str:
    """The engine's cache configuration info series (labels carry blocks and block size)."""
    sel = Selector({ctx.labels.namespace: namespace, ctx.labels.pod: pod})
    return f"max by (num_gpu_blocks, block_size) ({check_metric_name(ctx.names['cache_config_info'])}{sel.render()})"


def gpu_model_query(ctx: QueryContext, namespace: str, pods: list[str]) -> str:
    """The GPU models dcgm-exporter reports for these pods (its `modelName` label, what NVML names)."""
    sel = pods_selector(ctx.gpu_labels, namespace, pods)
    return f"count by (modelName) ({check_metric_name(ctx.names['gpu_util'])}{sel.render()})"


def production_queries(ctx: QueryContext, sel: Selector, window_s: int, finished_reason_label: str | None,
                       error_reasons: tuple[str, ...], http: HttpErrors | None = None) -> dict[str, str]:
    """Production's figures over a window (all its pods together), for verify."""
    names, q, c = ctx.names, ctx.quantile, ctx.names.candidates
    out = {
        M.TTFT_MS: histogram_quantile(c("time_to_first_token"), q, sel, window_s, 1000),
        M.ITL_MS: histogram_quantile(c("inter_token_latency"), q, sel, window_s, 1000),
        M.E2E_MS: histogram_quantile(c("e2e_request_latency"), q, sel, window_s, 1000),
        M.REQUEST_THROUGHPUT: counter_rate(c("request_success"), sel, window_s),
        M.OUTPUT_THROUGHPUT: counter_rate(c("generation_tokens"), sel, window_s),
        M.WAITING_REQUESTS: gauge_avg(c("num_requests_waiting"), sel, window_s, across="sum"),
        M.REQUESTS: counter_increase(c("request_success"), sel, window_s),
        "inSystemGrowth": _in_system_growth(names, sel, window_s),
    }
    if finished_reason_label and error_reasons:
        errors = Selector(sel.equal, {**sel.regex, check_label_name(finished_reason_label): "|".join(error_reasons)})
        out["failedThroughput"] = counter_rate(c("request_success"), errors, window_s)
    if http is not None:
        failed = Selector(sel.equal, {**sel.regex, check_label_name(http.status_label): "|".join(http.statuses),
                                      check_label_name(http.handler_label): "|".join(escape_regex(h) for h in http.handlers)})
        out["httpFailedThroughput"] = counter_rate((check_metric_name(http.metric),), failed, window_s)
    return out


@dataclass(frozen=True)
class HttpErrors:
    """Where the API server counts the requests it answered with an error (fast failures)."""

    metric: str
    status_label: str
    statuses: tuple[str, ...]
    handler_label: str
    handlers: tuple[str, ...]


def _in_system_growth(names: MetricNames, sel: Selector, window_s: int) -> str:
    """Requests running or waiting at the window's end less at its start."""
    parts = []
    for role in ("num_requests_running", "num_requests_waiting"):
        def at(offset: str, role: str = role) -> str:
            return _or([f"sum({check_metric_name(m)}{sel.render()}{offset})" for m in names.candidates(role)])
        parts.append(f"(({at('')}) - ({at(f' offset {window_s}s')}))")
    return " + ".join(parts)


RATE_WINDOW_SECONDS = 60
"""Width of the windows production's request counts are taken over (the burstiness estimate's unit)."""


def rate_window_seconds(scrape_interval_s: float) -> int:
    """Count windows wide enough for increase() to see four scrapes, at least a minute."""
    return max(RATE_WINDOW_SECONDS, int(4 * scrape_interval_s + 0.999))


def workload_queries(ctx: QueryContext, sel: Selector, lookback_s: int, window_s: int) -> dict[str, str]:
    """Production's workload over the lookback, all from the engine's configured names.

    promptBuckets/outputBuckets: per-`le` increases of the length histograms (vectors); promptMean/
    outputMean: exact means; requestCounts: finished requests per consecutive `window_s` window (a
    subquery, so a matrix); prefixHits/prefixQueries: prefix-cache tokens (absent where not exposed).
    """
    c = ctx.names.candidates
    if lookback_s < window_s:
        raise ValueError(f"lookback {lookback_s}s is shorter than the {window_s}s rate window")
    counts = counter_increase(c("request_success"), sel, window_s)
    out = {
        "promptBuckets": histogram_buckets(c("request_prompt_tokens"), sel, lookback_s),
        "outputBuckets": histogram_buckets(c("request_generation_tokens"), sel, lookback_s),
        "promptMean": histogram_increase_mean(c("request_prompt_tokens"), sel, lookback_s),
        "outputMean": histogram_increase_mean(c("request_generation_tokens"), sel, lookback_s),
        "requestCounts": f"({counts})[{int(lookback_s)}s:{int(window_s)}s]",
    }
    if "prefix_cache_hits" in ctx.names.names and "prefix_cache_queries" in ctx.names.names:
        out["prefixHits"] = counter_increase(c("prefix_cache_hits"), sel, lookback_s)
        out["prefixQueries"] = counter_increase(c("prefix_cache_queries"), sel, lookback_s)
    return out
