"""The one place that reads Prometheus: trial runs, production windows, workload observations, peaks.

Queries come from `core.promql` with the BatchTuning's configured metric and label names. Missing
data is None ("unknown"), never zero. A query answers one series, because every query aggregates
(sum for rates and watts, avg for ratios, max for peaks); more than one series back means the
aggregation did not hold, and that figure is unknown, never the largest. Prometheus unreachable, an
HTTP error, a 200 with an error body, missing or null `data`, or a result of the wrong type is
`PrometheusUnavailable`, with a short sanitised message (never the body itself).

The answer comes from a server a BatchTuning's author chose, so the client trusts none of it: the URL's
host is resolved once per reader and every address is checked (`core.addresses`) before the connection
goes to the checked address itself, never a second lookup; redirects are never followed; an answer is
streamed up to a byte cap; each query has a total deadline (a watchdog cuts the socket, so a server that
drips bytes cannot stretch it) and a reader (one tick) a budget; and one BatchTuning's queries hold at
most one worker at a time (`gate`): a second one fails at once instead of waiting.
"""

from __future__ import annotations

import contextlib
import http.client
import ipaddress
import json
import logging
import math
import re
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import urlencode

from batchtune import __version__
from batchtune.core import promql, scrape
from batchtune.core.addresses import Endpoint, UrlError, address_problem, endpoint, host_problem
from batchtune.core.measurement import Window
from batchtune.core.promql import QueryContext, Selector
from batchtune.core.scrape import ScrapeInterval
from batchtune.core.verify import ARRIVAL_RATE, SERVED_SHARE
from batchtune.core.vocabulary import M
from batchtune.core.workload import WorkloadObservation

log = logging.getLogger(__name__)
_UNPRINTABLE = re.compile(r"[^\x20-\x7e]+")


class PrometheusUnavailable(Exception):
    """Prometheus could not answer; callers treat every value as unknown."""


class PrometheusRefused(PrometheusUnavailable):
    """The URL or an address its host resolves to is one the operator never dials: every value is unknown."""


class AnswerTooLarge(PrometheusUnavailable):
    """The answer held more than its byte cap; reading stopped there."""


Resolver = Callable[[str, int], Sequence[str]]
"""host, port -> the addresses (text) to check and dial; tests give fake DNS answers."""


def system_resolver(host: str, port: int) -> list[str]:
    return list(dict.fromkeys(str(info[4][0]) for info in socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)))


QUERY_BYTES_LIMIT = 2 * 1024 * 1024
"""The most a query's answer may hold. Every query aggregates; the longest is a profile's request-count series
(a 30-day lookback at a 1-minute step: 43200 points, about 1.1 MiB). Parsed, JSON takes about 8 times its
size, so a worker holds at most ~19 MiB for a query (docs/security.md has the sum over workers)."""
QUERY_DEADLINE_SECONDS = 10.0
"""Total time one query may take, from connecting to the last byte."""
TICK_BUDGET_SECONDS = 30.0
"""Total time one reader (one BatchTuning's tick) may spend on Prometheus; the rest waits for the next tick."""


class _PinnedHTTPS(http.client.HTTPSConnection):
    """HTTPS to an address that was checked, verifying the certificate for the URL's host name."""

    def __init__(self, address: str, port: int, server_name: str, timeout: float) -> None:
        super().__init__(address, port, timeout=timeout, context=ssl.create_default_context())
        self._server_name = server_name

    def connect(self) -> None:
        sock = socket.create_connection((self.host, self.port), self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self._server_name)  # type: ignore[attr-defined]


