"""Where an http(s) URL sends the operator, read as the network reads it: an address, never a string.

A host is canonicalised in every spelling a resolver or an HTTP library accepts: IPv4 in decimal, octal,
hex and short forms (`2852039166`, `0251.0376.0251.0376`, `0xa9fea9fe`, `169.254.43518`), IPv6 with or
without embedded IPv4, internationalised names (IDNA, fullwidth digits and dots). A host with
percent-encoding, a zone, a backslash or userinfo is refused rather than guessed at, as is a URL with a
query or a fragment (either would pick the path requested). `address_problem` says why an address may
not be dialled; the edge that resolves a name checks every address it gets with it.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

METADATA_NAMES = frozenset({
    "metadata.google.internal", "metadata.goog", "metadata", "metadata.azure.com", "instance-data",
    "instance-data.ec2.internal", "metadata.tencentyun.com", "metadata.platformequinix.com",
})
"""Names cloud providers document for their instance metadata services (GCE, Azure, AWS, Tencent, Equinix)."""

METADATA_NETWORKS = tuple(ipaddress.ip_network(n) for n in (
    "169.254.0.0/16",      # AWS, GCE, Azure, OpenStack, Oracle, DigitalOcean, Tencent (169.254.0.23)
    "fd00:ec2::/64",       # AWS IMDS and Time Sync over IPv6 (fd00:ec2::254, fd00:ec2::123)
    "100.100.100.200/32",  # Alibaba Cloud
    "168.63.129.16/32",    # Azure WireServer
))
"""Addresses that answer with a node's or a cloud account's credentials."""

_NAT64 = ipaddress.ip_network("64:ff9b::/96")        # RFC 6052: the well-known prefix, IPv4 in the last 32 bits
_NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")  # RFC 8215: local-use, the IPv4's position is the site's
_THIS_NETWORK = ipaddress.ip_network("0.0.0.0/8")      # Linux dials 0.x.y.z as the host itself
_RESERVED = ipaddress.ip_network("240.0.0.0/4")        # class E and the broadcast address
_LABEL = re.compile(r"[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?")
_NUMBER = re.compile(r"(0x[0-9a-f]*|[0-9]+)")
_PATH = re.compile(r"[A-Za-z0-9._~!$&'()*+,;=:@/-]*")
DEFAULT_PORTS = {"http": 80, "https": 443}


class UrlError(ValueError):
    """Why a URL is not one the operator may dial; the text fits after "URL 'x' "."""


@dataclass(frozen=True)
class Endpoint:
    """A URL in canonical form: the scheme, the host as the network reads it, the port and the path."""

    scheme: str
    host: str
    """An IP address in its standard text (IPv6 without brackets), or an ASCII (IDNA) lower-case name."""
    port: int
    path: str
    """Starts with `/`; `/` when the URL had none."""
    address: IPAddress | None
    """The host when it is an IP address (no resolution needed), else None."""
    port_given: bool = True

    @property
    def authority(self) -> str:
        """`host[:port]` as the Host header and the URL carry it (the default port left out)."""
        host = f"[{self.host}]" if isinstance(self.address, ipaddress.IPv6Address) else self.host
        return host if self.port == DEFAULT_PORTS[self.scheme] else f"{host}:{self.port}"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.authority}{self.path}"


def endpoint(url: str) -> Endpoint:
    """`url` in canonical form, or `UrlError` saying what in it is refused."""
    if any(ord(c) < 33 or ord(c) == 127 or c in "\x85\xa0\u1680\u2028\u2029\u3000" or "\u2000" <= c <= "\u200b"
           for c in url):
        raise UrlError("contains whitespace or control characters")
    if "\\" in url:
        raise UrlError("contains a backslash (HTTP libraries disagree on what it means)")
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in DEFAULT_PORTS or not rest or rest[0] in "/?#":
        raise UrlError("must be an http:// or https:// URL with a host")
    if "#" in rest:
        raise UrlError("has a fragment (#...): the URL names the server, the operator picks the path")
    if "?" in rest:
        raise UrlError("has a query (?...): the URL names the server, the operator picks the path")
    authority, slash, path = rest.partition("/")
    path = slash + path
    if "@" in authority:
        raise UrlError("must not carry credentials")
    host_text, port, port_given = _split_port(authority)
    host, address = canonical_host(host_text)
    if not path.isascii() or not _PATH.fullmatch(path) or "%" in path:
        raise UrlError("has a path with characters other than letters, digits and -._~!$&'()*+,;=:@/ "
                       "(no percent-encoding)")
    if any(segment in (".", "..") for segment in path.split("/")):
        raise UrlError("has . or .. segments in its path")
    return Endpoint(scheme, host, port if port_given else DEFAULT_PORTS[scheme], path or "/", address, port_given)


def _split_port(authority: str) -> tuple[str, int, bool]:
    if authority.startswith("["):
        host, bracket, after = authority[1:].partition("]")
        if not bracket or (after and not after.startswith(":")):
            raise UrlError("is not a URL: an IPv6 host must be written [address] or [address]:port")
        host = "[" + host + "]"
        port_text = after[1:] if after else None
    elif authority.count(":") > 1:
        raise UrlError("is not a URL: an IPv6 host must be written in brackets")
    else:
        host, colon, port_text_or = authority.partition(":")
        port_text = port_text_or if colon else None
    if port_text is None:
        return host, 0, False
    if not port_text.isascii() or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise UrlError(f"is not a URL: port {port_text!r} is not a number from 1 to 65535")
    return host, int(port_text), True


def canonical_host(host: str) -> tuple[str, IPAddress | None]:
    """(canonical host, its address when it is one); `UrlError` for a host no spelling makes safe to read."""
    if host in ("", ".", "[]"):
        raise UrlError("must be an http:// or https:// URL with a host")
    if "%" in host:
        raise UrlError("has percent-encoding or a zone in its host")
    if host.startswith("["):
        try:
            v6 = ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise UrlError(f"has an IPv6 host {host[:60]!r} that is not an IPv6 address") from None
        return str(v6), v6
    if not host.isascii():
        try:
            host = host.encode("idna").decode("ascii")
        except UnicodeError:
            raise UrlError("has a host that is not a valid internationalised name (IDNA)") from None
    host = host.lower()
    if host.endswith("."):
        host = host[:-1]
    labels = host.split(".")
    if labels and _NUMBER.fullmatch(labels[-1]):
        # A resolver reads a name ending in a number as IPv4 (inet_aton); so does the WHATWG URL parser.
        v4 = _legacy_ipv4(labels)
        return str(v4), v4
    if len(host) > 253 or not all(_LABEL.fullmatch(label) for label in labels):
        raise UrlError("has a host that is not a DNS name (letters, digits, '-' and '_' in dot-separated labels)")
    return host, None


def _legacy_ipv4(labels: list[str]) -> ipaddress.IPv4Address:
    """inet_aton's reading: 1 to 4 parts, each decimal, 0-octal or 0x-hex, the last filling the remaining bytes."""
    if not 1 <= len(labels) <= 4 or not all(_NUMBER.fullmatch(label) for label in labels):
        raise UrlError("has a host ending in a number that is not an IPv4 address")
    try:
        parts = [int(p[2:] or "0", 16) if p.startswith("0x") else int(p, 8) if len(p) > 1 and p[0] == "0"
                 else int(p) for p in labels]
    except ValueError:  # 08, 09: not octal
        raise UrlError("has a host ending in a number that is not an IPv4 address") from None
    *head, last = parts
    if any(p > 255 for p in head) or last >= 256 ** (4 - len(head)):
        raise UrlError("has a host ending in a number that is not an IPv4 address")
    value = 0
    for p in head:
        value = value * 256 + p
    return ipaddress.IPv4Address(value * 256 ** (4 - len(head)) + last)


