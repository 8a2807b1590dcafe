"""What the operator's install allows a BatchTuning: one type, read from the operator's flags or a Helm values file.

The chart turns its values into `batchtune operator` flags (templates/deployment.yaml); `install_from_values`
reads the same values the same way, so `batchtune validate --values FILE` judges a spec by the install's bounds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DEFAULT_ARGOCD_INSTANCE_LABELS = ("app.kubernetes.io/instance", "argocd.argoproj.io/instance")


@dataclass(frozen=True)
class Install:
    """What the operator's install allows a BatchTuning (Helm values, passed as flags or environment)."""

    operator_image: str
    load_images: tuple[str, ...] = ()
    """Images `spec.load.image` may name, besides the operator's own."""
    prometheus_urls: tuple[str, ...] = ()
    """URL prefixes `spec.prometheus.url` must be under (canonical scheme, host, port, path: `core.policy`); empty:
    any http(s) URL the address rules allow. A prefix naming a loopback host itself is the only way to loopback."""
    max_gpu_minutes: int = 2880
    """Ceiling on a BatchTuning's GPU-minutes (`spec.strategy.maxGpuMinutes` may only lower it)."""
    secret_label: str = "batchtune.io/prometheus-token"
    """A Secret is read for spec.prometheus.authSecretRef only if it carries this label with value "true"."""
    git_urls: tuple[str, ...] = ()
    """URL prefixes spec.apply.git.url (and forge.apiUrl) may start with; empty: PullRequest mode is not allowed."""
    git_secret_label: str = "batchtune.io/git-credentials"
    """A Secret is read for spec.apply.git.credentialsSecretRef only if it carries this label with value "true"."""
    argocd_instance_labels: tuple[str, ...] = DEFAULT_ARGOCD_INSTANCE_LABELS
    """Labels Argo CD's label tracking uses on this cluster (its default and argocd-cm application.instanceLabelKey)."""
    scrape_interval_seconds: float | None = None
    """An override of Prometheus' scrape interval for the engine's pods (a window needs two scrapes to be
    measured); None: read from Prometheus at planning (`core.scrape`)."""
    scrape_lag_seconds: float = 6.0
    """Prometheus needs a couple of scrapes after a run ends before the window is complete."""
    measurement_deadline_seconds: int = 600
    """A run whose figures Prometheus cannot give this long after it ended fails its trial."""
    extra_flags: tuple[str, ...] = ()
    """Engine flags (canonical, no dashes) `spec.searchSpace.extraArgs` may add besides the engine's default list."""


def install_from_environment(env: Mapping[str, str], version: str) -> Install:
    """The Install `batchtune operator` runs with: its flags, passed on as environment (controller/main.py)."""
    def listed(name: str) -> tuple[str, ...]:
        return tuple(x for x in env.get(name, "").split(",") if x)

    return Install(
        operator_image=env.get("BATCHTUNE_IMAGE", f"batchtune:{version}"),
        load_images=listed("BATCHTUNE_ALLOWED_LOAD_IMAGES"),
        prometheus_urls=listed("BATCHTUNE_ALLOWED_PROMETHEUS_URLS"),
        max_gpu_minutes=int(env.get("BATCHTUNE_MAX_GPU_MINUTES", "2880")),
        secret_label=env.get("BATCHTUNE_SECRET_LABEL", "batchtune.io/prometheus-token"),
        git_urls=listed("BATCHTUNE_ALLOWED_GIT_URLS"),
        git_secret_label=env.get("BATCHTUNE_GIT_SECRET_LABEL", "batchtune.io/git-credentials"),
        argocd_instance_labels=listed("BATCHTUNE_ARGOCD_INSTANCE_LABELS") or DEFAULT_ARGOCD_INSTANCE_LABELS,
        # An override; unset, each tuning's planning reads the interval from its Prometheus (core/scrape.py).
        scrape_interval_seconds=float(env["BATCHTUNE_SCRAPE_INTERVAL_SECONDS"])
        if env.get("BATCHTUNE_SCRAPE_INTERVAL_SECONDS") else None,
        scrape_lag_seconds=float(env.get("BATCHTUNE_SCRAPE_LAG_SECONDS", "6")),
        measurement_deadline_seconds=int(env.get("BATCHTUNE_MEASUREMENT_DEADLINE_SECONDS", "600")),
        extra_flags=listed("BATCHTUNE_ALLOWED_EXTRA_FLAGS"),
    )