class _Transport:
    """GETs to one Prometheus: checked address, no redirects, a byte cap, a deadline per query, a budget."""

    def __init__(self, url: str, token: str | None, *, loopback_allowed: bool, resolver: Resolver,
                 timeout_s: float, budget_s: float, gate: threading.Lock | None) -> None:
        self.url, self.shown = url, sanitize(url)
        self.token, self.loopback_allowed, self.resolver = token, loopback_allowed, resolver
        self.timeout_s, self.budget_s, self.gate = timeout_s, budget_s, gate
        self._where: Endpoint | None = None
        self._address: str | None = None
        self._budget_end: float | None = None

    def _checked(self) -> tuple[Endpoint, str]:
        """The endpoint and the one address to dial, checked once for this reader (no second lookup)."""
        if self._where is not None and self._address is not None:
            return self._where, self._address
        try:
            where = endpoint(self.url)
        except UrlError as exc:
            raise PrometheusRefused(f"{self.shown} {exc}") from None
        problem = host_problem(where, loopback_allowed=self.loopback_allowed)
        if problem:
            raise PrometheusRefused(f"{self.shown} points at {problem}; the operator never queries it")
        if where.address is not None:
            found: list[ipaddress.IPv4Address | ipaddress.IPv6Address] = [where.address]
        else:
            try:
                found = [ipaddress.ip_address(a) for a in self.resolver(where.host, where.port)]
            except (OSError, UnicodeError, ValueError) as exc:
                raise PrometheusUnavailable(f"{self.shown}: {where.host} did not resolve ({type(exc).__name__})") \
                    from None
            if not found:
                raise PrometheusUnavailable(f"{self.shown}: {where.host} resolved to no address")
        for address in found:
            problem = address_problem(address, loopback_allowed=self.loopback_allowed)
            if problem:
                raise PrometheusRefused(f"{self.shown}: {where.host} resolves to {problem}; the operator never "
                                        "queries it")
        self._where, self._address = where, str(found[0])
        return where, self._address

    def get(self, path: str, params: Mapping[str, str] | None, limit: int) -> tuple[int, bytes]:
        """(HTTP status, body) of one GET; `PrometheusUnavailable` when it cannot be had within the bounds."""
        now = time.monotonic()
        if self._budget_end is None:
            self._budget_end = now + self.budget_s
        deadline = min(now + self.timeout_s, self._budget_end)
        if deadline <= now:
            raise PrometheusUnavailable(f"{self.shown}: this tick's {self.budget_s:g}s for Prometheus are spent; "
                                        "the next tick goes on")
        if self.gate is not None and not self.gate.acquire(blocking=False):
            raise PrometheusUnavailable(f"{self.shown}: another query of this BatchTuning is in flight")
        try:
            return self._get(path, params, limit, deadline)
        finally:
            if self.gate is not None:
                self.gate.release()

    def _headers(self, where: Endpoint) -> dict[str, str]:
        headers = {"Host": where.authority, "Accept": "application/json", "Accept-Encoding": "identity",
                   "User-Agent": f"batchtune/{__version__}", "Connection": "close"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        return headers

    def _read(self, response: http.client.HTTPResponse, limit: int, deadline: float) -> bytes:
        """The body, one socket read at a time, up to `limit` bytes (no decompression: identity only)."""
        body = bytearray()
        while chunk := response.read1(64 * 1024):
            body += chunk
            if time.monotonic() >= deadline:
                raise OSError("deadline")
            if len(body) > limit:
                raise AnswerTooLarge(f"{self.shown}: an answer over {limit} bytes; not read further")
        return bytes(body)

    def _get(self, path: str, params: Mapping[str, str] | None, limit: int, deadline: float) -> tuple[int, bytes]:
        where, address = self._checked()
        target = where.path.rstrip("/") + path + (f"?{urlencode(dict(params))}" if params else "")
        remaining = deadline - time.monotonic()
        response: http.client.HTTPResponse | None = None
        conn: http.client.HTTPConnection = (
            _PinnedHTTPS(address, where.port, where.host, remaining) if where.scheme == "https"
            else http.client.HTTPConnection(address, where.port, timeout=remaining))
        cut = threading.Event()
        held: list[socket.socket] = []  # the connection hands its socket to the response; the watchdog keeps it

        def cut_off() -> None:  # the deadline bounds the whole request, not each read
            cut.set()
            for sock in held:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

        watchdog = threading.Timer(max(0.0, remaining), cut_off)
        watchdog.daemon = True
        watchdog.start()
        try:
            conn.connect()
            held.append(conn.sock)
            if cut.is_set():
                raise OSError("cut")
            conn.request("GET", target, headers=self._headers(where))
            response = conn.getresponse()
            if 300 <= response.status < 400:
                raise PrometheusUnavailable(f"{self.shown}: HTTP {response.status}, a redirect; batchtune never "
                                            "follows one (set spec.prometheus.url to where it points)")
            body = self._read(response, limit, deadline)
            if cut.is_set():
                raise OSError("cut")
            return response.status, body
        except (OSError, http.client.HTTPException) as exc:
            if cut.is_set() or time.monotonic() >= deadline:
                raise PrometheusUnavailable(f"{self.shown}: no complete answer within {remaining:.3g}s (the query's "
                                            "deadline)") from None
            raise PrometheusUnavailable(f"{self.shown}: {type(exc).__name__}") from None
        finally:
            watchdog.cancel()
            if response is not None:
                response.close()
            conn.close()
            for sock in held:
                sock.close()


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

    def __init__(self, url: str, ctx: QueryContext, *, token: str | None = None,
                 timeout_s: float = QUERY_DEADLINE_SECONDS, budget_s: float = TICK_BUDGET_SECONDS,
                 loopback_allowed: bool = False, resolver: Resolver = system_resolver,
                 gate: threading.Lock | None = None, answer_bytes_limit: int = QUERY_BYTES_LIMIT,
                 on_query: Callable[[], None] | None = None, on_error: Callable[[], None] | None = None,
                 finished_reason_label: str | None = None, error_reasons: tuple[str, ...] = (),
                 http_errors: promql.HttpErrors | None = None) -> None:
        """`loopback_allowed`: the install names this loopback host itself (`core.policy.UrlCheck`), or the
        CLI's user asked for it. `gate`: the BatchTuning's own, shared by its readers."""
        self.url = url
        self.ctx = ctx
        self.timeout_s = timeout_s
        self.answer_bytes_limit = answer_bytes_limit
        self.on_query = on_query
        self.on_error = on_error
        self.finished_reason_label = finished_reason_label
        self.error_reasons = error_reasons
        self.http_errors = http_errors
        self._http = _Transport(url, token, loopback_allowed=loopback_allowed, resolver=resolver,
                                timeout_s=timeout_s, budget_s=budget_s, gate=gate)

    # ---- the raw query ----------------------------------------------------------------------

    def _result(self, promql_text: str, at: float | None) -> list[dict[str, Any]]:
        # No sleeping retries here: the reconcile loop retries on its next tick with back-off.
        params = {"query": promql_text, **({"time": f"{at:.3f}"} if at is not None else {})}
        if self.on_query:
            self.on_query()
        try:
            status, body = self._http.get("/api/v1/query", params, self.answer_bytes_limit)
        except PrometheusUnavailable:
            self._failed()
            raise
        if status == 400:
            self._failed()
            log.error("Prometheus rejected a query batchtune built (a bug): %s", promql_text)
            raise PrometheusUnavailable(f"{sanitize(self.url)}: HTTP 400, it rejected a query")
        if status != 200:
            self._failed()
            raise PrometheusUnavailable(f"{sanitize(self.url)}: HTTP {status}")
        try:
            result = json.loads(body)["data"]["result"]
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
        return _one([v for v in map(_value, self._result(promql_text, at)) if v is not None], promql_text)

    def labelled(self, queries: Mapping[str, str], at: float | None = None) \
            -> dict[str, list[tuple[Mapping[str, str], float]]]:
        """`vector` of each query, a few queries a request (`promql.unions`): each key's series (NaN left out), with
        the labels its query gave them."""
        out: dict[str, list[tuple[Mapping[str, str], float]]] = {key: [] for key in queries}
        for text in promql.unions(queries):
            for sample in self._result(text, at):
                value, metric = _value(sample), sample.get("metric")
                labels = dict(metric) if isinstance(metric, dict) else {}
                key = labels.pop(promql.FIGURE_LABEL, None)
                if value is not None and key in out:
                    out[key].append((labels, value))
        return out

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
        queries = promql.trial_queries(self.ctx, namespace, pod, model, window.seconds)
        # 3 requests for the window's 26 queries: on a starved machine each round trip waited for a CPU, twice.
        series = self.labelled({**queries, M.KV_POOL_TOKENS: promql.kv_pool_query(self.ctx, namespace, pod)},
                               window.end.timestamp())
        values = {name: _one([value for _, value in series[name]], text) for name, text in queries.items()}
        values[M.KV_POOL_TOKENS] = _kv_pool(series[M.KV_POOL_TOKENS])
        return values

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


    # ---- what Prometheus says about its own scrapes ----------------------------------------

    API_BYTES_LIMIT = 4 * 1024 * 1024
    """The most an answer of the targets or configuration endpoint may hold (thousands of targets fit)."""

    def _api(self, path: str, params: Mapping[str, str] | None = None) -> Any | None:
        """`data` of a Prometheus HTTP API endpoint; None when this Prometheus does not offer it (HTTP 4xx/5xx:
        a Thanos or Mimir front may not) or answers more than its cap, `PrometheusUnavailable` when it cannot be
        reached."""
        if self.on_query:
            self.on_query()
        try:
            status, body = self._http.get(path, params, self.API_BYTES_LIMIT)
        except AnswerTooLarge:
            log.warning("Prometheus %s answered more than %d bytes on %s; not read", sanitize(self.url),
                        self.API_BYTES_LIMIT, path)
            return None
        except PrometheusUnavailable:
            self._failed()
            raise
        if status != 200:
            return None
        try:
            answer = json.loads(body)
        except ValueError:
            return None
        return answer.get("data") if isinstance(answer, dict) and answer.get("status") == "success" else None

    def scrape_jobs(self, production: Production) -> set[str]:
        """The `job` labels on the engine's series of production's pods (empty: no such series)."""
        if not production.pods:
            return set()
        sel = promql.pods_selector(self.ctx.labels, production.namespace, list(production.pods))
        names = self.ctx.names.candidates("num_requests_running")
        query = " or ".join(f"count by (job) ({promql.check_metric_name(n)}{sel.render()})" for n in names)
        return {sanitize(labels["job"], 200) for labels, _ in self.vector(query) if labels.get("job")}

    def scrape_interval(self, production: Production, where: str) -> ScrapeInterval | None:
        """How often Prometheus scrapes the engine's series of `where` (production's pods): the targets API for
        the jobs that scrape them, else the configuration; None when Prometheus reports neither."""
        jobs = self.scrape_jobs(production)
        named = ", ".join(sorted(jobs))
        if jobs:
            found = None
            for job in sorted(jobs)[:5]:
                data = self._api("/api/v1/targets", {"state": "active", "scrapePool": job})
                targets = (data or {}).get("activeTargets") if isinstance(data, dict) else None
                if isinstance(targets, list):
                    seconds = scrape.from_targets([t for t in targets if isinstance(t, dict)], jobs)
                    found = seconds if found is None or (seconds is not None and seconds > found) else found
            if found is not None:
                return ScrapeInterval(found, f"Prometheus' targets API: job {named} scrapes {where}'s pods")
        data = self._api("/api/v1/status/config")
        text = data.get("yaml") if isinstance(data, dict) else None
        if isinstance(text, str):
            import yaml

            try:
                config = yaml.safe_load(text)
            except yaml.YAMLError:
                config = None
            seconds = scrape.from_config(config, jobs) if isinstance(config, dict) else None
            if seconds is not None:
                what = (f"job {named}'s scrape_interval" if jobs else
                        f"the global scrape_interval ({where} has no series yet to name its job)")
                return ScrapeInterval(seconds, f"Prometheus' configuration: {what}")
        return None


def _one(values: list[float], promql_text: str) -> float | None:
    """The figure of a query's non-NaN values: None when there is none, or more than one (the query asked for one)."""
    if len(values) > 1:
        log.warning("Query returned %d series where one was expected; the figure is unknown: %s",
                    len(values), promql_text)
        return None
    return values[0] if values else None


def _kv_pool(series: list[tuple[Mapping[str, str], float]]) -> float | None:
    """The KV pool in tokens from the cache configuration info series' labels (the first that has both)."""
    for labels, _ in series:
        try:
            return float(labels["num_gpu_blocks"]) * float(labels["block_size"])
        except (KeyError, ValueError):
            continue
    return None


def _value(sample: Mapping[str, Any]) -> float | None:
    try:
        value = float(sample["value"][1])
    except (KeyError, IndexError, TypeError, ValueError):
        return None
    return value if not math.isnan(value) else None


__all__ = ["Production", "PrometheusReader", "PrometheusRefused", "PrometheusUnavailable", "Resolver", "Selector",
           "sanitize", "system_resolver"]
