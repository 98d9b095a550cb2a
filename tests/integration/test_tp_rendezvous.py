"""What a TP group leaves listening: torch's rendezvous store binds the group's host only,
and is shut once the group has formed (gloo); a whole `pdxfer up --prefill-tp 2` listens
on loopback only. Sockets are read from /proc (Linux)."""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest

from tests.support.launch import MAIN, ROOT, assert_no_leftovers
from transfer.serving.procs import LAUNCH_ID_ENV, processes_with_env

pytestmark = pytest.mark.slow

STARTUP_S = 240
LISTEN = "0A"  # the TCP state code of a listening socket in /proc/net/tcp


def _address(hex_ip: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    raw = bytes.fromhex(hex_ip)
    # /proc prints each 32-bit word in host (little-endian) order
    swapped = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(swapped)
    return getattr(ip, "ipv4_mapped", None) or ip  # ::ffff:127.0.0.1 is 127.0.0.1


def listeners(pid: int) -> list[tuple[str, int]]:
    """(ip, port) of every TCP socket process `pid` listens on."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == LISTEN and fields[9] in inodes:
                ip, port = fields[1].split(":")
                found.append((str(_address(ip)), int(port, 16)))
    return found


RANK = """
import json, os, sys
from transfer.model.distributed import init_tp_group
from tests.integration.test_tp_rendezvous import listeners
group = init_tp_group(int(sys.argv[1]), 2, sys.argv[2], timeout_s=60)
group.barrier()
print(json.dumps(listeners(os.getpid())), flush=True)
group.barrier()
group.close()
"""


def test_the_rendezvous_binds_its_host_and_closes_once_the_group_formed():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    init = f"tcp://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(rank), init],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for rank in (0, 1)
    ]
    outputs = []
    for rank in ranks:
        out, err = rank.communicate(timeout=120)
        assert rank.returncode == 0, err[-2000:]
        outputs.append(out)
    import json

    for out in outputs:
        open_ports = json.loads(out.strip().splitlines()[-1])
        assert all(ipaddress.ip_address(ip).is_loopback for ip, _ in open_ports), open_ports
        assert port not in [p for _, p in open_ports]  # the store stopped listening


def test_up_with_prefill_tp_2_listens_on_loopback_only():
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
    try:
        assert ready.wait(STARTUP_S), "".join(lines)
        pids = processes_with_env(LAUNCH_ID_ENV, launch_id)
        assert len(pids) >= 5  # up, router, prefill + its 2 ranks, decode + its rank
        opened = {pid: listeners(pid) for pid in pids}
        exposed = {pid: [a for a in found if not ipaddress.ip_address(a[0]).is_loopback]
                   for pid, found in opened.items()}  # fmt: skip
        assert not any(exposed.values()), exposed
        assert any(opened.values())  # the check saw the servers that are meant to listen
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        assert_no_leftovers(launch_id)
