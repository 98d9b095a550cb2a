"""The request lifecycle through PdxferConnector with real vLLM on both sides (TP 1 -> 1, the
tiny bf16 Qwen3-Next): a decode request abandoned by its client frees the prefill side's
blocks at once, not at lease expiry, and decode keeps serving; a prefill killed (SIGKILL) or
frozen (SIGSTOP) after it answered the prefill step, or killed after decode's Acquire succeeded
and before decode's worker read (held there by the `test_hold_loads_file` fault), costs
decode's request a local recompute (same tokens), counted as a failed transfer and logged, and
decode keeps serving."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import tempfile
import time
import urllib.error
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.vllm.servers import (
    START_TIMEOUT_S,
    get_text,
    greedy_completion,
    metric_sum,
    pd_completion,
    post_json,
    running_vllm,
)
from transfer.serving.launch.vllm_servers import Connector, connector_config, omp_binds

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

# A lease far longer than any test: whatever frees prefill's blocks here, it is not expiry.
LEASE_S = 900
# A frozen prefill costs a decode request this long (the 10 s default would do too; shorter
# keeps the test short, and an Acquire on an idle loopback answers in milliseconds).
CONTROL_TIMEOUT_S = 5
WAIT_S = 120.0
FAILED = "vllm:pdxfer_num_failed_transfers_total"
# Each server's OpenMP threads on their own CPUs (vLLM's default binds every server to all
# of them, and three servers' threads then fight): prefill, decode, the doomed prefill.
PREFILL_BIND, DECODE_BIND, DOOMED_BIND = omp_binds([1, 1, 1])
BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def prompt(k: int, length: int) -> list[int]:
    return [(i * (k + 3) + 7 * k) % 500 + 1 for i in range(length)]


@pytest.fixture(scope="module")
def hold_file() -> Path:
    """While this file exists, decode's worker holds the loads it is about to read."""
    return Path(tempfile.mkdtemp(prefix="pdxfer-hold-")) / "hold"


@pytest.fixture(scope="module")
def pd_pair(qwen3_next_checkpoint, hold_file):
    config = {
        **connector_config(Connector.PDXFER),
        # A failed load is computed locally (vLLM's default fails the request).
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "lease_s": LEASE_S,
            "control_timeout_s": CONTROL_TIMEOUT_S,
            "test_hold_loads_file": str(hold_file),
        },
    }
    with contextlib.ExitStack() as stack:
        servers = [
            stack.enter_context(
                running_vllm(
                    qwen3_next_checkpoint,
                    name=name,
                    kv_transfer_config=config,
                    env={BIND_ENV: bind},
                    wait=False,
                )
            )
            for name, bind in (("prefill", PREFILL_BIND), ("decode", DECODE_BIND))
        ]
        for server in servers:
            server.wait_healthy(START_TIMEOUT_S)
        yield tuple(servers)


def prefill_holds_nothing(prefill) -> bool:
    return metric_sum(get_text(prefill.url + "/metrics"), "vllm:kv_cache_usage_perc") == 0.0


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {WAIT_S}s"
        time.sleep(0.5)


@pytest.fixture
def doomed_prefill(qwen3_next_checkpoint, pd_pair):
    """A prefill server of its own, for a test to kill or freeze (killed after the test)."""
    config = {
        **connector_config(Connector.PDXFER),
        "kv_connector_extra_config": {"lease_s": LEASE_S},
    }
    with running_vllm(
        qwen3_next_checkpoint, name="doomed", kv_transfer_config=config, env={BIND_ENV: DOOMED_BIND}
    ) as server:
        try:
            yield server
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.popen.pid, signal.SIGKILL)  # frozen: SIGTERM would wait


def refuses_connections(address: str) -> bool:
    """Whether nothing listens at HOST:PORT any more (a killed server's processes may linger
    as zombies, so the process group is no sign)."""
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=2.0).close()
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    return False


