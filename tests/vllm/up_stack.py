"""`pdxfer up --engine vllm` as a child process for tests: the URLs it prints, and a Ctrl-C
(SIGINT) stop after which none of its processes may be left."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.support.launch import MAIN, ROOT, assert_no_leftovers
from tests.vllm.servers import START_TIMEOUT_S
from transfer.net import free_port
from transfer.serving.procs import LAUNCH_ID_ENV
from transfer.serving.vllm_servers import Connector

STOP_TIMEOUT_S = 90.0


@dataclass(frozen=True)
class UpStack:
    prefill: str  # base URLs
    decode: str
    router: str


@contextlib.contextmanager
def running_up(
    model: Path, connector: Connector, *, prefill_tp: int = 1, decode_tp: int = 1
) -> Iterator[UpStack]:
    """`pdxfer up --engine vllm` with `connector` (this interpreter's vLLM) until the block
    ends; AssertionError if it does not come up, exits non-zero or leaves a process."""
    launch_id = uuid.uuid4().hex
    args = ["up", "--engine", "vllm", "--connector", connector.value, "--model", str(model),
            "--prefill-tp", str(prefill_tp), "--decode-tp", str(decode_tp),
            "--http-port", str(free_port()), "--timeout", str(START_TIMEOUT_S)]  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-c", MAIN, *args], cwd=ROOT, env={**os.environ, LAUNCH_ID_ENV: launch_id},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    lines: list[str] = []
    errors: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("OpenAI API at"):
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    threading.Thread(target=lambda: errors.extend(proc.stderr), daemon=True).start()
    try:
        # `up` gives up on its own after --timeout per phase; stop waiting when it exits.
        deadline = time.monotonic() + 2 * START_TIMEOUT_S + 60
        while not ready.wait(1.0) and proc.poll() is None and time.monotonic() < deadline:
            pass
        up = ready.is_set()
        assert up, f"pdxfer up did not come up:\n{''.join(lines)}{''.join(errors)[-4000:]}"
        text = "".join(lines)
        urls = dict(re.findall(r"^(prefill|decode)\s+vLLM (http://\S+)", text, re.M))
        router = re.search(r"OpenAI API at (http://\S+)/v1", text).group(1)
        yield UpStack(urls["prefill"], urls["decode"], router)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        assert_no_leftovers(launch_id, wait_s=30.0)
    assert code == 0, "".join(errors)[-4000:]