def embedded_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address delivers to: IPv4-mapped, NAT64 (well-known prefix), 6to4,
    IPv4-translated, IPv4-compatible; None when it carries none."""
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address in _NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    if address.sixtofour is not None:
        return address.sixtofour
    if int(address) >> 32 == 0xFFFF0000:  # ::ffff:0:a.b.c.d (RFC 2765, IPv4-translated)
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    if int(address) >> 32 == 0 and int(address) > 1:  # ::a.b.c.d (deprecated IPv4-compatible)
        return ipaddress.IPv4Address(int(address))
    return None


def address_problem(address: IPAddress, *, loopback_allowed: bool = False) -> str | None:
    """Why the operator may not dial `address` ("... is a link-local address"), or None."""
    inner = embedded_ipv4(address) if isinstance(address, ipaddress.IPv6Address) else None
    if inner is not None:
        problem = address_problem(inner, loopback_allowed=loopback_allowed)
        return f"{address} is an IPv6 form of {problem}" if problem else None
    if address in _NAT64_LOCAL:
        return f"{address} is a local-use NAT64 address (the IPv4 address it reaches cannot be checked)"
    if address.is_link_local:
        return f"{address} is a link-local address (where cloud metadata services answer)"
    if any(address in network for network in METADATA_NETWORKS):
        return f"{address} is a cloud metadata address"
    for what, holds in (("unspecified", address.is_unspecified or address in _THIS_NETWORK),
                        ("multicast", address.is_multicast),
                        ("reserved or broadcast", address in _RESERVED),
                        ("loopback", address.is_loopback and not loopback_allowed)):
        if holds:
            return f"{address} is a{'n' if what[0] in 'aeiou' else ''} {what} address"
    return None


def host_problem(where: Endpoint, *, loopback_allowed: bool = False) -> str | None:
    """What the host alone (before any resolution) says is refused: a metadata name, or a refused address."""
    if where.address is not None:
        return address_problem(where.address, loopback_allowed=loopback_allowed)
    if where.host in METADATA_NAMES:
        return f"{where.host} is a cloud metadata service"
    if where.host == "localhost" or where.host.endswith(".localhost"):
        return None if loopback_allowed else f"{where.host} is a loopback name"
    return None


def is_loopback_host(where: Endpoint) -> bool:
    """The host names the machine itself: a loopback address or `localhost`."""
    if where.address is not None:
        inner = embedded_ipv4(where.address) if isinstance(where.address, ipaddress.IPv6Address) else None
        return (inner or where.address).is_loopback
    return where.host == "localhost" or where.host.endswith(".localhost")
