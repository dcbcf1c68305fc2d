"""Which addresses http(s) media may come from, judged on the address connected to.

A media URL is the client's, so a server that fetches any of them fetches for anyone:
its own endpoints, the services beside it, a cloud's metadata service. Refused by
default: loopback, private, link-local, multicast, reserved, unspecified and every other
address that is not globally reachable, IPv4 and IPv6 alike, and an IPv4 address inside
an IPv6 one (IPv4-mapped, 6to4, NAT64) as that IPv4 address. The operator lifts the
rule for the hosts `--allowed-media-domains` names, or for all with
`--allow-private-media-hosts`.

The check sits where the connection is made (`HostPolicy.connect`, in place of
`socket.create_connection`): the host is resolved once, every address it resolves to is
checked, and the socket connects to one of those very addresses, while the Host header
and TLS (SNI, certificate) keep the name. A name that resolves to a public address when
checked and to a private one when connected (DNS rebinding) has no second lookup to
exploit, and each redirect hop opens a connection of its own, checked the same way.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Collection
from typing import Any

Address = ipaddress.IPv4Address | ipaddress.IPv6Address

RULE_TEXT = (
    "media is not fetched from loopback, private, link-local, multicast, reserved or "
    "unspecified addresses unless --allowed-media-domains names the host or the server "
    "runs with --allow-private-media-hosts"
)

# (rule, what an address breaking it is called, the test), checked in this order
_RULES: tuple[tuple[str, str, Callable[[Address], bool]], ...] = (
    ("unspecified", "the unspecified address", lambda ip: ip.is_unspecified),
    ("loopback", "a loopback address", lambda ip: ip.is_loopback),
    ("link-local", "a link-local address", lambda ip: ip.is_link_local),
    ("multicast", "a multicast address", lambda ip: ip.is_multicast),
    ("reserved", "a reserved address", lambda ip: ip.is_reserved),
    ("private", "a private address", lambda ip: ip.is_private),
    ("not global", "an address that is not globally reachable", lambda ip: not ip.is_global),
)
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")  # RFC 6052: the IPv4 address in the low bits


class RefusedHost(Exception):
    """A media host whose address breaks the rule; the message says which rule."""


def address_rule(address: str | Address) -> str | None:
    """The rule `address` breaks as a media source ("loopback", "private", ...), or None
    for a globally reachable one. An IPv4 address carried in an IPv6 one is judged as
    that IPv4 address: a mapped or NAT64 one only as it (the IPv4 host is what is
    reached), a 6to4 one as both."""
    ip = ipaddress.ip_address(address) if isinstance(address, str) else address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return address_rule(ip.ipv4_mapped)
        if ip in _NAT64:
            return address_rule(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
        if ip.sixtofour is not None:
            rule = address_rule(ip.sixtofour)
            if rule is not None:
                return rule
    return next((rule for rule, _, test in _RULES if test(ip)), None)


def _called(rule: str) -> str:
    return next(called for name, called, _ in _RULES if name == rule)


class HostPolicy:
    """Connects to a media host only at addresses the rule allows. Thread-safe (no state
    changes after construction)."""

    def __init__(self, trusted_hosts: Collection[str] | None, allow_private: bool) -> None:
        self.trusted_hosts = frozenset(h.lower() for h in trusted_hosts or ())
        self.allow_private = allow_private

    def connect(
        self,
        address: tuple[str, int],
        timeout: float | None = None,
        source_address: tuple[str, int] | None = None,
    ) -> socket.socket:
        """`socket.create_connection`'s contract, with every resolved address checked
        before any is connected to; raises `RefusedHost` naming the rule broken."""
        host, port = address
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        if not (self.allow_private or host.lower() in self.trusted_hosts):
            for info in infos:
                rule = address_rule(str(info[4][0]))  # an IP address string for INET/INET6
                if rule is not None:
                    raise RefusedHost(self._refusal(host, rule))
        return _connect_first(infos, timeout, source_address)

    @staticmethod
    def _refusal(host: str, rule: str) -> str:
        # The rule, never the address a name resolved to: that would map the network
        # behind the server for the client.
        try:
            ipaddress.ip_address(host)
            where = f"{host} is {_called(rule)}"
        except ValueError:
            where = f"host {host!r} resolves to {_called(rule)}"
        return f"{where}: {RULE_TEXT}"


def _connect_first(
    infos: list[tuple[Any, ...]], timeout: float | None, source_address: tuple[str, int] | None
) -> socket.socket:
    """A socket connected to the first of `infos` that answers (as create_connection
    tries each address in turn)."""
    error: OSError | None = None
    for family, kind, proto, _, sockaddr in infos:
        sock = socket.socket(family, kind, proto)
        try:
            if isinstance(timeout, int | float):
                sock.settimeout(timeout)
            if source_address is not None:
                sock.bind(source_address)
            sock.connect(sockaddr)
            return sock
        except OSError as e:
            error = e
            sock.close()
    raise error if error is not None else OSError(f"no address to connect to ({len(infos)})")
