"""A Prometheus URL is an address: every spelling of a refused host is refused (issue 22, section 1).

One test per class of hostile input, each over many spellings; the resolver, redirect and server cases
are in test_prometheus_bounds.py.
"""

from __future__ import annotations

import ipaddress

import pytest

from batchtune.core.addresses import address_problem, embedded_ipv4, endpoint
from batchtune.core.policy import prometheus_url_check, prometheus_url_problem

METADATA_V4 = "169.254.169.254"

# Every legal IPv4 spelling of 169.254.169.254 (inet_aton: decimal, octal, hex, 1 to 4 parts, mixed).
IPV4_SPELLINGS = [
    "2852039166", "0xa9fea9fe", "0xA9FEA9FE", "025177524776", "0251.0376.0251.0376", "0xa9.0xfe.0xa9.0xfe",
    "169.254.43518", "169.16689662", "0251.254.0xa9.254", "169.254.169.254.", "0xa9fea9fe.", "00000251.254.169.254",
    "169.0xfe.169.0376", "0x0a9.254.169.254", "169.254.0xa9fe",
]
# The same in IPv6: IPv4-mapped, NAT64 (well-known prefix), IPv4-translated, IPv4-compatible, 6to4.
IPV6_FORMS = [
    "[::ffff:169.254.169.254]", "[::ffff:a9fe:a9fe]", "[0:0:0:0:0:ffff:a9fe:a9fe]", "[::FFFF:A9FE:A9FE]",
    "[64:ff9b::a9fe:a9fe]", "[64:ff9b::169.254.169.254]", "[0064:ff9b:0000::a9fe:a9fe]",
    "[::ffff:0:a9fe:a9fe]", "[::169.254.169.254]", "[2002:a9fe:a9fe::1]",
    "[::ffff:100.100.100.200]", "[64:ff9b::6464:64c8]", "[::ffff:127.0.0.1]", "[64:ff9b::7f00:1]",
]
# AWS's IPv6 metadata address, written every way RFC 4291 allows, and its /64 neighbours.
FD00_EC2 = [
    "[fd00:ec2::254]", "[FD00:EC2::254]", "[fd00:0ec2::254]", "[fd00:ec2:0:0:0:0:0:254]", "[fd00:ec2:0::0:254]",
    "[fd00:0ec2:0000:0000:0000:0000:0000:0254]", "[fd00:ec2::123]", "[fd00:ec2::1:254]",
]
METADATA_NAMES = [
    "metadata.google.internal", "METADATA.GOOGLE.INTERNAL", "metadata.google.internal.", "metadata.goog",
    "metadata", "instance-data", "instance-data.ec2.internal", "metadata.azure.com", "metadata.tencentyun.com",
    "\uff4d\uff45\uff54\uff41\uff44\uff41\uff54\uff41.google.internal",  # fullwidth letters (IDNA maps them)
    "metadata\u3002google\u3002internal",                                    # ideographic full stops
]
OTHER_REFUSED_ADDRESSES = [
    "100.100.100.200", "1684301000", "168.63.129.16", "127.0.0.1", "127.1", "0x7f000001", "2130706433",
    "0177.0.0.1", "[::1]", "[0:0:0:0:0:0:0:1]", "localhost", "LOCALHOST.", "api.localhost", "0.0.0.0", "0",
    "0.1.2.3", "[::]", "224.0.0.1", "[ff02::1]", "255.255.255.255", "240.0.0.1", "[fe80::1]", "169.254.0.1",
    "[64:ff9b:1::a9fe:a9fe]",
    "\uff11\uff16\uff19.\uff12\uff15\uff14.\uff11\uff16\uff19.\uff12\uff15\uff14",  # fullwidth digits
]
PERCENT_ENCODED_HOSTS = [
    "169.254.169.254%2f", "%31%36%39.254.169.254", "169%2e254%2e169%2e254", "metadata%2egoogle%2einternal",
    "[fe80::1%25eth0]", "[::ffff:169.254.169.254%25lo]", "prom%00.example.com", "prom%2fexample",
]
MALFORMED_HOSTS = [
    "169.254.169.254.1", "256.254.169.254", "169.254.169.0x100", "0x1.0x2.0x3.0x4.0x5", "09.1.1.1",
    "prom.123", "prom..example", ".prom", "-prom", "prom-", "a" * 64 + ".example", "[::ffff:169.254.169.254",
    "[1.2.3.4]", "[::1]x", "fe80::1", "xn--", "\u00ad",
]
FRAGMENTS_AND_QUERIES = [
    "http://prom:9090/#/api/v1/admin/tsdb/delete_series", "http://prom:9090#x", "http://prom:9090/api/#",
    "http://prom:9090/?", "http://prom:9090/?query=up", "http://prom:9090?x=1", "http://prom:9090/a?b#c",
    "http://prom:9090/%23", "http://prom:9090/%3f", "http://prom:9090/a/../../latest/meta-data",
    "http://prom:9090/./x", "http://prom:9090/%2e%2e/x", "http://prom:9090/\u00e9",
]
CREDENTIALS = [
    "http://user@prom:9090", "http://user:pw@prom:9090", "http://:pw@prom:9090", "http://@prom:9090",
    "http://prom:9090@169.254.169.254/", "http://prom@169.254.169.254:80/", "http://user%40x@prom/",
    "http://prom\\@169.254.169.254/", "http://prom:9090\\@169.254.169.254/x",
]
CONTROL_AND_SPACE = [
    "http://prom:9090/\t", "http://prom\x00:9090", "http://prom:9090/\x1b[31m", "http://prom:9090/\u2028",
    "http://prom:9090/\u00a0", "http://prom:9090/\u200b", "http://pr om:9090", "http://prom:9090/\x85",
    "http://prom:9090/\u3000", " http://prom:9090", "http://prom: 80", "http://prom:9090/\n",
]
EMPTY_HOSTS = ["http://", "http:///", "http://:9090", "http://:9090/api", "https://?x", "http://[]:9090",
               "http://.", "http://./", "HTTP://"]
