"""What a TP group leaves listening: torch's rendezvous store binds the group's host only,
and is shut once the group has formed (gloo). Sockets are read from /proc (Linux);
test_up_probe checks a whole `pdxfer up --prefill-tp 2`."""

from __future__ import annotations

import ipaddress
import json
import os
import select
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.launch import ROOT

pytestmark = pytest.mark.slow

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
    for out in outputs:
        open_ports = json.loads(out.strip().splitlines()[-1])
        assert all(ipaddress.ip_address(ip).is_loopback for ip, _ in open_ports), open_ports
        assert port not in [p for _, p in open_ports]  # the store stopped listening


def test_a_closed_rendezvous_listener_leaves_the_store_loop_nothing_to_poll():
    """The store's event loop keeps polling the listener's descriptor after the group has
    formed. A shut-down listener polls as ready for ever (rank 0 of every TP-2 instance
    spun most of a core on it); once stopped, the descriptor must poll idle and the port
    must refuse connections, while the store still answers its existing client."""
    from transfer.model.rendezvous import Rendezvous

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    rendezvous = Rendezvous(f"tcp://127.0.0.1:{port}", 0, 1, 30.0)
    fd = rendezvous._listen_fd
    rendezvous.store.set("before", "1")
    rendezvous.stop_listening()
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    assert poller.poll(0) == []
    with socket.socket() as late, pytest.raises(ConnectionRefusedError):
        late.connect(("127.0.0.1", port))
    assert rendezvous.store.get("before") == b"1"
