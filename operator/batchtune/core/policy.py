"""The install's bounds on what a BatchTuning may make the operator do: images, URLs, GPU time.

The author of a BatchTuning is less trusted than the operator. A spec can name only the load images
the install lists (the operator's own image by default), only Prometheus URLs under the install's
prefixes (never link-local or cloud-metadata addresses, never control characters), and at most the
install's GPU-minute ceiling. Each check returns why a value is refused, naming the field, or None.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from urllib.parse import urlsplit

# Cloud metadata services answer on these names and addresses; no BatchTuning may point Prometheus there.
_METADATA_HOSTS = frozenset({"metadata.google.internal", "metadata", "metadata.azure.com", "instance-data",
                             "instance-data.ec2.internal", "100.100.100.200", "fd00:ec2::254"})


def _shown(value: str, limit: int = 120) -> str:
    return repr(value if len(value) <= limit else value[:limit] + "...")


def prometheus_url_problem(url: str, allowed_prefixes: Sequence[str]) -> str | None:
    """Why `spec.prometheus.url` may not be queried, or None."""
    return _url_problem(url, allowed_prefixes, "spec.prometheus.url", "Prometheus URL", "prometheus.allowedUrls",
                        "spec.prometheus.authSecretRef")


def git_url_problem(url: str, allowed_prefixes: Sequence[str], field: str = "spec.apply.git.url") -> str | None:
    """Why a Git repository (or forge API) URL may not be used, or None. No prefixes: no Git at all."""
    if not allowed_prefixes:
        return (f"{field} {_shown(url)}: this install allows no Git repository (Helm value git.allowedUrls); "
                "use spec.apply.mode Recommend")
    return _url_problem(url, allowed_prefixes, field, "Git URL", "git.allowedUrls", "spec.apply.git.credentialsSecretRef")


def _url_problem(url: str, allowed_prefixes: Sequence[str], field: str, what: str, helm_value: str,
                 secret_field: str) -> str | None:
    if any(ord(c) < 33 or ord(c) == 127 for c in url):
        return f"{field} {_shown(url)} contains whitespace or control characters"
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        parts.port  # noqa: B018  # raises on a port that is not a number
    except ValueError as exc:
        return f"{field} {_shown(url)} is not a URL: {exc}"
    if parts.scheme not in ("http", "https") or not host:
        return f"{field} {_shown(url)} must be an http:// or https:// URL with a host"
    if parts.username or parts.password:
        return f"{field} {_shown(url)} must not carry credentials (use {secret_field})"
    if host.lower().rstrip(".") in _METADATA_HOSTS:
        return f"{field} {_shown(url)} points at a cloud metadata service"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = None
    if address is not None and (address.is_link_local or address.is_multicast or address.is_unspecified):
        return f"{field} {_shown(url)} points at a link-local, multicast or unspecified address"
    if allowed_prefixes and not any(url.startswith(prefix) for prefix in allowed_prefixes):
        return (f"{field} {_shown(url)} is not under a {what} this install allows "
                f"({', '.join(allowed_prefixes)}; Helm value {helm_value})")
    return None


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
