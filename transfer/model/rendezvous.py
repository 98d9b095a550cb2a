"""The TP group's rendezvous store, listening only where it was asked to and only while
the group forms.

torch's `init_method="tcp://HOST:PORT"` makes rank 0 serve an unauthenticated key-value
store on every interface (`*:PORT`) for the life of the process, whatever HOST says.
Here rank 0 binds the listening socket itself, to HOST, and hands it to `TCPStore`; once
the group has formed, the listener is closed. The ranks keep the connections they
opened, so the store still answers them; nobody new can connect.
"""

from __future__ import annotations

import datetime
import os
import socket
from urllib.parse import urlsplit

import torch.distributed as dist

LISTEN_BACKLOG = 128


class Rendezvous:
    """One rank's store for a "tcp://HOST:PORT" rendezvous (`store` for init_process_group)."""

    def __init__(self, init_method: str, rank: int, world_size: int, timeout_s: float) -> None:
        parts = urlsplit(init_method)
        if parts.scheme != "tcp" or not parts.hostname or not parts.port:
            raise ValueError(f"init_method: expected tcp://HOST:PORT, got {init_method!r}")
        host, port = parts.hostname, parts.port
        timeout = datetime.timedelta(seconds=timeout_s)
        self._listen_fd: int | None = None
        self._quiet_writer: int | None = None  # keeps the pipe behind the stopped listener idle
        if rank == 0:
            self._listen_fd = _listen(host, port)
            self.store = dist.TCPStore(
                host, port, world_size, True, timeout, master_listen_fd=self._listen_fd
            )
        else:
            self.store = dist.TCPStore(host, port, world_size, False, timeout)

    def stop_listening(self) -> None:
        """Stop accepting connections (the store's existing ones stay).

        The store's event loop owns the listener's descriptor and polls it for as long as
        the process lives, so the socket is neither closed under the loop nor shut down (a
        shut-down listener polls as ready for ever: the loop spun most of a core on it).
        Instead the descriptor is pointed at the read end of a pipe whose write end stays
        open here and is never written: the listening socket closes (the port is free),
        and whatever the loop polls from then on never becomes ready."""
        if self._listen_fd is None:
            return
        quiet, self._quiet_writer = os.pipe()
        try:
            os.dup2(quiet, self._listen_fd)
        finally:
            os.close(quiet)
        self._listen_fd = None


def _listen(host: str, port: int) -> int:
    """A socket listening on host:port whose descriptor the caller owns."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        sock.close()
        raise OSError(f"TP rendezvous: cannot listen on {host}:{port}: {exc}") from exc
    return sock.detach()
