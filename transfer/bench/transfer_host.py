"""Node 0 of a two-node `pdxfer bench transfer`: the rank host.

It listens on every address; each connection that passes the token check gets its own
`transfer_rank` process, and the host relays bytes between the socket and the process's
stdin/stdout until either side closes. It returns once the driver says `done`, or once
it has been idle (no connection) for `idle_exit_s` after at least one session.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable

from transfer.bench.transfer_procs import RANK_ARGV, ROOT, STOP_TIMEOUT_S, rank_env
from transfer.bench.transfer_remote import ACCEPTED, check_peer

IDLE_EXIT_S = 600.0

Log = Callable[[str], None]


def _listen(port: int) -> socket.socket:
    if socket.has_dualstack_ipv6():
        return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
    return socket.create_server(("", port))


def _stop(proc: subprocess.Popen) -> None:
    """End of stdin first (the rank closes its transport), then terminate, then kill."""
    with contextlib.suppress(OSError):
        proc.stdin.close()
    for step in (None, proc.terminate, proc.kill):
        if step is not None:
            step()
        try:
            proc.wait(STOP_TIMEOUT_S)
            break
        except subprocess.TimeoutExpired:
            continue
    with contextlib.suppress(OSError):
        proc.stdout.close()


class RankHost:
    """Accepts driver connections and serves one rank process per connection."""

    def __init__(self, port: int, token: bytes | None, log: Log) -> None:
        self.token, self.log = token, log
        self.server = _listen(port)
        self.server.settimeout(0.5)
        self.lock = threading.Lock()
        self.children: dict[int, subprocess.Popen] = {}
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
            children = list(self.children.values())
        for proc in children:
            _stop(proc)

    def _session(self, conn: socket.socket, address) -> None:
        with conn:
            purpose = check_peer(conn, self.token)
            if purpose is None:
                self.log(f"rank host: refused {address[0]} (wrong token)")
                return
            if purpose == "done":
                self.log(f"rank host: {address[0]} is done")
                self.done.set()
                conn.sendall(ACCEPTED)
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            proc = subprocess.Popen(
                RANK_ARGV, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=rank_env(), cwd=ROOT
            )
            with self.lock:
                self.children[proc.pid] = proc
                self.active += 1
                self.sessions += 1
            self.log(f"rank host: rank process {proc.pid} for {address[0]}")
            try:
                conn.sendall(ACCEPTED)
                self._relay(conn, proc)
            finally:
                _stop(proc)
                with self.lock:
                    self.children.pop(proc.pid, None)
                    self.active -= 1
                self.log(f"rank host: rank process {proc.pid} ended ({proc.returncode})")

    @staticmethod
    def _relay(conn: socket.socket, proc: subprocess.Popen) -> None:
        """Socket -> stdin on a thread, stdout -> socket here, until either side closes."""

        def inbound() -> None:
            with contextlib.suppress(OSError):
                while chunk := conn.recv(1 << 20):
                    proc.stdin.write(chunk)
                    proc.stdin.flush()
            with contextlib.suppress(OSError):
                proc.stdin.close()

        thread = threading.Thread(target=inbound, daemon=True)
        thread.start()
        fd = proc.stdout.fileno()
        with contextlib.suppress(OSError):
            while chunk := os.read(fd, 1 << 20):
                conn.sendall(chunk)
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)
        thread.join(STOP_TIMEOUT_S)
