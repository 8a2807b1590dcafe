"""The install's bounds on a BatchTuning: Prometheus URLs and load images."""

from __future__ import annotations

import pytest

from batchtune.core.policy import gpu_minutes_budget, load_image_problem, prometheus_url_problem


@pytest.mark.parametrize("url, allowed", [
    pytest.param("http://prometheus.monitoring:9090", [], id="in-cluster"),
    pytest.param("https://prom.example.com/api", [], id="https"),
    pytest.param("http://10.0.0.5:9090", [], id="private-ip"),
    pytest.param("http://prometheus.monitoring:9090", ["http://prometheus.monitoring"], id="under-an-allowed-prefix"),
])
def test_prometheus_url_allowed(url, allowed):
    assert prometheus_url_problem(url, allowed) is None


@pytest.mark.parametrize("url, allowed, fragment", [
    pytest.param("http://169.254.169.254/latest/meta-data", [], "link-local", id="aws-metadata-ip"),
    pytest.param("http://[fe80::1]:9090", [], "link-local", id="ipv6-link-local"),
    pytest.param("http://metadata.google.internal/computeMetadata/v1", [], "cloud metadata", id="gce-metadata"),
    pytest.param("http://metadata.google.internal./x", [], "cloud metadata", id="gce-metadata-trailing-dot"),
    pytest.param("http://0.0.0.0:9090", [], "unspecified", id="unspecified"),
    pytest.param("http://prom:9090/\r\nX-Injected: 1", [], "control characters", id="crlf"),
    pytest.param("http://prom:9090/a b", [], "whitespace", id="space"),
    pytest.param("http://prom:9090/\x7f", [], "control characters", id="del"),
    pytest.param("http://user:secret@prom:9090", [], "credentials", id="credentials"),
    pytest.param("http://user@prom:9090", [], "credentials", id="username"),
    pytest.param("ftp://prom:9090", [], "http:// or https://", id="scheme"),
    pytest.param("http://", [], "with a host", id="no-host"),
    pytest.param("http://prom:port", [], "is not a URL", id="bad-port"),
    pytest.param("http://evil.example.com:9090", ["http://prometheus.monitoring"], "not under a Prometheus URL", id="not-allowed"),
])
def test_prometheus_url_refused(url, allowed, fragment):
    problem = prometheus_url_problem(url, allowed)
    assert problem is not None and fragment in problem and "spec.prometheus.url" in problem


@pytest.mark.parametrize("image, problem", [
    pytest.param(None, None, id="unset-is-the-operator"),
    pytest.param("ghcr.io/batchtune/operator:1.0", None, id="the-operator-image"),
    pytest.param("registry/loadgen:2", None, id="listed"),
    pytest.param("registry/other:1", "is not an image this install allows", id="not-listed"),
    pytest.param("registry/loadgen:2; rm -rf /", "is not an image reference", id="shell"),
    pytest.param("registry/$(x)", "is not an image reference", id="expansion"),
])
def test_load_image_problem(image, problem):
    got = load_image_problem(image, "ghcr.io/batchtune/operator:1.0", ["registry/loadgen:2"])
    assert (got is None) if problem is None else (got is not None and problem in got and "spec.load.image" in got)


@pytest.mark.parametrize("spec, ceiling, budget", [
    pytest.param(None, 600, 600, id="unset-is-the-ceiling"),
    pytest.param(120, 600, 120, id="below"),
    pytest.param(6000, 600, 600, id="never-above"),
])
def test_gpu_minutes_budget(spec, ceiling, budget):
    assert gpu_minutes_budget(spec, ceiling) == budget


def test_refusals_name_the_field_and_quote_the_value():
    assert prometheus_url_problem("ftp://prom:9090", []) == \
        "spec.prometheus.url 'ftp://prom:9090' must be an http:// or https:// URL with a host"
    assert prometheus_url_problem("http://evil:9090", ["http://a", "http://b"]) == (
        "spec.prometheus.url 'http://evil:9090' is not under a Prometheus URL this install allows "
        "(http://a, http://b; Helm value prometheus.allowedUrls)")
    assert load_image_problem("registry/other:1", "op:1", ["registry/a:1", "registry/b:2"]) == (
        "spec.load.image 'registry/other:1' is not an image this install allows (op:1, registry/a:1, registry/b:2; "
        "Helm value load.allowedImages)")
    assert load_image_problem("a b", "op:1", []) == "spec.load.image 'a b' is not an image reference"


def test_a_long_value_is_quoted_up_to_120_characters():
    exact = "http://prom/" + "p" * 108  # a host label is at most 63 characters: the length is in the path
    assert prometheus_url_problem(exact, ["https://"]).startswith(f"spec.prometheus.url {exact!r} is not under")
    long = exact + "q"
    assert prometheus_url_problem(long, ["https://"]).startswith(f"spec.prometheus.url {exact + '...'!r} is not under")


@pytest.mark.parametrize("url", [
    pytest.param("http://prom:9090/api!x", id="exclamation-mark-is-the-first-printable"),
    pytest.param("http://prom:9090/~x", id="tilde-is-the-last-printable"),
])
def test_printable_ascii_is_allowed(url):
    assert prometheus_url_problem(url, []) is None


@pytest.mark.parametrize("image", [
    pytest.param("registry/loadgen:2 ", id="trailing-space"),
    pytest.param("registry/loadgen:2\n", id="newline"),
    *(pytest.param(f"registry/x{c}y:1", id=f"metachar-{ord(c)}") for c in ";&|`$()<>\\'\""),
])
def test_an_image_with_shell_or_space_is_no_reference_even_if_listed(image):
    assert load_image_problem(image, "op:1", [image]) == f"spec.load.image {image!r} is not an image reference"


def test_only_the_operator_image_and_listed_images_run():
    assert load_image_problem("op:1", "op:1", []) is None
    assert load_image_problem("registry/a:1", "op:1", ["registry/a:1"]) is None
    assert load_image_problem("registry/a:1", "op:1", []) is not None


def test_a_tag_may_hold_any_letter():
    assert load_image_problem("registry/loadgen:X1-rc", "op:1", ["registry/loadgen:X1-rc"]) is None