BAD_PORTS = ["http://prom:0", "http://prom:65536", "http://prom:-1", "http://prom:+80", "http://prom:\uff18\uff10",
             "http://prom:80:80", "http://prom:", "http://prom:99999999999999999999", "http://prom:0x50"]


def url(host: str, rest: str = "/api") -> str:
    return f"http://{host}{rest}"


@pytest.mark.parametrize("host", IPV4_SPELLINGS)
def test_every_ipv4_spelling_of_the_metadata_address_is_refused(host):
    problem = prometheus_url_problem(url(host), [])
    assert problem is not None and METADATA_V4 in problem and "link-local" in problem, problem


@pytest.mark.parametrize("host", IPV6_FORMS)
def test_ipv6_forms_of_a_refused_ipv4_address_are_refused(host):
    problem = prometheus_url_problem(url(host, ":9090/"), [])
    assert problem is not None and "IPv6 form of" in problem, problem


@pytest.mark.parametrize("host", FD00_EC2)
def test_every_spelling_of_aws_ipv6_metadata_is_refused(host):
    problem = prometheus_url_problem(url(host), [])
    assert problem is not None and "cloud metadata address" in problem, problem


@pytest.mark.parametrize("host", METADATA_NAMES)
def test_metadata_names_are_refused_in_any_case_and_script(host):
    problem = prometheus_url_problem(url(host), [])
    assert problem is not None and "cloud metadata service" in problem, problem


@pytest.mark.parametrize("host", OTHER_REFUSED_ADDRESSES)
def test_loopback_unspecified_multicast_reserved_and_metadata_addresses_are_refused(host):
    problem = prometheus_url_problem(url(host, ":9090/"), [])
    assert problem is not None and "points at" in problem, problem


@pytest.mark.parametrize("host", PERCENT_ENCODED_HOSTS)
def test_a_percent_encoded_host_is_refused(host):
    problem = prometheus_url_problem(url(host), [])
    assert problem is not None and "percent-encoding" in problem, problem


@pytest.mark.parametrize("host", MALFORMED_HOSTS)
def test_a_host_that_is_neither_an_address_nor_a_name_is_refused(host):
    problem = prometheus_url_problem(url(host), [])
    assert problem is not None and "spec.prometheus.url" in problem, problem


@pytest.mark.parametrize("text", FRAGMENTS_AND_QUERIES)
def test_a_fragment_query_or_path_trick_is_refused(text):
    problem = prometheus_url_problem(text, [])
    assert problem is not None and any(w in problem for w in ("fragment", "query", "path")), problem


@pytest.mark.parametrize("text", CREDENTIALS)
def test_userinfo_in_any_position_is_refused(text):
    problem = prometheus_url_problem(text, [])
    assert problem is not None and ("credentials" in problem or "backslash" in problem), problem


@pytest.mark.parametrize("text", CONTROL_AND_SPACE)
def test_control_characters_and_unicode_spaces_are_refused(text):
    problem = prometheus_url_problem(text, [])
    assert problem is not None and "whitespace or control characters" in problem, problem


@pytest.mark.parametrize("text", EMPTY_HOSTS)
def test_an_empty_host_is_refused(text):
    problem = prometheus_url_problem(text, [])
    assert problem is not None and "with a host" in problem, problem


@pytest.mark.parametrize("text", BAD_PORTS)
def test_a_port_that_is_not_1_to_65535_is_refused(text):
    problem = prometheus_url_problem(text, [])
    assert problem is not None and ("port" in problem or "IPv6" in problem), problem


def test_the_hostile_inputs_count():
    """Every spelling is a distinct input (a copy would make a class look bigger than it is)."""
    every = [*IPV4_SPELLINGS, *IPV6_FORMS, *FD00_EC2, *METADATA_NAMES, *OTHER_REFUSED_ADDRESSES,
             *PERCENT_ENCODED_HOSTS, *MALFORMED_HOSTS, *FRAGMENTS_AND_QUERIES, *CREDENTIALS, *CONTROL_AND_SPACE,
             *EMPTY_HOSTS, *BAD_PORTS]
    assert len(every) == len(set(every)) >= 150


# ---- what stays allowed, and what an install may allow ------------------------------------------

