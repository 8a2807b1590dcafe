"""The one place that reads Prometheus: trial runs, production windows, workload observations, peaks.

Queries come from `core.promql` with the BatchTuning's configured metric and label names. Missing
data is None ("unknown"), never zero. A query answers one series, because every query aggregates
(sum for rates and watts, avg for ratios, max for peaks); more than one series back means the
aggregation did not hold, and that figure is unknown, never the largest. Prometheus unreachable, an
HTTP error, a 200 with an error body, missing or null `data`, or a result of the wrong type is
`PrometheusUnavailable`, with a short sanitised message (never the body itself).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import requests
from prometheus_api_client import PrometheusConnect
from prometheus_api_client.exceptions import PrometheusApiClientException
from urllib3.util.retry import Retry

from batchtune.core import promql
from batchtune.core.measurement import Window
from batchtune.core.promql import QueryContext, Selector
from batchtune.core.verify import ARRIVAL_RATE, SERVED_SHARE
from batchtune.core.vocabulary import M
from batchtune.core.workload import WorkloadObservation

log = logging.getLogger(__name__)
_UNPRINTABLE = re.compile(r"[^\x20-\x7e]+")


class PrometheusUnavailable(Exception):
    """Prometheus could not answer; callers treat every value as unknown."""


def sanitize(text: str, limit: int = 160) -> str:
    """Printable ASCII only, cut: what a remote answer may put into status or a terminal."""
    return _UNPRINTABLE.sub(" ", str(text)).strip()[:limit]


@dataclass(frozen=True)
class Production:
    """Production's pods for the queries that read it."""

    namespace: str
    pods: tuple[str, ...]
    model: str | None = None


