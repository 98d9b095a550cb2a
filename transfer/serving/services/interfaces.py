"""Which network interface holds an address (an ioctl per interface, for UCX_NET_DEVICES),
and which address to advertise for a wildcard bind."""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def interface_of(host: str, flag: str = "--data-host") -> str | None:
    """The network interface holding IPv4 address `host` (for UCX_NET_DEVICES), or None.
    `flag` names the option `host` came from in errors (--host when --data-host is unset)."""
    try:
        ip = ipaddress.ip_address(socket.gethostbyname(host))
    except (OSError, ValueError):
        raise ValueError(f"{flag}: cannot resolve {host!r}") from None
    if ip.is_unspecified:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(
                    sock.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15])
                )
            except OSError:
                continue
            if socket.inet_ntoa(packed[20:24]) == str(ip):
                return name
    raise ValueError(f"{flag}: no local interface has address {ip}")


def advertised_host(host: str) -> str:
    """The host to put in tickets: the bind address, or this machine's address for 0.0.0.0."""
    if host in ("0.0.0.0", "::", ""):
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return "127.0.0.1"
    return host
