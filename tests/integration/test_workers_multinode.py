"""A prefill instance whose TP spans two "nodes" (two serve processes joined by
torch.distributed, as a LeaderWorkerSet runs them): the follower answers health and
metrics like the leader, and a request through the router returns the TP=1 tokens."""

from __future__ import annotations

import urllib.request
import uuid

import pytest

from tests.support.launch import processes_with_env
from transfer.control.client import RouterClient
from transfer.control.types import GenerateRequest
from transfer.model.reference import reference_generate
from transfer.net import free_port
from transfer.presets import get_preset
from transfer.serving.launch.procs import (
    LAUNCH_ID_ENV,
    check_health,
    start_serve,
    stop_all,
    wait_ready,
)

pytestmark = pytest.mark.slow

MODEL = "tiny-qwen3-next"
PROMPT = [11, 400, 23, 7, 301, 99, 5, 250, 42, 17, 3, 128]


def test_prefill_tp_across_two_nodes(tmp_path):
    worker = ["--model", MODEL, "--gpu-mem", "16MiB", "--max-seqs", "2", "--seed", "1"]
    dist = ["--tp", "2", "--nnodes", "2", "--dist-addr", f"127.0.0.1:{free_port()}"]
    ports = [(free_port(), free_port()) for _ in range(2)]
    env = {LAUNCH_ID_ENV: uuid.uuid4().hex}
    procs = [
        start_serve(
            "prefill",
            [
                "--port",
                str(grpc_port),
                "--metrics-port",
                str(metrics_port),
                "--node-rank",
                str(node),
                *dist,
                *worker,
            ],  # fmt: skip
            tmp_path / f"node{node}",
            env,
        )
        for node, (grpc_port, metrics_port) in enumerate(ports)
    ]
    procs.append(
        start_serve("decode", ["--port", "0", "--metrics-port", "0", *worker], tmp_path, env)
    )
    try:
        wait_ready(procs, 240)
        check_health(procs, 30)
        with urllib.request.urlopen(f"http://127.0.0.1:{ports[1][1]}/metrics", timeout=10) as reply:
            assert b"pdxfer_transfers_total" in reply.read()
        route = ["--prefill", procs[0].address, "--decode", procs[2].address]
        procs.append(
            start_serve("router", ["--port", "0", "--metrics-port", "0", *route], tmp_path, env)
        )
        wait_ready(procs, 60)
        with RouterClient(procs[3].address) as client:
            events = list(client.generate(GenerateRequest("mn-1", tuple(PROMPT), 4)))
    finally:
        stop_all(procs)
    assert [e.token for e in events] == reference_generate(get_preset(MODEL), PROMPT, 4, 1)
    assert not processes_with_env(LAUNCH_ID_ENV, env[LAUNCH_ID_ENV])
