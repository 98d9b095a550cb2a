"""The request lifecycle through PdxferConnector with real vLLM on both sides (TP 1 -> 1, the
tiny bf16 Qwen3-Next): a decode request abandoned by its client frees the prefill side's
blocks at once, not at lease expiry, and decode keeps serving."""

from __future__ import annotations

import contextlib
import re
import time
import urllib.error

import pytest

from tests.vllm.servers import (
    START_TIMEOUT_S,
    get_text,
    greedy_completion,
    post_json,
    running_vllm,
)
from transfer.serving.launch.vllm_servers import Connector, connector_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

# A lease far longer than any test: whatever frees prefill's blocks here, it is not expiry.
LEASE_S = 900
WAIT_S = 120.0


def prompt(k: int, length: int) -> list[int]:
    return [(i * (k + 3) + 7 * k) % 500 + 1 for i in range(length)]


def metric(text: str, name: str) -> float:
    """The sum of `name` over its labels in Prometheus text (0 when absent)."""
    pattern = re.compile(rf"^{re.escape(name)}(\{{.*\}})? ")
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if pattern.match(line))


@pytest.fixture(scope="module")
def pd_pair(qwen3_next_checkpoint):
    config = {
        **connector_config(Connector.PDXFER),
        "kv_connector_extra_config": {"lease_s": LEASE_S},
    }
    with contextlib.ExitStack() as stack:
        servers = [
            stack.enter_context(
                running_vllm(
                    qwen3_next_checkpoint, name=name, kv_transfer_config=config, wait=False
                )
            )
            for name in ("prefill", "decode")
        ]
        for server in servers:
            server.wait_healthy(START_TIMEOUT_S)
        yield tuple(servers)


def prefill_holds_nothing(prefill) -> bool:
    return metric(get_text(prefill.url + "/metrics"), "vllm:kv_cache_usage_perc") == 0.0


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {WAIT_S}s"
        time.sleep(0.5)


def test_abandoned_decode_request_frees_prefill_blocks(pd_pair):
    prefill, decode = pd_pair
    ids = prompt(11, 1500)
    first = greedy_completion(prefill, ids, 1, kv_transfer_params={"do_remote_decode": True})
    params = first["kv_transfer_params"]
    assert not prefill_holds_nothing(prefill)  # held for decode
    body = {
        "model": str(decode.spec.model),
        "prompt": ids,
        "max_tokens": 400,  # with the prompt, within the servers' 2048 tokens
        "ignore_eos": True,
        "kv_transfer_params": params,
    }
    # The client gives up at once: vLLM aborts the decode request, wherever it stands.
    with pytest.raises((urllib.error.URLError, TimeoutError)) as gave_up:
        post_json(decode.url + "/v1/completions", body, timeout_s=0.05)
    assert not isinstance(gave_up.value, urllib.error.HTTPError)  # a timeout, not a refusal
    wait_until(lambda: prefill_holds_nothing(prefill), "prefill frees the abandoned request")
    prefill_metrics = get_text(prefill.url + "/metrics")
    assert metric(prefill_metrics, "vllm:pdxfer_num_expired_leases_total") == 0
    # Decode keeps serving.
    assert greedy_completion(decode, prompt(12, 50), 2)["choices"][0]["token_ids"]
