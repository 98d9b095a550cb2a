"""Node 0 of a two-node `pdxfer bench transfer`: the rank host.

It listens on every address; each connection that passes the token check names the specs
of a group of rank processes, which the host starts with the connection handed to their
rank 0, so the driver commands them directly. It returns once the driver says `done`, or
once it has been idle (no connection) for `idle_exit_s` after at least one session.
"""

from __future__ import annotations

import pickle
import socket
import threading
import time
from collections.abc import Callable

from transfer.bench.transfer_rank import BUILD
from transfer.bench.transfer_remote import ACCEPTED, MAX_SPECS_BYTES, check_peer, recv_frame
from transfer.serving.ranks.ranks import RankGroup

IDLE_EXIT_S = 600.0

Log = Callable[[str], None]


def _listen(port: int) -> socket.socket:
    if socket.has_dualstack_ipv6():
        return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
    return socket.create_server(("", port))


class RankHost:
    """Accepts driver connections and serves one rank group per connection."""

    def __init__(self, port: int, token: bytes | None, log: Log) -> None:
        self.token, self.log = token, log
        self.server = _listen(port)
        self.server.settimeout(0.5)
        self.lock = threading.Lock()
        self.groups: list[RankGroup] = []
        self.active = self.sessions = 0
        self.done = threading.Event()

    def serve(self, idle_exit_s: float = IDLE_EXIT_S) -> int:
        """Sessions served; returns when the driver is done (or idle too long)."""
        port = self.server.getsockname()[1]
        self.log(f"rank host: listening on port {port}")
        idle_since = time.monotonic()
        try:
            while True:
                with self.lock:
                    active, sessions = self.active, self.sessions
                if active:
                    idle_since = time.monotonic()
                elif self.done.is_set():
                    break
                elif sessions and time.monotonic() - idle_since > idle_exit_s:
                    self.log(f"rank host: no driver for {idle_exit_s:g} s, exiting")
                    break
                try:
                    conn, address = self.server.accept()
                except TimeoutError:
                    continue
                threading.Thread(target=self._session, args=(conn, address), daemon=True).start()
        finally:
            self.close()
        self.log(f"rank host: done after {self.sessions} session(s)")
        return self.sessions

    def close(self) -> None:
        self.server.close()
        with self.lock:
            groups = list(self.groups)
        for group in groups:
            group.close()

    def _session(self, conn: socket.socket, address) -> None:
        with conn:
            purpose = check_peer(conn, self.token)
            if purpose is None:
                self.log(f"rank host: refused {address[0]} (wrong token)")
                return
            conn.sendall(ACCEPTED)
            if purpose == "done":
                self.log(f"rank host: {address[0]} is done")
                self.done.set()
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            frame = recv_frame(conn, MAX_SPECS_BYTES)
            if frame is None:
                self.log(f"rank host: {address[0]} sent no rank specs")
                return
            specs = pickle.loads(frame)  # the token matched: the driver is trusted
            with self.lock:
                self.active += 1
                self.sessions += 1
            try:
                group = RankGroup(specs, BUILD, rank0_socket=conn, label="bench ranks")
                with self.lock:
                    self.groups.append(group)
                pids = ", ".join(str(p.pid) for p in group.procs)
                self.log(f"rank host: rank processes {pids} for {address[0]}")
                group.join()  # rank 0 stops the group when the driver closes the connection
                group.close()
                codes = ", ".join(str(p.returncode) for p in group.procs)
                self.log(f"rank host: rank processes {pids} ended ({codes})")
            finally:
                with self.lock:
                    self.active -= 1
