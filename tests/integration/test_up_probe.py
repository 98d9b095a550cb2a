"""`pdxfer up --prefill-tp 2` as the probe saw it: what it listens on, and a decode rank
frozen with SIGSTOP, which must show as degraded (not dead) on /health and /metrics."""

from __future__ import annotations

import ipaddress
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest

from tests.integration.test_tp_rendezvous import listeners
from tests.support.launch import MAIN, ROOT, assert_no_leftovers
from transfer.serving.procs import LAUNCH_ID_ENV, processes_with_env
from transfer.serving.ranks import HEARTBEAT_WINDOW_S

pytestmark = pytest.mark.slow

STARTUP_S = 240
NOTICE_S = HEARTBEAT_WINDOW_S + 30  # a frozen rank is reported within this (bounded poll)


class Up:
    def __init__(self, proc, launch_id: str, base: str, metrics: dict[str, str]) -> None:
        self.proc = proc
        self.launch_id = launch_id
        self.base = base
        self.metrics = metrics  # role -> the instance's /metrics URL

    def pids(self) -> list[int]:
        return processes_with_env(LAUNCH_ID_ENV, self.launch_id)

    def children_of(self, parent: int) -> list[int]:
        out = []
        for pid in self.pids():
            stat = Path(f"/proc/{pid}/stat").read_text()
            if int(stat.rpartition(")")[2].split()[1]) == parent:
                out.append(pid)
        return out

    def serve_pid(self, role: str) -> int:
        for pid in self.pids():
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"serve" in argv and role.encode() in argv:
                return pid
        raise AssertionError(f"no serve {role} process")


@pytest.fixture(scope="module")
def up():
    launch_id = uuid.uuid4().hex
    args = ["up", "--model", "tiny-qwen3-next", "--prefill-tp", "2", "--http-port", "0",
            "--gpu-mem", "32MiB", "--max-seqs", "4"]  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", MAIN, *args], cwd=ROOT,
                            env={**os.environ, LAUNCH_ID_ENV: launch_id},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    ready = threading.Event()
    lines: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("OpenAI API at"):
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
    try:
        assert ready.wait(STARTUP_S), "".join(lines)
        text = "".join(lines)
        base = re.search(r"OpenAI API at (http://\S+)/v1", text).group(1)
        metrics = dict(re.findall(r"^(prefill|decode)\s+\S+\s+metrics (\S+)$", text, re.M))
        yield Up(proc, launch_id, base, metrics)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        assert_no_leftovers(launch_id)


def test_every_process_listens_on_loopback_only(up):
    opened = {pid: listeners(pid) for pid in up.pids()}
    assert len(opened) >= 5  # up, router, prefill + its 2 ranks, decode + its rank
    exposed = {pid: [a for a in found if not ipaddress.ip_address(a[0]).is_loopback]
               for pid, found in opened.items()}  # fmt: skip
    assert not any(exposed.values()), exposed
    assert any(opened.values())  # the check saw the servers that are meant to listen


def _silent_ranks(up: Up) -> float:
    text = httpx.get(up.metrics["decode"], timeout=10).text
    return float(re.search(r"^pdxfer_ranks_silent (\S+)$", text, re.M).group(1))


def _wait_health(up: Up, status: str) -> dict:
    deadline = time.monotonic() + NOTICE_S
    while True:
        reply = httpx.get(up.base + "/health", timeout=30)
        body = reply.json()
        if body.get("status") == status or time.monotonic() > deadline:
            return {"code": reply.status_code, **body}
        time.sleep(0.5)


def test_a_frozen_decode_rank_shows_as_degraded_not_dead(up):
    assert _wait_health(up, "ok") == {"code": 200, "status": "ok"}
    assert _silent_ranks(up) == 0
    (rank,) = up.children_of(up.serve_pid("decode"))
    os.kill(rank, signal.SIGSTOP)
    try:
        health = _wait_health(up, "degraded")
        assert health["code"] == 200 and health["status"] == "degraded", health
        (named,) = health["degraded"]
        assert named.startswith("decode ")
        assert _silent_ranks(up) == 1
    finally:
        os.kill(rank, signal.SIGCONT)
    assert _wait_health(up, "ok") == {"code": 200, "status": "ok"}  # slow was not dead
    assert _silent_ranks(up) == 0
