"""PromQL for a trial's window, with every label value escaped and every name checked.

Latency histograms are in seconds; the queries return milliseconds to match the status metrics.
A current vLLM metric name with an older alias is queried as `current or legacy`, so one query
works across vLLM versions (unless the user overrode the name).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields, replace
from typing import Any, Mapping

_METRIC_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


@dataclass(frozen=True)
class MetricNames:
    """vLLM V1 and dcgm-exporter names (see reference/vllm-gpu-facts.md)."""

    e2e_request_latency: str = "vllm:e2e_request_latency_seconds"
    time_to_first_token: str = "vllm:time_to_first_token_seconds"
    inter_token_latency: str = "vllm:inter_token_latency_seconds"
    request_queue_time: str = "vllm:request_queue_time_seconds"
    generation_tokens: str = "vllm:generation_tokens_total"
    prompt_tokens: str = "vllm:prompt_tokens_total"
    request_success: str = "vllm:request_success_total"
    num_preemptions: str = "vllm:num_preemptions_total"
    num_requests_running: str = "vllm:num_requests_running"
    num_requests_waiting: str = "vllm:num_requests_waiting"
    kv_cache_usage: str = "vllm:kv_cache_usage_perc"
    cache_config_info: str = "vllm:cache_config_info"
    gpu_util: str = "DCGM_FI_DEV_GPU_UTIL"
    sm_active: str = "DCGM_FI_PROF_SM_ACTIVE"
    sm_occupancy: str = "DCGM_FI_PROF_SM_OCCUPANCY"
    tensor_active: str = "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"
    dram_active: str = "DCGM_FI_PROF_DRAM_ACTIVE"
    fb_used: str = "DCGM_FI_DEV_FB_USED"
    fb_free: str = "DCGM_FI_DEV_FB_FREE"
    power_usage: str = "DCGM_FI_DEV_POWER_USAGE"
    overridden: frozenset[str] = frozenset()
    """Fields the user set: their legacy aliases are not queried."""

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name != "overridden":
                check_metric_name(getattr(self, f.name), f.name)

    def with_overrides(self, overrides: Mapping[str, str | None]) -> MetricNames:
        """Overrides by field name (snake_case) or CRD key (camelCase); unknown keys are errors."""
        known = {f.name for f in fields(self)} - {"overridden"}
        changes: dict[str, str] = {}
        for key, value in overrides.items():
            name = re.sub(r"(?<!^)([A-Z])", r"_\1", key).lower()
            if name not in known:
                raise ValueError(f"prometheus.metricNames.{key}: unknown metric key (known: {', '.join(sorted(known))})")
            if value is not None:
                changes[name] = value
        return replace(self, **changes, overridden=self.overridden | frozenset(changes))

    @classmethod
    def from_spec(cls, metric_names: Any) -> MetricNames:
        """From the api model's `spec.prometheus.metric_names` (None fields keep defaults)."""
        if metric_names is None:
            return cls()
        data = metric_names.model_dump() if hasattr(metric_names, "model_dump") else dict(metric_names)
        return cls().with_overrides({k: v for k, v in data.items() if v is not None})

    def candidates(self, field_name: str) -> tuple[str, ...]:
        """The name to query, then legacy aliases unless overridden."""
        name = getattr(self, field_name)
        if field_name in self.overridden:
            return (name,)
        return (name,) + tuple(a for a in LEGACY_ALIASES.get(field_name, ()) if a != name)


LEGACY_ALIASES: dict[str, tuple[str, ...]] = {
    "kv_cache_usage": ("vllm:gpu_cache_usage_perc",),  # renamed in vLLM 0.9
    "inter_token_latency": ("vllm:time_per_output_token_seconds",),  # renamed in 0.11, removed in 0.13
    "num_preemptions": ("vllm:num_preemptions",),  # counters declared without _total in some exporters
}


@dataclass(frozen=True)
class LabelNames:
    """Where pod, namespace and model sit on a series (they differ with and without pod mapping)."""

    pod: str = "pod"
    namespace: str = "namespace"
    model: str | None = "model_name"

    def __post_init__(self) -> None:
        for name in (self.pod, self.namespace) + ((self.model,) if self.model else ()):
            check_label_name(name)

    @classmethod
    def from_spec(cls, labels: Any, with_model: bool = True) -> LabelNames:
        if labels is None:
            return cls(model="model_name" if with_model else None)
        model = getattr(labels, "model", "model_name") if with_model else None
        return cls(labels.pod, labels.namespace, model)


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


def selector(labels: Mapping[str, str]) -> str:
    """`{a="x",b="y"}` with names checked and values escaped (keys in the given order)."""
    parts = [f'{check_label_name(k)}="{escape_label_value(v)}"' for k, v in labels.items()]
    return "{" + ",".join(parts) + "}"


