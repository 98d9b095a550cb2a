"""`pdxfer up` survives a dead child: a SIGKILLed decode, then prefill, instance is started
again on its address, the router (never restarted) serves through it, and `up` counts the
restart per role on its /metrics."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.support.launch import processes_with_env
from tests.support.up_process import up_process
from transfer.serving.launch.procs import LAUNCH_ID_ENV

pytestmark = pytest.mark.slow

MODEL = "tiny-qwen3-next"  # a preset: prompts are token ids
STARTUP_S = 240
RECOVERY_S = 240
PROMPTS = [[5, 17, 42, 9, 100, 3, 77], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]


class Up:
    def __init__(self, proc, launch_id: str, stdout: str, stderr: list[str]) -> None:
        self.proc = proc
        self.launch_id = launch_id
        self.base = re.search(r"OpenAI API at (http://\S+)/v1", stdout).group(1)
        self.metrics = re.search(r"^up\s+restarts at (\S+);", stdout, re.M).group(1)
        self.stderr = stderr

    def serve_pid(self, name: str) -> int:
        """The pid of the `serve` process `name` ("router", "decode-0"; not a rank)."""
        role, _, _ = name.partition("-")
        pids = []
        for pid in processes_with_env(LAUNCH_ID_ENV, self.launch_id):
            try:
                args = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            except OSError:
                continue
            if args[3:5] == ["serve", role] and (name == role or name in args):
                pids.append(pid)
        assert len(pids) == 1, f"{name}: {pids}"
        return pids[0]

    def restarts(self, role: str) -> float:
        text = httpx.get(self.metrics, timeout=10).text
        found = re.search(rf'^pdxfer_up_restarts_total\{{role="{role}"\}} (\S+)$', text, re.M)
        return float(found.group(1))

    def healthy(self) -> bool:
        return httpx.get(self.base + "/health", timeout=10).status_code == 200

    def greedy(self, prompt: list[int]) -> list[int]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0}
        reply = httpx.post(self.base + "/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["token_ids"]


@contextlib.contextmanager
def running_up(*extra: str, exit_code: int = 0):
    """`pdxfer up` with `extra` flags, until the block ends; then SIGTERM it and check its
    exit code and that nothing of it is left."""
    args = ["up", "--model", MODEL, "--http-port", "0", "--gpu-mem", "64MiB", "--max-seqs", "4",
            *extra]  # fmt: skip
    with up_process(args, startup_s=STARTUP_S, exit_code=exit_code) as running:
        yield Up(running.proc, running.launch_id, running.stdout, running.stderr_lines)


@pytest.fixture
def up():
    with running_up() as running:
        yield running


def wait_until(condition, what: str, timeout_s: float = RECOVERY_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s}s: {what}"
        time.sleep(0.2)


def test_a_killed_decode_then_prefill_instance_is_restarted_and_served_through(up):
    expected = [up.greedy(p) for p in PROMPTS]
    router = up.serve_pid("router")
    for role in ("decode", "prefill"):
        victim = up.serve_pid(f"{role}-0")
        os.kill(victim, signal.SIGKILL)
        wait_until(
            lambda role=role: up.restarts(role) == 1 and up.healthy(),
            f"{role} restarted and the router healthy",
        )
        assert up.serve_pid(f"{role}-0") != victim
        for _ in range(3):  # requests keep succeeding, with the same greedy tokens
            assert [up.greedy(p) for p in PROMPTS] == expected, role
        assert up.proc.poll() is None and up.serve_pid("router") == router  # never died
        said = "".join(up.stderr)
        assert f"{role}-0 (pid {victim}) exited with code -9; restarting it" in said
    assert up.restarts("decode") == 1 and up.restarts("prefill") == 1


def test_without_restarts_the_instances_left_serve_until_a_role_has_none():
    with running_up("--decode-instances", "2", "--max-restarts", "0", exit_code=1) as up:
        expected = [up.greedy(p) for p in PROMPTS]
        first = up.serve_pid("decode-0")
        os.kill(first, signal.SIGKILL)
        wait_until(lambda: "decode-0 (pid" in "".join(up.stderr), "decode-0 noticed")
        for _ in range(3):  # the router steers around it to decode-1
            assert [up.greedy(p) for p in PROMPTS] == expected
        assert up.restarts("decode") == 0 and up.proc.poll() is None
        os.kill(up.serve_pid("decode-1"), signal.SIGKILL)
        up.proc.wait(timeout=RECOVERY_S)  # no decode instance left: `up` ends, exit 1
        wait_until(lambda: "logs kept in" in "".join(up.stderr), "the last words read")
        said = "".join(up.stderr)
        assert f"decode-0 (pid {first}) exited with code -9; given up after 0 restarts" in said
        assert "every decode instance was given up" in said
