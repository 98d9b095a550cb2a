"""HOST:PORT addresses: split, joined (IPv6 in brackets), and resolved to every IP a name
has, as the router, the decode instances and the launchers dial them."""

from __future__ import annotations

import socket

# Hosts a server binds to that no peer can dial: a ticket naming one is dialled at the
# address its publisher was reached by instead.
UNSPECIFIED_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]"})


def split_address(address: str) -> tuple[str, int]:
    """ "host:port" or "[v6]:port" -> (host, port); ValueError names the address otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"address: expected HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def join_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def resolve(address: str) -> list[str]:
    """Every IP `address`'s host name resolves to, as "ip:port" (IPv4 first; a headless
    Service name resolves to all its pods). An IP literal or an unresolvable name is kept."""
    host, port = split_address(address)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return [address]
    v4 = sorted({i[4][0] for i in infos if i[0] == socket.AF_INET})
    v6 = sorted({i[4][0] for i in infos if i[0] == socket.AF_INET6})
    return [join_address(ip, port) for ip in (v4 or v6)] or [address]
