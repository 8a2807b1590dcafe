"""Prometheus reads through prometheus-api-client. Missing data is None ("unknown"), never zero."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable, Mapping

from prometheus_api_client import PrometheusConnect
from prometheus_api_client.exceptions import PrometheusApiClientException
import requests

from batchtune.controller import metrics

log = logging.getLogger(__name__)


class PrometheusUnavailable(Exception):
    """Prometheus could not be reached or refused the query; callers treat every value as unknown."""


@dataclass
class Prometheus:
    url: str
    token: str | None = None
    timeout_s: float = 10.0
    on_error: Callable[[], None] | None = None

    def __post_init__(self) -> None:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else None
        self._conn = PrometheusConnect(url=self.url, headers=headers, disable_ssl=False, retry=None)

    def scalar(self, promql: str, at: float | None = None) -> float | None:
        """One number from an instant query: None when the result is empty, NaN or infinite."""
        result = self._query(promql, at)
        values = []
        for sample in result:
            try:
                value = float(sample["value"][1])
            except (KeyError, IndexError, TypeError, ValueError):
                continue
            if math.isfinite(value):
                values.append(value)
        if not values:
            return None
        # Queries are written to aggregate to one series; more than one means a label join went wrong.
        if len(values) > 1:
            log.warning("Query returned %d series, took the largest: %s", len(values), promql)
        return max(values)

    def vector(self, promql: str, at: float | None = None) -> list[tuple[Mapping[str, str], float]]:
        out = []
        for sample in self._query(promql, at):
            value = float(sample["value"][1])
            if math.isfinite(value):
                out.append((sample.get("metric", {}), value))
        return out

    def reachable(self) -> bool:
        try:
            self._query("vector(1)", None)
            return True
        except PrometheusUnavailable:
            return False

    def _query(self, promql: str, at: float | None) -> list[dict]:
        # No sleeping retries here: the reconcile loop retries on its next tick with back-off.
        params = {"time": f"{at:.3f}"} if at is not None else None
        metrics.PROMETHEUS_QUERIES.inc()
        try:
            return self._conn.custom_query(promql, params=params, timeout=self.timeout_s)
        except (requests.RequestException, PrometheusApiClientException, ValueError) as exc:
            if self.on_error:
                self.on_error()
            raise PrometheusUnavailable(f"{self.url}: {exc}") from exc
