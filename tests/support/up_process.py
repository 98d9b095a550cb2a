"""`pdxfer up` as a child process for tests: started, read until it prints its API address,
stopped with a signal, and checked to leave nothing behind.

Imports only the standard library and `transfer` (no pytest), so the vLLM tests can use it
from the .venv-vllm interpreter too."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from tests.support.launch import MAIN, ROOT, assert_no_leftovers
from transfer.serving.launch.procs import LAUNCH_ID_ENV

READY_PREFIX = "OpenAI API at"


@dataclass
class UpProcess:
    """A running `pdxfer up`; `stdout_lines` / `stderr_lines` keep growing while it runs."""

    proc: subprocess.Popen
    launch_id: str
    stdout_lines: list[str] = field(default_factory=list)
    stderr_lines: list[str] = field(default_factory=list)

    @property
    def stdout(self) -> str:
        return "".join(self.stdout_lines)

    def stderr_tail(self, chars: int) -> str:
        return "".join(self.stderr_lines)[-chars:]


@contextlib.contextmanager
def up_process(
    args: Sequence[str],
    *,
    startup_s: float,
    env: Mapping[str, str] | None = None,
    stop_signal: signal.Signals = signal.SIGTERM,
    stop_s: float = 60.0,
    leftovers_s: float = 10.0,
    exit_code: int | None = 0,
    tail_chars: int = 3000,
) -> Iterator[UpProcess]:
    """Run `pdxfer ARGS` (ARGS starts with "up") with `env` added to this environment and a
    fresh launch id, and yield it once its stdout says "OpenAI API at" (AssertionError with its
    output after `startup_s`). When the block ends: `stop_signal`, a wait of `stop_s` (then
    SIGKILL), no process of the launch left, and, unless the block raised or `exit_code` is
    None, the exit code `exit_code`."""
    launch_id = uuid.uuid4().hex
    proc = subprocess.Popen(
        [sys.executable, "-c", MAIN, *args],
        cwd=ROOT,
        env={**os.environ, **(env or {}), LAUNCH_ID_ENV: launch_id},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    up = UpProcess(proc, launch_id)
    ready = threading.Event()

    def read_stdout() -> None:
        for line in proc.stdout:
            up.stdout_lines.append(line)
            if line.startswith(READY_PREFIX):
                ready.set()

    threading.Thread(target=read_stdout, daemon=True).start()
    threading.Thread(target=lambda: up.stderr_lines.extend(proc.stderr), daemon=True).start()
    try:
        # `up` gives up on its own when a child fails: stop waiting as soon as it exits.
        deadline = time.monotonic() + startup_s
        while not ready.wait(1.0) and proc.poll() is None and time.monotonic() < deadline:
            pass
        if not ready.is_set():
            raise AssertionError(
                f"pdxfer up did not come up:\n{up.stdout}{up.stderr_tail(tail_chars)}"
            )
        yield up
    finally:
        proc.send_signal(stop_signal)
        try:
            code = proc.wait(timeout=stop_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        assert_no_leftovers(launch_id, wait_s=leftovers_s)
    if exit_code is not None:
        assert code == exit_code, up.stderr_tail(tail_chars)
