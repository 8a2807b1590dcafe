"""The Prometheus configuration of the local cluster: pods found through the real API, plus GPU metrics."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

POD_JOB = "kubernetes-pods"
GPU_JOB = "dcgm-exporter"
# Container ports with these names are scraped without an annotation.
METRICS_PORT_NAMES = "metrics|http"


def pod_relabel_configs() -> list[dict[str, Any]]:
    """Keep pods annotated `prometheus.io/scrape: "true"` or exposing a `metrics`/`http` port."""
    annotation = "__meta_kubernetes_pod_annotation_prometheus_io_"
    return [
        # Relabel rules are ANDed; a scratch label turns the two ways of opting in into an OR.
        {"source_labels": [f"{annotation}scrape"], "regex": "true",
         "target_label": "__tmp_scrape", "replacement": "yes"},
        {"source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": METRICS_PORT_NAMES,
         "target_label": "__tmp_scrape", "replacement": "yes"},
        {"source_labels": [f"{annotation}scrape"], "regex": "false", "action": "drop"},
        {"source_labels": ["__tmp_scrape"], "regex": "yes", "action": "keep"},
        {"source_labels": ["__meta_kubernetes_pod_container_init"], "regex": "true", "action": "drop"},
        {"source_labels": ["__meta_kubernetes_pod_phase"], "regex": "Pending|Succeeded|Failed", "action": "drop"},
        {"source_labels": [f"{annotation}path"], "regex": "(.+)", "target_label": "__metrics_path__"},
        # The annotated port wins over the container port the target was discovered on.
        {"source_labels": ["__address__", f"{annotation}port"], "regex": r"([^:;]+)(?::\d+)?;(\d+)",
         "replacement": "$1:$2", "target_label": "__address__"},
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
        {"source_labels": ["__meta_kubernetes_pod_node_name"], "target_label": "node"},
    ]


def render_config(*, api_server: str, ca_file: Path, token_file: Path, gpu_metrics_target: str | None,
                  scrape_interval_s: float) -> dict[str, Any]:
    interval = f"{scrape_interval_s:g}s"
    config: dict[str, Any] = {
        "global": {"scrape_interval": interval, "evaluation_interval": interval,
                   "scrape_timeout": interval},
        "scrape_configs": [
            {
                "job_name": POD_JOB,
                "kubernetes_sd_configs": [{
                    "role": "pod",
                    "api_server": api_server,
                    "authorization": {"credentials_file": str(token_file)},
                    "tls_config": {"ca_file": str(ca_file)},
                }],
                "relabel_configs": pod_relabel_configs(),
                # Small test servers may omit the Content-Type Prometheus 3 otherwise insists on.
                "fallback_scrape_protocol": "PrometheusText0.0.4",
            },
        ],
    }
    if gpu_metrics_target:
        # The node agent labels each GPU series with the pod holding the GPU; keep those labels.
        config["scrape_configs"].append({
            "job_name": GPU_JOB,
            "honor_labels": True,
            "fallback_scrape_protocol": "PrometheusText0.0.4",
            "static_configs": [{"targets": [gpu_metrics_target]}],
        })
    return config


def write_config(path: Path, **kwargs: Any) -> Path:
    path.write_text(yaml.safe_dump(render_config(**kwargs), sort_keys=False))
    return path
