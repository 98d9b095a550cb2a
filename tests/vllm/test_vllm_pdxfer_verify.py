"""`verify` with real vLLM on both sides (TP 1 -> 1, the tiny bf16 Qwen3-Next): a load whose
bytes match prefill's digests decodes as colocated, with no verify failure; a load in which
decode flips one landed byte (the test hook `PDXFER_VLLM_TEST_CORRUPT_TOKENS`, for loads of
that many tokens) fails verify, is counted, and vLLM recomputes the prompt (its
`kv_load_failure_policy` "recompute"): the tokens still equal colocated, and decode keeps
serving."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.vllm.servers import (
    START_TIMEOUT_S,
    get_text,
    greedy_completion,
    metric_sum,
    pd_completion,
)
from transfer.serving.launch.vllm_servers import Connector, connector_config, start_vllm_server
from transfer.serving.launch.vllm_stack import VllmPdPlan, pd_specs
from transfer.vllm.worker_verify import CORRUPT_TOKENS_ENV

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MAX_TOKENS = 8
# 900 tokens: two full 384-token blocks and a staged partial one; 300: one partial block.
GOOD = [(7 * i + 3) % 500 + 5 for i in range(900)]
CORRUPTED = [(11 * i + 5) % 500 + 5 for i in range(300)]
VERIFY_FAILURES = "vllm:pdxfer_num_verify_failures_total"
FAILED = "vllm:pdxfer_num_failed_transfers_total"
WAIT_S = 60.0


@contextlib.contextmanager
def verifying_pair(model: Path):
    """Prefill and decode with verify on; decode corrupts loads of the corrupted prompt."""
    config = {
        **connector_config(Connector.PDXFER),
        "kv_connector_extra_config": {"verify": True},
        # vLLM's default ("fail") answers a request whose load failed with an error
        "kv_load_failure_policy": "recompute",
    }
    prefill, decode = pd_specs(VllmPdPlan(model, Connector.PDXFER, sys.executable))
    prefill = dataclasses.replace(prefill, kv_transfer_config=config)
    corrupt = {CORRUPT_TOKENS_ENV: str(len(CORRUPTED) - 1)}  # decode loads the prompt minus one
    decode = dataclasses.replace(decode, kv_transfer_config=config, env={**decode.env, **corrupt})
    log_dir = Path(tempfile.mkdtemp(prefix="vllm-verify-"))
    servers = []
    try:
        for spec in (prefill, decode):
            servers.append(start_vllm_server(spec, log_dir))
        for server in servers:
            server.wait_healthy(START_TIMEOUT_S)
        yield servers[0], servers[1]
    except BaseException:
        for server in servers:
            print(f"--- vLLM {server.spec.name} log ---\n{server.log_tail(80)}", file=sys.stderr)
        raise
    finally:
        for server in servers:
            server.stop()


def _counted(server, name: str, expected: float) -> float:
    deadline = time.monotonic() + WAIT_S
    while True:
        value = metric_sum(get_text(server.url + "/metrics"), name)
        if value >= expected or time.monotonic() > deadline:
            return value
        time.sleep(0.5)


def _pd_then_colocated(prefill, decode, prompt: list[int]) -> tuple[list[int], list[int]]:
    # P/D first: decode's colocated run must not leave the prompt in its prefix cache
    response, params = pd_completion(prefill, decode, prompt, MAX_TOKENS)
    assert params["pdxfer"]["digest_offsets"], "prefill published no digests"
    colocated = greedy_completion(decode, prompt, MAX_TOKENS)
    return response["choices"][0]["token_ids"], colocated["choices"][0]["token_ids"]


def test_verify_passes_and_a_flipped_byte_fails_the_load(qwen3_next_checkpoint):
    with verifying_pair(qwen3_next_checkpoint) as (prefill, decode):
        pd, colocated = _pd_then_colocated(prefill, decode, GOOD)
        assert pd == colocated
        moved = _counted(decode, "vllm:pdxfer_bytes_transferred_count", 1)
        assert moved == 1  # the load finished (checked) rather than falling back
        assert metric_sum(get_text(decode.url + "/metrics"), VERIFY_FAILURES) == 0

        pd, colocated = _pd_then_colocated(prefill, decode, CORRUPTED)
        assert pd == colocated  # vLLM recomputed the prompt
        assert _counted(decode, VERIFY_FAILURES, 1) == 1
        assert metric_sum(get_text(decode.url + "/metrics"), FAILED) == 1
        log = decode.log_path.read_text(errors="replace")
        assert "verify: layer" in log and "differs" in log

        pd, colocated = _pd_then_colocated(prefill, decode, GOOD[:500])  # decode still serves
        assert pd == colocated
        assert _counted(decode, "vllm:pdxfer_bytes_transferred_count", 2) == 2
