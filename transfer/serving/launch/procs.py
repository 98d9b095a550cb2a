"""Start `pdxfer serve` processes, learn their bound ports, and stop them with all their ranks.

Each serve process runs in its own session (so its process group holds its TP rank
processes too, and a Ctrl-C in the terminal reaches only the launcher, which then stops
the groups in order). On Linux it also gets SIGTERM when the launcher dies, so a killed
launcher leaves no server behind. A serve process announces itself with one line on
stdout: `PDXFER-READY {"role": ..., "address": "host:port", "metrics_port": ...}`, and a
router with an HTTP front also `"http_port": ...`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from transfer.serving.child_process import READY_PREFIX, die_with_parent

LAUNCH_ID_ENV = "PDXFER_LAUNCH_ID"


_MAIN = "import sys; from transfer.cli import main; sys.exit(main())"


@dataclass
class ServeProcess:
    """One started `pdxfer serve ROLE`; `address` is set once it printed its READY line."""

    role: str
    popen: subprocess.Popen
    stdout_path: Path
    stderr_path: Path
    address: str = ""
    metrics_port: int = 0
    http_port: int = 0  # a router's HTTP front, as its READY line says (0: none)
    _stdout: object = field(default=None, repr=False)
    _stderr: object = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.stderr_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def poll_ready(self) -> bool:
        """Whether the READY line has appeared (sets `address`); raises if the process died."""
        if self.address:
            return True
        for line in self.stdout_path.read_text(errors="replace").splitlines():
            if line.startswith(READY_PREFIX):
                info = json.loads(line[len(READY_PREFIX) :])
                self.address = info["address"]
                self.metrics_port = int(info.get("metrics_port", 0))
                self.http_port = int(info.get("http_port", 0))
                return True
        code = self.popen.poll()
        if code is not None:
            raise RuntimeError(
                f"serve {self.role} exited with code {code} before it was ready:\n{self.log_tail()}"
            )
        return False


def start_serve(
    role: str, serve_args: list[str], log_dir: Path, env: dict[str, str] | None = None
) -> ServeProcess:
    """Start `pdxfer serve ROLE ARGS...` (this interpreter) with stdout/stderr in `log_dir`."""
    log_dir.mkdir(parents=True, exist_ok=True)
    stdout_path = log_dir / f"{role}.out"
    stderr_path = log_dir / f"{role}.log"
    out = open(stdout_path, "w")  # noqa: SIM115 - closed in stop_all
    err = open(stderr_path, "w")  # noqa: SIM115
    cmd = [sys.executable, "-c", _MAIN, "serve", role, *serve_args]
    popen = subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=out,
        stderr=err,
        env={**os.environ, **(env or {})},
        start_new_session=True,
        preexec_fn=die_with_parent if sys.platform.startswith("linux") else None,
    )
    return ServeProcess(role, popen, stdout_path, stderr_path, _stdout=out, _stderr=err)


def wait_ready(procs: list[ServeProcess], timeout_s: float) -> None:
    """Wait until every process printed its READY line; RuntimeError names the laggard."""
    deadline = time.monotonic() + timeout_s
    pending = list(procs)
    while pending:
        pending = [p for p in pending if not p.poll_ready()]
        if not pending:
            return
        if time.monotonic() > deadline:
            names = ", ".join(p.role for p in pending)
            tails = "\n".join(f"--- {p.role} ---\n{p.log_tail()}" for p in pending)
            raise RuntimeError(f"serve {names} not ready within {timeout_s:g}s:\n{tails}")
        time.sleep(0.05)


def check_health(procs: list[ServeProcess], timeout_s: float) -> None:
    """Every process answers the gRPC health check with SERVING (RuntimeError otherwise)."""
    from transfer.control.client import TransferClient
    from transfer.control.errors import ControlError

    for proc in procs:
        with TransferClient(proc.address, timeout_s=timeout_s) as client:
            try:
                client.wait_ready(timeout_s)
                status = client.health()
            except ControlError as exc:
                status = str(exc)
        if status != "SERVING":
            raise RuntimeError(f"serve {proc.role} at {proc.address} is not serving: {status}")


def signal_group(pgid: int, sig: int) -> None:
    """Send `sig` to process group `pgid` (a session leader's pid), if it still exists."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_all(procs: list[ServeProcess], grace_s: float = 10.0) -> None:
    """SIGTERM every process group, wait up to `grace_s`, then SIGKILL what is left."""
    for proc in procs:
        signal_group(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
    # Rank processes outlive their control process only briefly (they watch its pipe).
    while time.monotonic() < deadline and any(group_alive(p.pid) for p in procs):
        time.sleep(0.05)
    for proc in procs:
        signal_group(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.popen.wait(timeout=5.0)
        for handle in (proc._stdout, proc._stderr):
            if handle is not None:
                handle.close()