@pytest.mark.parametrize(
    ("fault", "error", "k"),
    [(signal.SIGKILL, "UNAVAILABLE", 13), (signal.SIGSTOP, "DEADLINE_EXCEEDED", 15)],
    ids=["killed", "frozen"],
)
def test_prefill_lost_after_its_step_costs_decode_a_recompute(
    pd_pair, doomed_prefill, fault, error, k
):
    _, decode = pd_pair
    ids = prompt(k, 60)  # under one 384-token block: no prefix-cache hit on decode
    first = greedy_completion(doomed_prefill, ids, 1, kv_transfer_params={"do_remote_decode": True})
    params = first["kv_transfer_params"]
    failed_before = metric_sum(get_text(decode.url + "/metrics"), FAILED)
    os.killpg(doomed_prefill.popen.pid, fault)
    if fault == signal.SIGKILL:
        address = params["pdxfer"]["control_address"]
        wait_until(lambda: refuses_connections(address), "the killed prefill's control port closes")

    answer = greedy_completion(decode, ids, 3, kv_transfer_params=params)
    # Decode could not acquire the cache (a dead prefill refuses the connection; a frozen one
    # never answers, and the call gives up at control_timeout_s): it computed the prompt.
    colocated = greedy_completion(decode, ids, 3)
    assert answer["choices"][0]["token_ids"] == colocated["choices"][0]["token_ids"]
    wait_until(
        lambda: metric_sum(get_text(decode.url + "/metrics"), FAILED) == failed_before + 1,
        "decode counts the failed transfer",
    )
    log = decode.log_path.read_text(errors="replace")
    address = re.escape(params["pdxfer"]["control_address"])
    assert re.search(rf"acquiring its cache from {address} failed \(.*{error}.*computing it", log)
    wait_until(
        lambda: metric_sum(get_text(decode.url + "/metrics"), "vllm:kv_cache_usage_perc") == 0.0,
        "decode frees the request's blocks",
    )
    # Decode keeps serving (the colocated request above was one, this is another).
    assert len(greedy_completion(decode, prompt(k + 1, 60), 2)["choices"][0]["token_ids"]) == 2


@pytest.mark.parametrize("known", [False, True], ids=["first-contact", "known-peer"])
def test_prefill_killed_between_decode_acquire_and_read(pd_pair, doomed_prefill, hold_file, known):
    """first-contact: decode's scheduler half handshook with this prefill before Acquire, and
    its worker connects the prefill's transport peer only with the held load: the dead peer
    refuses that connection. known-peer: one transfer from it went through first, so the
    held load is posted to a dead transport peer."""
    _, decode = pd_pair
    if known:
        warm = prompt(17, 60)
        colocated = greedy_completion(decode, warm, 2)["choices"][0]["token_ids"]
        response, _ = pd_completion(doomed_prefill, decode, warm, 2)
        assert response["choices"][0]["token_ids"] == colocated
    ids = prompt(19, 60)
    first = greedy_completion(doomed_prefill, ids, 1, kv_transfer_params={"do_remote_decode": True})
    params = first["kv_transfer_params"]
    address = params["pdxfer"]["control_address"]
    failed_before = metric_sum(get_text(decode.url + "/metrics"), FAILED)
    held = hold_file.with_name(hold_file.name + ".held")
    held.unlink(missing_ok=True)
    hold_file.touch()
    with ThreadPoolExecutor(max_workers=1) as pool:
        try:
            pending = pool.submit(greedy_completion, decode, ids, 3, kv_transfer_params=params)
            # A load is ordered only once decode's Acquire succeeded: prefill holds the cache
            # for decode now, and nothing of it has been read.
            wait_until(held.exists, "decode's worker holds the acquired load")
            os.killpg(doomed_prefill.popen.pid, signal.SIGKILL)
            wait_until(lambda: refuses_connections(address), "the killed prefill's port closes")
        finally:
            hold_file.unlink(missing_ok=True)
        answer = pending.result(timeout=WAIT_S)

    # The load failed (the dead prefill's transport refuses the connection, or is gone),
    # and vLLM computed the prompt itself (kv_load_failure_policy recompute).
    colocated = greedy_completion(decode, ids, 3)["choices"][0]["token_ids"]
    assert answer["choices"][0]["token_ids"] == colocated
    wait_until(
        lambda: metric_sum(get_text(decode.url + "/metrics"), FAILED) == failed_before + 1,
        "decode counts the failed transfer",
    )
    log = decode.log_path.read_text(errors="replace")
    if known:  # NIXL's answer when the peer died after the transfer was created
        failure = r"pdxfer: load of \S+ failed: .*NIXL_ERR_REMOTE_DISCONNECT"
    else:
        failure = (
            rf"pdxfer: load of \S+ from {re.escape(address)} failed before posting: "
            rf".*no usable handshake with {re.escape(address)}"
        )
    assert re.search(failure, log), "decode's log names the failed load"
    wait_until(
        lambda: metric_sum(get_text(decode.url + "/metrics"), "vllm:kv_cache_usage_perc") == 0.0,
        "decode frees the request's blocks",
    )
    assert len(greedy_completion(decode, prompt(20, 60), 2)["choices"][0]["token_ids"]) == 2


# Last in the file: when it fails, its decode server may keep stepping with the abandoned
# request's blocks held, and the tests above share that server.
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
    assert metric_sum(prefill_metrics, "vllm:pdxfer_num_expired_leases_total") == 0
    # Decode keeps serving.
    assert greedy_completion(decode, prompt(12, 50), 2)["choices"][0]["token_ids"]
