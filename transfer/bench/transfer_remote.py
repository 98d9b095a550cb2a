"""Two-node `pdxfer bench transfer`: the token, the handshake, and the driver's side.

Node 1 (the driver) reaches node 0 (`transfer_host`) over TCP. Every connection opens
with the shared token, sent as raw bytes and checked before anything is unpickled: rank
commands are pickles, and pickle from an unauthenticated peer is remote code execution.
Then comes the purpose: `ranks` (start a group of rank processes, whose specs follow, and
hand rank 0 this connection) or `done` (the driver has finished; the host may exit).
"""

from __future__ import annotations

import contextlib
import hmac
import pickle
import socket
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection

from transfer.bench.transfer_rank import BenchRankSpec
from transfer.control.auth import load_token
from transfer.serving.ranks.ranks import RankLink

CONNECT_TIMEOUT_S = 300.0
HANDSHAKE_TIMEOUT_S = 30.0
FINISH_TIMEOUT_S = 10.0
START_TIMEOUT_S = 600.0
MAX_TOKEN_BYTES = 4096
MAX_SPECS_BYTES = 1 << 20
HEADER = struct.Struct("<Q")
ACCEPTED, REFUSED = b"Y", b"N"
PURPOSES = ("ranks", "done")


def read_token(path: str | None) -> bytes | None:
    """--auth-token-file (or PDXFER_AUTH_TOKEN_FILE), else PDXFER_AUTH_TOKEN, else None."""
    token = load_token(path)
    return token.encode() if token else None


def parse_peer(text: str) -> tuple[str, int]:
    """`HOST:PORT` (IPv6 as `[ADDR]:PORT`) -> (host, port)."""
    host, sep, port = str(text).rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--peer: expected HOST:PORT with a port in 1..65535, got {text!r}")
    return host, int(port)


def send_frame(sock: socket.socket, data: bytes) -> None:
    sock.sendall(HEADER.pack(len(data)) + data)


def recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(n - got)
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def recv_frame(sock: socket.socket, limit: int = MAX_TOKEN_BYTES) -> bytes | None:
    """One length-prefixed frame of at most `limit` bytes; None if the peer sent less or more."""
    header = recv_exactly(sock, HEADER.size)
    if header is None or HEADER.unpack(header)[0] > limit:
        return None
    return recv_exactly(sock, HEADER.unpack(header)[0])


def check_peer(sock: socket.socket, token: bytes | None) -> str | None:
    """The host's side of the handshake: the purpose, or None (and REFUSED sent) when the
    token is wrong. `token` None accepts anyone (--insecure-peer)."""
    sock.settimeout(HANDSHAKE_TIMEOUT_S)
    offered = recv_frame(sock)
    purpose = recv_frame(sock)
    sock.settimeout(None)
    good = offered is not None and (token is None or hmac.compare_digest(offered, token))
    if not good or purpose is None or purpose.decode(errors="replace") not in PURPOSES:
        with contextlib.suppress(OSError):
            sock.sendall(REFUSED)
        return None
    return purpose.decode()


@dataclass(frozen=True)
class RemotePeer:
    """Node 0 as seen from the driver: where it listens, and the token it expects."""

    host: str
    port: int
    token: bytes = field(repr=False)
    connect_timeout_s: float = CONNECT_TIMEOUT_S

    def _open(self, purpose: str) -> socket.socket:
        """Connect (retrying until the deadline: node 0 may start later) and authenticate."""
        deadline = time.monotonic() + self.connect_timeout_s
        while True:
            try:
                sock = socket.create_connection((self.host, self.port), timeout=5.0)
                break
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise ValueError(
                        f"--peer {self.host}:{self.port}: no rank host answered within "
                        f"{self.connect_timeout_s:g} s ({exc})"
                    ) from None
                time.sleep(1.0)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(HANDSHAKE_TIMEOUT_S)
            send_frame(sock, self.token)
            send_frame(sock, purpose.encode())
            answer = recv_exactly(sock, 1)
            sock.settimeout(None)
        except OSError:
            answer = None
        if answer != ACCEPTED:
            sock.close()
            raise ValueError(
                f"--peer {self.host}:{self.port}: the rank host refused this node "
                "(do both sides have the same --auth-token-file?)"
            )
        return sock

    def connect(self, specs: Sequence[BenchRankSpec], label: str) -> RankLink:
        """Rank processes started on node 0 for this connection, and the link to their
        rank 0 (once they are up)."""
        sock = self._open("ranks")
        try:
            send_frame(sock, pickle.dumps(tuple(specs), protocol=pickle.HIGHEST_PROTOCOL))
        except OSError:
            sock.close()
            raise
        link = RankLink(Connection(sock.detach()), label)
        try:
            link.receive("start", START_TIMEOUT_S)
        except BaseException:
            link.stop()
            raise
        return link

    def finish(self) -> None:
        """Tell node 0 the run is over, so it exits 0; a host already gone is fine."""
        with contextlib.suppress(OSError, ValueError):
            replace(self, connect_timeout_s=FINISH_TIMEOUT_S)._open("done").close()
