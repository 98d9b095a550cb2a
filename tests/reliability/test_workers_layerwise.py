"""Layer-wise streaming between real rank processes (issue 18): decode reads each group of
layers of each prompt chunk once the prefill ranks publish it, and ends with the tokens of
the colocated reference and the prefill's caches bit for bit; never a byte before it is
final (a prefill rank scribbles over each group until it publishes it); and a stream that
fails midway frees everything on both sides.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from tests.support.worker_sides import (  # noqa: F401 (fixture)
    Side,
    one_thread,
    prompt,
    start_decode,
    start_prefill,
)
from transfer.control.errors import ControlError
from transfer.control.types import DecodeRequest, PrefillRequest
from transfer.errors import PdxferError
from transfer.model.reference import reference_generate
from transfer.presets import get_preset
from transfer.serving.engine.checkpoints import PREFIX_UNIT
from transfer.serving.engine.instance import InstanceConfig
from transfer.serving.launch.verify import check_request

pytestmark = pytest.mark.slow

MAX_TOKENS = 3
CHUNK = 32  # prompt tokens per prefill step: a 100-token prompt streams in 4 chunks
WAIT_S = 30.0


def config(role: str, model: str, tp: int, dump_dir: Path, name: str, **extra) -> InstanceConfig:
    return InstanceConfig(
        role, get_preset(model), tp=tp, budget_bytes=16 << 20, max_seqs=2,
        dump_dir=str(dump_dir), transfer_mode="layerwise", stream_layers=2,
        max_num_batched_tokens=CHUNK, agent_prefix=f"{name}-{os.getpid()}",
        **({"prefix_cache": False, "staging_bytes": 0} | extra),
    )  # fmt: skip


def serve_one(prefill: Side, decode: Side, rid: str, ids: list[int]):
    """(ticket, events)."""
    ticket = prefill.worker.prefill(PrefillRequest(rid, tuple(ids), MAX_TOKENS))
    return ticket, list(decode.worker.decode(DecodeRequest(ticket, MAX_TOKENS)))


def assert_streamed_exactly(model: str, prefill: Side, decode: Side, dump_dir, rid, ids):
    ticket, events = serve_one(prefill, decode, rid, ids)
    geometry = get_preset(model)
    assert ticket.stream_key != 0  # published before prefill ran
    assert [e.token for e in events] == reference_generate(geometry, ids, MAX_TOKENS)
    p, d = len(prefill.instance.layouts), len(decode.instance.layouts)
    assert check_request(geometry, dump_dir, rid, p, d).problems == ()
    # every byte crossed once: each decode rank's KV of every token, and its state
    layouts = decode.instance.layouts
    first = events[0]
    assert first.kv_bytes == len(ids) * sum(lay.kv_bytes_per_token for lay in layouts)
    assert first.state_bytes == sum(lay.state_bytes_per_slot for lay in layouts)
    assert 0 < first.exposed_transfer_ms <= first.ttft_ms


def wait_idle(side: Side) -> None:
    """Every block and slot free, no ticket live, nothing held: within WAIT_S."""
    pools = side.instance.pools
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        held = getattr(side.worker, "held_requests", list)()
        tickets = len(getattr(side.worker, "store", ()))
        free = (pools.blocks.num_free, pools.slots.num_free)
        if free == (pools.blocks.num_total, pools.slots.num_total) and not held and not tickets:
            return
        time.sleep(0.05)
    raise AssertionError(f"not idle after {WAIT_S}s: free {free}, held {held}, tickets {tickets}")


SETUPS = [
    ("tiny-qwen3-next", 2, 1),
    ("tiny-qwen3-next", 1, 2),
    ("tiny-kimi-linear", 2, 1),
    ("tiny-kimi-linear", 1, 2),
]


@pytest.mark.parametrize("setup", SETUPS, ids=lambda s: f"{s[0]}-P{s[1]}D{s[2]}")
def test_a_layerwise_stream_gives_the_reference_tokens_and_the_prefill_caches(setup, tmp_path):
    model, p, d = setup
    prefill = start_prefill(config("prefill", model, p, tmp_path, "prefill-lw"), "prefill-lw")
    try:
        decode = start_decode(config("decode", model, d, tmp_path, "decode-lw"), "decode-lw",
                              [prefill])  # fmt: skip
        try:
            assert_streamed_exactly(model, prefill, decode, tmp_path, "long", prompt(1, 100))
            assert_streamed_exactly(model, prefill, decode, tmp_path, "short", prompt(2, 7))
            wait_idle(prefill)
            wait_idle(decode)
        finally:
            decode.close()
    finally:
        prefill.close()


@pytest.fixture(scope="module")
def scribbled(tmp_path_factory):
    """A TP=2 prefill whose last rank scribbles over each group for 30 ms before
    publishing it, and a decode instance reading from it (model, prefill, decode, dir)."""
    model, dump_dir = "tiny-qwen3-next", tmp_path_factory.mktemp("caches")
    prefill_config = config("prefill", model, 2, dump_dir, "prefill-sc", stream_scribble_s=0.03)
    prefill = start_prefill(prefill_config, "prefill-sc", lease_s=5.0)
    decode = start_decode(config("decode", model, 1, dump_dir, "decode-sc"), "decode-sc",
                          [prefill])  # fmt: skip
    yield model, prefill, decode, dump_dir
    decode.close()
    prefill.close()


def test_decode_never_reads_a_group_before_every_prefill_rank_publishes_it(scribbled):
    model, prefill, decode, dump_dir = scribbled
    assert_streamed_exactly(model, prefill, decode, dump_dir, "scribbled", prompt(3, 100))
    wait_idle(prefill)
    wait_idle(decode)


def test_a_stream_aborted_midway_frees_both_sides_and_the_next_request_is_exact(scribbled):
    model, prefill, decode, dump_dir = scribbled
    ids = prompt(4, 100)  # 4 chunks x 4 groups of 30 ms scribbling: about 0.5 s
    ticket = prefill.worker.prefill(PrefillRequest("aborted", tuple(ids), MAX_TOKENS))
    outcome: list[BaseException | None] = []

    def run_decode() -> None:
        try:
            list(decode.worker.decode(DecodeRequest(ticket, MAX_TOKENS)))
            outcome.append(None)
        except (ControlError, PdxferError) as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run_decode)
    thread.start()
    time.sleep(0.2)  # decode holds the ticket and has read some groups
    assert prefill.worker.store.holder("aborted") == "decode-sc"
    prefill.worker.store.abort("aborted", "test: prefill gives up midway")
    thread.join(WAIT_S)
    assert not thread.is_alive()
    assert outcome and isinstance(outcome[0], (ControlError, PdxferError))
    wait_idle(prefill)
    wait_idle(decode)
    # the freed slot and blocks serve the next stream exactly: no late byte lands in them
    assert_streamed_exactly(model, prefill, decode, dump_dir, "after-abort", ids)


def test_a_stream_after_a_prefix_hit_on_both_sides_reads_only_the_new_tokens(tmp_path):
    model = "tiny-kimi-linear"
    cached = {"prefix_cache": True, "state_checkpoints": 2}
    prefill = start_prefill(config("prefill", model, 1, tmp_path, "prefill-pc", **cached),
                            "prefill-pc")  # fmt: skip
    decode = start_decode(config("decode", model, 1, tmp_path, "decode-pc", prefix_cache=True),
                          "decode-pc", [prefill])  # fmt: skip
    try:
        # the prefill hit ends 64 tokens into the second block (copied on write); decode
        # holds the first block whole
        hit_at = prefill.instance.block_size + PREFIX_UNIT
        first = prompt(5, hit_at + 5)
        assert_streamed_exactly(model, prefill, decode, tmp_path, "turn-1", first)
        turn = first + prompt(6, 20)
        ticket, events = serve_one(prefill, decode, "turn-2", turn)
        held = len(first) // prefill.instance.block_size * prefill.instance.block_size
        assert (ticket.cached_tokens, events[0].reused_decode_tokens) == (hit_at, held)
        assert [e.token for e in events] == reference_generate(get_preset(model), turn, MAX_TOKENS)
        assert check_request(get_preset(model), tmp_path, "turn-2", 1, 1).problems == ()
        per_token = sum(lay.kv_bytes_per_token for lay in decode.instance.layouts)
        assert events[0].kv_bytes == per_token * (len(turn) - held)
    finally:
        decode.close()
        prefill.close()