class PrometheusReader:
    """Reads one BatchTuning's figures (its metric names, labels and percentile) from one Prometheus."""

    @staticmethod
    def connect(url: str, token: str | None = None) -> PrometheusConnect:
        """A client with its own connection pool (reused across ticks by the caller)."""
        headers = {"Authorization": f"Bearer {token}"} if token else None
        # retry=None would mean the library's default: 3 sleeping retries inside a tick. The loop retries.
        return PrometheusConnect(url=url, headers=headers, disable_ssl=False, retry=Retry(total=0))

    def __init__(self, url: str, ctx: QueryContext, *, token: str | None = None, timeout_s: float = 10.0,
                 connection: PrometheusConnect | None = None,
                 on_query: Callable[[], None] | None = None, on_error: Callable[[], None] | None = None,
                 finished_reason_label: str | None = None, error_reasons: tuple[str, ...] = (),
                 http_errors: promql.HttpErrors | None = None) -> None:
        self.url = url
        self.ctx = ctx
        self.timeout_s = timeout_s
        self.on_query = on_query
        self.on_error = on_error
        self.finished_reason_label = finished_reason_label
        self.error_reasons = error_reasons
        self.http_errors = http_errors
        self._conn = connection or self.connect(url, token)

    # ---- the raw query ----------------------------------------------------------------------

    def _result(self, promql_text: str, at: float | None) -> list[dict[str, Any]]:
        # No sleeping retries here: the reconcile loop retries on its next tick with back-off.
        params = {"time": f"{at:.3f}"} if at is not None else None
        if self.on_query:
            self.on_query()
        try:
            result = self._conn.custom_query(promql_text, params=params, timeout=self.timeout_s)
        except PrometheusApiClientException as exc:
            self._failed()
            code = re.search(r"HTTP Status Code (\d+)", str(exc))
            status = code.group(1) if code else "error"
            if status == "400":
                log.error("Prometheus rejected a query batchtune built (a bug): %s", promql_text)
                raise PrometheusUnavailable(f"{sanitize(self.url)}: HTTP 400, it rejected a query") from None
            raise PrometheusUnavailable(f"{sanitize(self.url)}: HTTP {status}") from None
        except requests.RequestException as exc:
            self._failed()
            raise PrometheusUnavailable(f"{sanitize(self.url)}: {type(exc).__name__}") from None
        except (KeyError, TypeError, ValueError):
            self._failed()
            raise PrometheusUnavailable(f"{sanitize(self.url)}: an answer without data (error body or malformed JSON)") \
                from None
        if not isinstance(result, list) or any(not isinstance(s, dict) for s in result):
            self._failed()
            raise PrometheusUnavailable(f"{sanitize(self.url)}: an answer that is not an instant vector")
        return result

    def _failed(self) -> None:
        if self.on_error:
            self.on_error()

    def scalar(self, promql_text: str, at: float | None = None) -> float | None:
        """One number from an instant query: None when empty, NaN, or not exactly one series."""
        values = []
        for sample in self._result(promql_text, at):
            value = _value(sample)
            if value is not None:
                values.append(value)
        if len(values) > 1:
            log.warning("Query returned %d series where one was expected; the figure is unknown: %s",
                        len(values), promql_text)
            return None
        return values[0] if values else None

    def vector(self, promql_text: str, at: float | None = None) -> list[tuple[Mapping[str, str], float]]:
        out: list[tuple[Mapping[str, str], float]] = []
        for sample in self._result(promql_text, at):
            value = _value(sample)
            if value is not None:
                metric = sample.get("metric")
                out.append((dict(metric) if isinstance(metric, dict) else {}, value))
        return out

    def ping(self) -> None:
        self._result("vector(1)", None)

    # ---- what the operator reads ------------------------------------------------------------

    def trial_run(self, namespace: str, pod: str, model: str | None, window: Window) -> dict[str, float | None]:
        """One load run's engine and GPU figures over its measurement window."""
        at = window.end.timestamp()
        queries = promql.trial_queries(self.ctx, namespace, pod, model, window.seconds)
        values = {name: self.scalar(q, at) for name, q in queries.items()}
        values[M.KV_POOL_TOKENS] = self.kv_pool(namespace, pod, at)
        return values

    def kv_pool(self, namespace: str, pod: str, at: float | None = None) -> float | None:
        for labels, _ in self.vector(promql.kv_pool_query(self.ctx, namespace, pod), at):
            try:
                return float(labels["num_gpu_blocks"]) * float(labels["block_size"])
            except (KeyError, ValueError):
                continue
        return None

    def production_window(self, production: Production, start: datetime, end: datetime) -> dict[str, float | None]:
        """Production's SLO figures, error rate, served share of the offered load and request count."""
        window = max(1, int((end - start).total_seconds()))
        sel = promql.pods_selector(self.ctx.labels, production.namespace, list(production.pods))
        queries = promql.production_queries(self.ctx, sel, window, self.finished_reason_label, self.error_reasons,
                                            self.http_errors)
        at = end.timestamp()
        raw = {name: self.scalar(q, at) for name, q in queries.items()}
        out: dict[str, float | None] = {k: raw.get(k) for k in (M.TTFT_MS, M.ITL_MS, M.E2E_MS, M.REQUEST_THROUGHPUT,
                                                                 M.OUTPUT_THROUGHPUT, M.WAITING_REQUESTS, M.REQUESTS)}
        finished, failed, growth = raw.get(M.REQUEST_THROUGHPUT), raw.get("failedThroughput"), raw.get("inSystemGrowth")
        # Requests that failed fast (HTTP errors) never reach the engine's counters: they count on top.
        fast = raw.get("httpFailedThroughput") or 0.0
        if finished is not None:
            answered = finished + fast
            if answered > 0:
                out[M.ERROR_RATE_PERCENT] = 100.0 * ((failed or 0.0) + fast) / answered \
                    if "failedThroughput" in raw else None
            elif out.get(M.REQUESTS) == 0:
                out[M.ERROR_RATE_PERCENT] = 0.0
            arrived = finished + max(0.0, growth or 0.0) / window
            out[ARRIVAL_RATE] = arrived
            out[SERVED_SHARE] = 100.0 * finished / arrived if arrived > 0 else None
        return {k: (round(v, 4) if v is not None and math.isfinite(v) else v) for k, v in out.items()}

    def production_workload(self, production: Production, lookback_s: int, window_s: int) -> WorkloadObservation | None:
        """What production's own series say about its traffic over the lookback; None when it has no pods."""
        if not production.pods:
            return None
        sel = promql.pods_selector(self.ctx.labels, production.namespace, list(production.pods))
        queries = promql.workload_queries(self.ctx, sel, lookback_s, window_s)
        return WorkloadObservation(
            lookback_seconds=lookback_s,
            prompt_buckets=self.buckets(queries["promptBuckets"]),
            output_buckets=self.buckets(queries["outputBuckets"]),
            prompt_mean=self.scalar(queries["promptMean"]),
            output_mean=self.scalar(queries["outputMean"]),
            request_counts=tuple(self.series(queries["requestCounts"])),
            window_seconds=window_s,
            prefix_cache_hits=self.scalar(queries["prefixHits"]) if "prefixHits" in queries else None,
            prefix_cache_queries=self.scalar(queries["prefixQueries"]) if "prefixQueries" in queries else None,
            replicas=len(production.pods),
        )

    def buckets(self, promql_text: str) -> tuple[tuple[float, float], ...]:
        """(le, value) of a `sum by (le)` answer; series without a readable `le` are left out."""
        out = []
        for labels, value in self.vector(promql_text):
            try:
                le = float(labels.get("le", ""))
            except ValueError:
                continue
            out.append((le, value))
        return tuple(out)

    def series(self, promql_text: str) -> list[float]:
        """The values of a subquery's one series, oldest first (NaN left out); empty when not one series."""
        result = self._result(promql_text, None)
        if len(result) != 1:
            if len(result) > 1:
                log.warning("Query returned %d series where one was expected; the series is unknown: %s",
                            len(result), promql_text)
            return []
        values = result[0].get("values")
        if not isinstance(values, list):
            return []
        out = []
        for point in values:
            value = _value({"value": point})
            if value is not None and math.isfinite(value):
                out.append(value)
        return out

    def production_gpu_model(self, production: Production) -> str | None:
        """The one GPU model dcgm-exporter reports for production's pods, or None (none, or several)."""
        if not production.pods:
            return None
        found = {labels.get("modelName") for labels, _ in self.vector(
            promql.gpu_model_query(self.ctx, production.namespace, list(production.pods)))}
        models = {sanitize(m, 100) for m in found if m}
        return models.pop() if len(models) == 1 else None

    def production_peak_rate(self, production: Production, lookback_s: int) -> float | None:
        """Production's highest 1-minute request rate (requests per second) over the lookback."""
        if not production.pods:
            return None
        sel = promql.pods_selector(self.ctx.labels, production.namespace, list(production.pods))
        inner = promql.counter_rate(self.ctx.names.candidates("request_success"), sel, 60)
        return self.scalar(f"max_over_time(({inner})[{int(lookback_s)}s:30s])")


def _value(sample: Mapping[str, Any]) -> float | None:
    try:
        value = float(sample["value"][1])
    except (KeyError, IndexError, TypeError, ValueError):
        return None
    return value if not math.isnan(value) else None


__all__ = ["Production", "PrometheusReader", "PrometheusUnavailable", "Selector", "sanitize"]
