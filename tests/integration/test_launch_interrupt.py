"""Ctrl-C in the middle of a `pdxfer launch` run stops every process it started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

from tests.support.launch import (
    MAIN,
    ROOT,
    assert_no_leftovers,
    processes_with_env,
    signal_report,
)
from transfer.serving.launch.procs import LAUNCH_ID_ENV

pytestmark = pytest.mark.slow

STARTUP_S = 180
LONG = 10_000  # tokens: minutes of decoding, and the caches still fit


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_interrupt_mid_run_leaves_nothing_behind(sig):
    launch_id = uuid.uuid4().hex
    args = ["launch", "--model", "tiny-qwen3-next", "--prefill-tp", "2", "--requests", "2",
            "--prompt-len", "32", "--max-tokens", str(LONG)]  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-c", MAIN, *args],
        cwd=ROOT,
        env={**os.environ, LAUNCH_ID_ENV: launch_id},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    streaming = threading.Event()
    lines: list[str] = []

    def read_stderr() -> None:
        for line in proc.stderr:
            lines.append(line)
            if "tokens streamed" in line and not line.rstrip().endswith(" 0 tokens streamed"):
                streaming.set()

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + STARTUP_S
        while not streaming.wait(0.2):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
        # The router, the two workers and their three ranks are all up and busy.
        assert len(processes_with_env(LAUNCH_ID_ENV, launch_id)) >= 6
        proc.send_signal(sig)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"launch did not stop within 60 s of {sig.name}:\n"
                        f"{signal_report(proc.pid)}\nits stderr:\n{''.join(lines)}")  # fmt: skip
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(5)
    assert proc.returncode == 130, "".join(lines)
    assert "interrupted" in "".join(lines)
    assert_no_leftovers(launch_id)


def test_killed_launcher_takes_its_servers_down(tmp_path):
    """Even SIGKILL, which the launcher cannot catch: its servers watch their parent."""
    launch_id = uuid.uuid4().hex
    args = ["launch", "--model", "tiny-kimi-linear", "--max-tokens", str(LONG)]
    proc = subprocess.Popen(
        [sys.executable, "-c", MAIN, *args],
        cwd=ROOT,
        # TMPDIR: the run directory a killed launcher cannot remove lands in tmp_path.
        env={**os.environ, LAUNCH_ID_ENV: launch_id, "TMPDIR": str(tmp_path)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + STARTUP_S
        while len(processes_with_env(LAUNCH_ID_ENV, launch_id)) < 4:
            assert time.monotonic() < deadline, "the run never started its workers"
            time.sleep(0.2)
        time.sleep(1.0)
    finally:
        proc.kill()
        proc.wait()
    assert_no_leftovers(launch_id, wait_s=30)
