"""The TP group's rendezvous store, listening only where it was asked to and only while
the group forms.

torch's `init_method="tcp://HOST:PORT"` makes rank 0 serve an unauthenticated key-value
store on every interface (`*:PORT`) for the life of the process, whatever HOST says.
Here rank 0 binds the listening socket itself, to HOST, and hands it to `TCPStore`; once
the group has formed, the listener is shut down. The ranks keep the connections they
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
        if rank == 0:
            self._listen_fd = _listen(host, port)
            self.store = dist.TCPStore(
                host, port, world_size, True, timeout, master_listen_fd=self._listen_fd
            )
        else:
            self.store = dist.TCPStore(host, port, world_size, False, timeout)

    def stop_listening(self) -> None:
        """Stop accepting connections (the store's existing ones stay). The socket is
        shut down, not closed: the store's event loop owns its descriptor and closes it."""
        if self._listen_fd is None:
            return
        with socket.socket(fileno=os.dup(self._listen_fd)) as listener:
            listener.shutdown(socket.SHUT_RDWR)
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