class InvalidValues(ValueError):
    """A Helm values file the chart would not install with; the message names the key and the value."""


DEFAULT_PROMETHEUS_URLS = ("http://prometheus-operated.monitoring.svc:9090/",)
"""The chart's default prometheus.allowedUrls (values.yaml says why): one in-cluster Prometheus, never every URL."""


def install_from_values(values: Any, version: str) -> Install:
    """The Install the chart's deployment template makes of these values (unset keys: the chart's defaults).

    `version` is the chart's appVersion, the operator image's tag when `image.tag` is empty.
    """
    if values is None:
        values = {}
    if not isinstance(values, Mapping):
        raise InvalidValues(f"the values file must hold a mapping at the top (got {type(values).__name__})")
    image = _section(values, "image")
    repository = _text(image, "image.repository", "batchtune")
    digest, tag = _text(image, "image.digest", ""), _text(image, "image.tag", "")
    operator_image = f"{repository}@{digest}" if digest else f"{repository}:{tag or version}"
    operator = _section(values, "operator")
    prometheus = _section(values, "prometheus")
    git = _section(values, "git")
    scrape = prometheus.get("scrapeIntervalSeconds")
    if scrape is not None and (isinstance(scrape, bool) or not isinstance(scrape, (int, float)) or scrape <= 0):
        raise InvalidValues(f"prometheus.scrapeIntervalSeconds must be a positive number or null (got {scrape!r})")
    budget = values.get("maxGpuMinutesPerTuning", Install.max_gpu_minutes)
    if isinstance(budget, bool) or not isinstance(budget, int) or not 1 <= budget <= 10_000_000:
        raise InvalidValues(f"maxGpuMinutesPerTuning must be a whole number from 1 to 10000000 (got {budget!r})")
    return Install(
        operator_image=_text(operator, "operator.loadGeneratorImage", "") or operator_image,
        load_images=_strings(_section(values, "load"), "load.allowedImages"),
        prometheus_urls=_strings(prometheus, "prometheus.allowedUrls", DEFAULT_PROMETHEUS_URLS),
        max_gpu_minutes=budget,
        git_urls=_strings(git, "git.allowedUrls"),
        argocd_instance_labels=_strings(git, "git.argocdInstanceLabels") or DEFAULT_ARGOCD_INSTANCE_LABELS,
        scrape_interval_seconds=float(scrape) if scrape is not None else None,
        extra_flags=tuple(f.removeprefix("--") for f in _strings(_section(values, "searchSpace"),
                                                                  "searchSpace.allowedExtraFlags")),
    )


def _section(values: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    section = values.get(key)
    if section is None:
        return {}
    if not isinstance(section, Mapping):
        raise InvalidValues(f"{key} must be a mapping (got {section!r:.80})")
    return section


def _text(section: Mapping[str, Any], key: str, default: str) -> str:
    value = section.get(key.rpartition(".")[2], default)
    if value is None:
        return default
    if not isinstance(value, str):
        raise InvalidValues(f"{key} must be a string (got {value!r:.80})")
    return value


def _strings(section: Mapping[str, Any], key: str, default: tuple[str, ...] = ()) -> tuple[str, ...]:
    value = section.get(key.rpartition(".")[2])
    if value is None:
        return default
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise InvalidValues(f"{key} must be a list of non-empty strings (got {value!r:.80})")
    return tuple(value)