def _window(seconds: int) -> str:
    if int(seconds) < 1:
        raise ValueError(f"window {seconds!r} s must be >= 1")
    return f"[{int(seconds)}s]"


def _or(queries: list[str]) -> str:
    return queries[0] if len(queries) == 1 else " or ".join(f"({q})" for q in queries)


def histogram_quantile(metrics: tuple[str, ...], quantile: float, labels: Mapping[str, str], window_s: int, scale: float = 1.0) -> str:
    if not 0 < quantile < 1:
        raise ValueError(f"quantile {quantile!r} is outside (0, 1)")
    sel, w = selector(labels), _window(window_s)
    prefix = f"{scale:g} * " if scale != 1 else ""
    return _or([
        f"{prefix}histogram_quantile({quantile:g}, sum by (le) (rate({check_metric_name(m)}_bucket{sel}{w})))"
        for m in metrics
    ])


def histogram_mean(metrics: tuple[str, ...], labels: Mapping[str, str], window_s: int, scale: float = 1.0) -> str:
    sel, w = selector(labels), _window(window_s)
    prefix = f"{scale:g} * " if scale != 1 else ""
    return _or([
        f"{prefix}sum(rate({check_metric_name(m)}_sum{sel}{w})) / sum(rate({m}_count{sel}{w}))" for m in metrics
    ])


def counter_rate(metrics: tuple[str, ...], labels: Mapping[str, str], window_s: int) -> str:
    sel, w = selector(labels), _window(window_s)
    return _or([f"sum(rate({check_metric_name(m)}{sel}{w}))" for m in metrics])


def gauge_avg(metrics: tuple[str, ...], labels: Mapping[str, str], window_s: int, scale: float = 1.0) -> str:
    sel, w = selector(labels), _window(window_s)
    prefix = f"{scale:g} * " if scale != 1 else ""
    return _or([f"{prefix}avg(avg_over_time({check_metric_name(m)}{sel}{w}))" for m in metrics])


def gauge_max(metrics: tuple[str, ...], labels: Mapping[str, str], window_s: int, scale: float = 1.0) -> str:
    sel, w = selector(labels), _window(window_s)
    prefix = f"{scale:g} * " if scale != 1 else ""
    return _or([f"{prefix}max(max_over_time({check_metric_name(m)}{sel}{w}))" for m in metrics])


def trial_queries(
    *,
    namespace: str,
    pod: str,
    model: str | None,
    window_s: int,
    percentile: int = 95,
    names: MetricNames = MetricNames(),
    labels: LabelNames = LabelNames(),
    gpu_labels: LabelNames = LabelNames(model=None),
) -> dict[str, str]:
    """Status metric name -> instant query, evaluated at the end of the trial's measurement window.

    vLLM series are selected by namespace, pod and model; dcgm series by the GPU label names
    (e.g. exported_pod when scraped without honorLabels). SM active and KV usage come as 0..1
    ratios and are returned in percent.
    """
    vllm = {labels.namespace: namespace, labels.pod: pod}
    if labels.model and model is not None:
        vllm[labels.model] = model
    gpu = {gpu_labels.namespace: namespace, gpu_labels.pod: pod}
    q = percentile / 100
    # No error-rate query: vLLM counts no failed requests; the load generator reports them.
    return {
        "ttftMs": histogram_quantile(names.candidates("time_to_first_token"), q, vllm, window_s, 1000),
        "itlMs": histogram_quantile(names.candidates("inter_token_latency"), q, vllm, window_s, 1000),
        "e2eMs": histogram_quantile(names.candidates("e2e_request_latency"), q, vllm, window_s, 1000),
        "queueMs": histogram_quantile(names.candidates("request_queue_time"), q, vllm, window_s, 1000),
        "requestThroughput": counter_rate(names.candidates("request_success"), vllm, window_s),
        "outputThroughput": counter_rate(names.candidates("generation_tokens"), vllm, window_s),
        "promptThroughput": counter_rate(names.candidates("prompt_tokens"), vllm, window_s),
        "preemptionsPerSecond": counter_rate(names.candidates("num_preemptions"), vllm, window_s),
        "runningRequests": gauge_avg(names.candidates("num_requests_running"), vllm, window_s),
        "waitingRequests": gauge_avg(names.candidates("num_requests_waiting"), vllm, window_s),
        "kvCacheUsagePercent": gauge_avg(names.candidates("kv_cache_usage"), vllm, window_s, 100),
        "kvCacheUsageMaxPercent": gauge_max(names.candidates("kv_cache_usage"), vllm, window_s, 100),
        "gpuUtilPercent": gauge_avg(names.candidates("gpu_util"), gpu, window_s),
        "smActivePercent": gauge_avg(names.candidates("sm_active"), gpu, window_s, 100),
        "powerWatts": gauge_avg(names.candidates("power_usage"), gpu, window_s),
        "fbUsedMiB": gauge_avg(names.candidates("fb_used"), gpu, window_s),
    }
