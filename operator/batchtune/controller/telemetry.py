"""The operator's own metrics (prometheus-client), served on --metrics-port."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

TRIALS = Counter("batchtune_trials_total", "Trials finished, by result.", ["result"])
TUNING_DURATION = Histogram(
    "batchtune_tuning_duration_seconds", "Wall time from the first trial to the decision.",
    buckets=(60, 300, 600, 1200, 1800, 3600, 7200, 14400, 28800, 86400),
)
PROMETHEUS_ERRORS = Counter("batchtune_prometheus_query_errors_total", "Prometheus queries that failed.")
PROMETHEUS_QUERIES = Counter("batchtune_prometheus_queries_total", "Prometheus queries sent (including failed ones).")
RECONCILE_SECONDS = Histogram("batchtune_reconcile_seconds", "Time spent in one reconcile step.",
                              buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10))
ROLLBACKS = Counter("batchtune_rollbacks_total", "Production rollbacks after a failed verify.")
LEADER = Gauge("batchtune_leader", "1 while this replica holds the leader Lease and runs the operator, 0 on standby "
               "(1 without --leader-elect).")
LEADER.set(1)
LEADER_TRANSITIONS = Counter("batchtune_leader_acquired_total", "Times this replica took the leader Lease.")


def serve(port: int, address: str) -> None:
    start_http_server(port, addr=address)
