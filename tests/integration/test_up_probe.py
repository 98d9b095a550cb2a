"""`pdxfer up --prefill-tp 2` as the probe saw it: what it listens on, and a decode rank
frozen with SIGSTOP, which must show as degraded (not dead) on /health and /metrics."""

from __future__ import annotations

import ipaddress
import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.integration.test_tp_rendezvous import listeners
from tests.support.launch import processes_with_env
from tests.support.up_process import up_process
from transfer.serving.launch.procs import LAUNCH_ID_ENV
from transfer.serving.ranks.ranks import HEARTBEAT_WINDOW_S

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
    args = ["up", "--model", "tiny-qwen3-next", "--prefill-tp", "2", "--http-port", "0",
            "--gpu-mem", "32MiB", "--max-seqs", "4"]  # fmt: skip
    with up_process(args, startup_s=STARTUP_S, exit_code=None) as running:
        text = running.stdout
        base = re.search(r"OpenAI API at (http://\S+)/v1", text).group(1)
        metrics = dict(re.findall(r"^(prefill|decode)\s+\S+\s+metrics (\S+)$", text, re.M))
        yield Up(running.proc, running.launch_id, base, metrics)


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
