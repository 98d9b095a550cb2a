"""vLLM's "rejected request" notice against a decode request that did reach the engine.

When a client leaves while vLLM's API server is adding its request, the server sends the
engine a pre-aborted 1-token request carrying the same `kv_transfer_params`
(`AsyncLLM.notify_kv_transfer_request_rejected`), even when the real request got in. The
notice must not release the prefill ticket the real request is reading: prefill would free,
and could reuse, the blocks being read (and the real request's own Release then fails).
"""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("vllm")

from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

from tests.vllm.test_vllm_scheduler import (  # noqa: E402, F401 (fixtures)
    PROMPT,
    base_config,
    connectors,
    finish_prefill,
    released_ids,
    request,
    step,
    wait_for,
)
from transfer.vllm.scheduler_pulls import PullPhase  # noqa: E402


def rejected_notice(request_id: str, params: dict) -> Request:
    """What vLLM 0.32's API server sends for a request it believes never reached the engine."""
    extra = {"kv_transfer_params": copy.deepcopy(params)}
    return Request(request_id, [0], SamplingParams(max_tokens=1, extra_args=extra), None)


def test_rejected_notice_leaves_the_ticket_to_the_request_reading_it(connectors):  # noqa: F811
    prefill, decode = connectors("prefill-0"), connectors("decode-0")
    params = finish_prefill(prefill, "r30")
    real = request("cmpl-30-0-abcd", copy.deepcopy(params))
    decode.on_new_request(real)
    wait_for(lambda: decode.get_num_new_matched_tokens(real, 0)[0], "decode acquires")
    blocks = KVCacheBlocks(
        ([KVCacheBlock(b) for b in range(50, 58)], *([KVCacheBlock(60 + g)] for g in range(3)))
    )
    decode.update_state_after_alloc(real, blocks, PROMPT - 1)
    assert len(step(decode).loads) == 1
    sides = decode._scheduler.decode
    assert sides.phase(real.request_id) is PullPhase.LOADING

    notice = rejected_notice("cmpl-30", params)
    decode.on_new_request(notice)
    notice.status = RequestStatus.FINISHED_ABORTED  # vLLM aborts it at once
    assert decode.request_finished_all_groups(notice, ([], [], [], [])) == (False, None)
    # Whatever the notice set off has settled (an Acquire and Release would be answered).
    wait_for(lambda: step(decode) and sides.phase(notice.request_id) is None, "notice settles")

    # The real request's load finishes: its Release is the one that frees prefill's blocks.
    decode.update_connector_output(KVConnectorOutput(finished_recving={real.request_id}))
    assert wait_for(lambda: released_ids(prefill), "prefill frees after release") == ["r30"]
    wait_for(lambda: step(decode) and sides.idle(), "decode forgets both")
    assert decode.get_kv_connector_stats() is None  # no Release refused, nothing failed
