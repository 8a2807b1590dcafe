"""The install's bounds on what a BatchTuning may make the operator do: images, URLs, GPU time.

The author of a BatchTuning is less trusted than the operator. A spec can name only the load images
the install lists (the operator's own image by default), only Prometheus URLs under the install's
prefixes (never loopback unless a prefix names it, link-local, multicast or cloud-metadata addresses in
any spelling: `core.addresses`), and at most the install's GPU-minute ceiling. Prefixes are matched on
the canonical URL (scheme, host, port, path), never as text. Each check returns why a value is refused,
naming the field, or None.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from batchtune.core.addresses import Endpoint, UrlError, endpoint, host_problem, is_loopback_host


def _shown(value: str, limit: int = 120) -> str:
    return repr(value if len(value) <= limit else value[:limit] + "...")


@dataclass(frozen=True)
class UrlCheck:
    """What the URL rules say of one URL: why it is refused, or where it goes and whether loopback may answer."""

    problem: str | None
    endpoint: Endpoint | None = None
    loopback_allowed: bool = False
    """An allowed prefix names a loopback host itself (`http://127.0.0.1:9090/`): only then may loopback answer."""


@dataclass(frozen=True)
class _Prefix:
    """An install's allowed-URL prefix, canonical: scheme, and unless the prefix is `http://` alone, host, port
    (any when the prefix is a bare `scheme://host`) and path."""

    scheme: str
    where: Endpoint | None
    any_port: bool

    @staticmethod
    def parse(text: str) -> _Prefix | None:
        scheme, sep, rest = text.partition("://")
        if sep and not rest and scheme.lower() in ("http", "https"):
            return _Prefix(scheme.lower(), None, True)
        try:
            where = endpoint(text)
        except UrlError:
            return None  # a prefix no URL can be under
        return _Prefix(where.scheme, where, not where.port_given and "/" not in rest)

    def holds(self, url: Endpoint) -> bool:
        if url.scheme != self.scheme:
            return False
        if self.where is None:
            return True
        return url.host == self.where.host and (self.any_port or url.port == self.where.port) and \
            url.path.startswith(self.where.path)


def prometheus_url_check(url: str, allowed_prefixes: Sequence[str]) -> UrlCheck:
    """The URL rules for `spec.prometheus.url` (no prefixes: the install-independent rules alone)."""
    return _url_check(url, allowed_prefixes, "spec.prometheus.url", "Prometheus URL", "prometheus.allowedUrls",
                      "spec.prometheus.authSecretRef")


def prometheus_url_problem(url: str, allowed_prefixes: Sequence[str]) -> str | None:
    """Why `spec.prometheus.url` may not be queried, or None."""
    return prometheus_url_check(url, allowed_prefixes).problem


def git_url_problem(url: str, allowed_prefixes: Sequence[str], field: str = "spec.apply.git.url") -> str | None:
    """Why a Git repository (or forge API) URL may not be used, or None. No prefixes: no Git at all."""
    if not allowed_prefixes:
        return (f"{field} {_shown(url)}: this install allows no Git repository (Helm value git.allowedUrls); "
                "use spec.apply.mode Recommend")
    return _url_check(url, allowed_prefixes, field, "Git URL", "git.allowedUrls",
                      "spec.apply.git.credentialsSecretRef").problem


def _url_check(url: str, allowed_prefixes: Sequence[str], field: str, what: str, helm_value: str,
               secret_field: str) -> UrlCheck:
    try:
        where = endpoint(url)
    except UrlError as exc:
        hint = f" (use {secret_field})" if str(exc) == "must not carry credentials" else ""
        return UrlCheck(f"{field} {_shown(url)} {exc}{hint}")
    # Loopback answers only where the install names a loopback host itself (the local cluster, the tests).
    under = [p for p in (_Prefix.parse(text) for text in allowed_prefixes) if p is not None and p.holds(where)]
    loopback = any(p.where is not None and is_loopback_host(p.where) for p in under)
    problem = host_problem(where, loopback_allowed=loopback)
    if problem:
        return UrlCheck(f"{field} {_shown(url)} points at {problem}; the operator never queries it")
    if allowed_prefixes and not under:
        return UrlCheck(f"{field} {_shown(url)} is not under a {what} this install allows "
                        f"({', '.join(allowed_prefixes)}; Helm value {helm_value})")
    return UrlCheck(None, where, loopback)


# An image reference as the container runtime reads it (distribution/reference's grammar, IPv6 hosts aside):
# [host[:port]/]path[:tag][@algorithm:hex]. RE2 and Python read it alike; the CRD's CEL rule holds a copy.
_DOMAIN_PART = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_PATH_PART = r"[a-z0-9]+(?:(?:[._]|__|[-]+)[a-z0-9]+)*"
# A first component is a registry only when it has a dot or a port or is localhost (as the runtime reads it).
_DOMAIN = rf"(?:localhost(?::[0-9]+)?|{_DOMAIN_PART}(?:\.{_DOMAIN_PART})+(?::[0-9]+)?|{_DOMAIN_PART}:[0-9]+)"
IMAGE_REFERENCE = (rf"^(?:{_DOMAIN}/)?{_PATH_PART}(?:/{_PATH_PART})*"
                   r"(?::[a-zA-Z0-9_][a-zA-Z0-9_.-]{0,127})?(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*"
                   r":[0-9a-fA-F]{32,})?$")
IMAGE_REFERENCE_MESSAGE = "is not an image reference"


def image_reference_problem(image: str) -> str | None:
    """Why `image` is not an image reference a container runtime would pull, or None."""
    return None if len(image) <= 512 and re.fullmatch(IMAGE_REFERENCE, image) else IMAGE_REFERENCE_MESSAGE


def load_image_problem(image: str | None, operator_image: str, allowed: Sequence[str]) -> str | None:
    """Why `spec.load.image` may not run, or None (unset: the operator's own image)."""
    if image is None or image == operator_image:
        return None
    if image_reference_problem(image):
        return f"spec.load.image {_shown(image)} {IMAGE_REFERENCE_MESSAGE}"
    if image in allowed:
        return None
    listed = ", ".join([operator_image, *allowed])
    return (f"spec.load.image {_shown(image)} is not an image this install allows ({listed}; "
            "Helm value load.allowedImages)")


def gpu_minutes_budget(spec_budget: int | None, ceiling: int) -> int:
    """The GPU-minutes a tuning may spend: the spec's budget, never above the install's ceiling."""
    return ceiling if spec_budget is None else min(spec_budget, ceiling)