@pytest.mark.parametrize("text, canonical", [
    pytest.param("http://Prometheus.Monitoring.svc:9090", "http://prometheus.monitoring.svc:9090/", id="case"),
    pytest.param("HTTP://prom:80/x", "http://prom/x", id="default-port"),
    pytest.param("https://10.0.0.5:443", "https://10.0.0.5/", id="private-ip"),
    pytest.param("http://010.0.0.5:9090/", "http://8.0.0.5:9090/", id="octal-is-read-as-octal"),
    pytest.param("http://[2001:DB8::1]:9090/api/", "http://[2001:db8::1]:9090/api/", id="ipv6"),
    pytest.param("https://b\u00fccher.example/prom", "https://xn--bcher-kva.example/prom", id="idna"),
    pytest.param("http://thanos-query.monitoring.svc.cluster.local.:10902", "http://thanos-query.monitoring.svc."
                 "cluster.local:10902/", id="trailing-dot"),
])
def test_an_allowed_url_is_read_in_canonical_form(text, canonical):
    check = prometheus_url_check(text, [])
    assert check.problem is None and check.endpoint is not None and check.endpoint.url == canonical


@pytest.mark.parametrize("text, prefixes, allowed", [
    pytest.param("http://127.0.0.1:9090", ["http://127.0.0.1:9090/"], True, id="the-local-cluster"),
    pytest.param("http://127.0.0.1:9", ["http://127.0.0.1"], True, id="a-bare-host-prefix-is-any-port"),
    pytest.param("http://localhost:9090/", ["http://localhost:9090/"], True, id="localhost-named"),
    pytest.param("http://2130706433:9090/", ["http://127.0.0.1:9090/"], True, id="same-address-other-spelling"),
    pytest.param("http://127.0.0.1:9090", ["http://"], False, id="any-url-is-not-loopback"),
    pytest.param("http://127.0.0.1:9090", ["http://127.0.0.2:9090/"], False, id="another-loopback"),
    pytest.param("http://127.0.0.1:9091", ["http://127.0.0.1:9090/"], False, id="another-port"),
    pytest.param("http://localhost:9090", ["http://127.0.0.1:9090/"], False, id="a-name-is-not-the-address"),
])
def test_loopback_answers_only_where_an_allowed_prefix_names_it(text, prefixes, allowed):
    check = prometheus_url_check(text, prefixes)
    assert (check.problem is None) is allowed, check.problem
    assert check.loopback_allowed is allowed


@pytest.mark.parametrize("text, prefixes", [
    pytest.param("http://prom.attacker.example:9090", ["http://prom"], id="bare-prefix-is-a-host-not-text"),
    pytest.param("http://prom:9090@evil/", ["http://prom:9090"], id="userinfo-after-an-allowed-prefix"),
    pytest.param("http://prom:90901/", ["http://prom:9090"], id="longer-port"),
    pytest.param("http://prom:9090/other", ["http://prom:9090/prometheus/"], id="another-path"),
    pytest.param("http://prom:9090/prometheus/../api", ["http://prom:9090/prometheus/"], id="dot-segments"),
    pytest.param("https://prom:9090/", ["http://prom:9090/"], id="another-scheme"),
])
def test_a_prefix_is_matched_on_the_canonical_url_not_as_text(text, prefixes):
    assert prometheus_url_problem(text, prefixes) is not None


@pytest.mark.parametrize("text, prefixes", [
    pytest.param("http://PROM:9090/api", ["http://prom:9090/"], id="host-case"),
    pytest.param("http://prom:9090", ["http://prom:9090/"], id="the-slash-a-url-implies"),
    pytest.param("http://10.1.2.3:9090/", ["http://10.1.2.3:9090/"], id="address"),
    pytest.param("http://167838211:9090/", ["http://10.1.2.3:9090/"], id="address-in-another-spelling"),
])
def test_the_same_url_spelled_otherwise_is_under_its_prefix(text, prefixes):
    assert prometheus_url_problem(text, prefixes) is None


@pytest.mark.parametrize("address, inner", [
    ("::ffff:1.2.3.4", "1.2.3.4"), ("64:ff9b::102:304", "1.2.3.4"), ("2002:102:304::", "1.2.3.4"),
    ("::ffff:0:102:304", "1.2.3.4"), ("::102:304", "1.2.3.4"), ("2001:db8::1", None), ("::1", None),
])
def test_the_ipv4_an_ipv6_address_delivers_to(address, inner):
    got = embedded_ipv4(ipaddress.IPv6Address(address))
    assert (str(got) if got else None) == inner


def test_a_public_or_private_address_may_be_dialled():
    for text in ("10.0.0.5", "192.168.1.1", "8.8.8.8", "2001:db8::1", "fd12:3456::1", "::ffff:10.0.0.5"):
        assert address_problem(ipaddress.ip_address(text)) is None, text


def test_endpoint_carries_the_address_of_a_literal_and_none_for_a_name():
    assert endpoint("http://0x0a000005:9090").address == ipaddress.IPv4Address("10.0.0.5")
    assert endpoint("http://prom:9090").address is None
