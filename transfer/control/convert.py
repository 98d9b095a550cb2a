"""protobuf <-> frozen dataclasses. With server.py and client.py, the only code that imports `gen`.

`*_from_pb` also checks the shape of what arrived (ids non-empty, counts and
indices non-negative, deadlines finite) and raises `InvalidInput` naming the
field, so a malformed message never reaches core code.
"""

from __future__ import annotations

import math

from transfer.control.gen import transfer_pb2, worker_pb2
from transfer.control.types import (
    MAX_STAGE_RANGES,
    DecodeRequest,
    GenerateRequest,
    HandshakeReply,
    HandshakeRequest,
    PrefillRequest,
    RankGather,
    SamplingParams,
    StageRequest,
    Ticket,
    TokenEvent,
    validate_id,
)
from transfer.errors import InvalidInput

BLOCK_HASH_BYTES = 16  # transfer.cache.prefix_cache.block_hashes


def ticket_to_pb(t: Ticket) -> transfer_pb2.Ticket:
    return transfer_pb2.Ticket(
        request_id=t.request_id,
        instance_id=t.instance_id,
        address=t.address,
        block_ids=list(t.block_ids),
        slot_id=t.slot_id,
        num_tokens=t.num_tokens,
        first_token=t.first_token,
        lease_deadline=t.lease_deadline,
        first_logprob=t.first_logprob,
        abort_key=t.abort_key,
        cached_tokens=t.cached_tokens,
        block_hashes=list(t.block_hashes),
        stream_key=t.stream_key,
    )


def ticket_from_pb(m: transfer_pb2.Ticket, prefix: str = "") -> Ticket:
    validate_id(m.request_id, f"{prefix}request_id")
    for i, block in enumerate(m.block_ids):
        if block < 0:
            raise InvalidInput(f"{prefix}block_ids[{i}]: must be >= 0, got {block}")
    _non_negative(m.slot_id, f"{prefix}slot_id")
    if m.num_tokens < 1:
        raise InvalidInput(f"{prefix}num_tokens: must be >= 1, got {m.num_tokens}")
    _non_negative(m.first_token, f"{prefix}first_token")
    if not 0 <= m.cached_tokens < m.num_tokens:
        raise InvalidInput(
            f"{prefix}cached_tokens: must be in [0, num_tokens), got {m.cached_tokens}"
        )
    if len(m.block_hashes) > len(m.block_ids) or any(
        len(h) != BLOCK_HASH_BYTES for h in m.block_hashes
    ):
        raise InvalidInput(
            f"{prefix}block_hashes: at most one {BLOCK_HASH_BYTES}-byte hash per block, got "
            f"{len(m.block_hashes)} for {len(m.block_ids)} blocks"
        )
    if not math.isfinite(m.lease_deadline):
        raise InvalidInput(f"{prefix}lease_deadline: must be finite, got {m.lease_deadline}")
    return Ticket(
        request_id=m.request_id,
        instance_id=m.instance_id,
        block_ids=tuple(m.block_ids),
        slot_id=m.slot_id,
        num_tokens=m.num_tokens,
        first_token=m.first_token,
        lease_deadline=m.lease_deadline,
        address=m.address,
        first_logprob=m.first_logprob,
        abort_key=m.abort_key,
        cached_tokens=m.cached_tokens,
        block_hashes=tuple(m.block_hashes),
        stream_key=m.stream_key,
    )


def handshake_request_to_pb(r: HandshakeRequest) -> transfer_pb2.HandshakeRequest:
    return transfer_pb2.HandshakeRequest(
        instance_id=r.instance_id, compat=dict(r.compat), compat_hash=r.compat_hash
    )


def handshake_request_from_pb(m: transfer_pb2.HandshakeRequest) -> HandshakeRequest:
    validate_id(m.instance_id, "instance_id")
    return HandshakeRequest(
        instance_id=m.instance_id, compat=dict(m.compat), compat_hash=m.compat_hash
    )


def handshake_reply_to_pb(r: HandshakeReply) -> transfer_pb2.HandshakeReply:
    return transfer_pb2.HandshakeReply(
        instance_id=r.instance_id,
        compat=dict(r.compat),
        compat_hash=r.compat_hash,
        rank_metadata=list(r.rank_metadata),
        rank_layouts=list(r.rank_layouts),
    )


def handshake_reply_from_pb(m: transfer_pb2.HandshakeReply) -> HandshakeReply:
    return HandshakeReply(
        instance_id=m.instance_id,
        compat=dict(m.compat),
        compat_hash=m.compat_hash,
        rank_metadata=tuple(m.rank_metadata),
        rank_layouts=tuple(m.rank_layouts),
    )


def stage_request_to_pb(r: StageRequest) -> transfer_pb2.StageRequest:
    return transfer_pb2.StageRequest(
        request_id=r.request_id,
        holder=r.holder,
        ranks=[
            transfer_pb2.RankGather(src_offsets=list(g.src_offsets), lengths=list(g.lengths))
            for g in r.ranks
        ],
    )


def stage_request_from_pb(m: transfer_pb2.StageRequest) -> StageRequest:
    validate_id(m.request_id, "request_id")
    validate_id(m.holder, "holder")
    ranks = []
    for r, g in enumerate(m.ranks):
        field = f"ranks[{r}]"
        if len(g.src_offsets) != len(g.lengths):
            raise InvalidInput(
                f"{field}: {len(g.src_offsets)} src_offsets but {len(g.lengths)} lengths"
            )
        if len(g.lengths) > MAX_STAGE_RANGES:
            raise InvalidInput(f"{field}: at most {MAX_STAGE_RANGES} ranges")
        for i, (src, n) in enumerate(zip(g.src_offsets, g.lengths, strict=True)):
            _non_negative(src, f"{field}.src_offsets[{i}]")
            if n < 1:
                raise InvalidInput(f"{field}.lengths[{i}]: must be >= 1, got {n}")
        ranks.append(RankGather(tuple(g.src_offsets), tuple(g.lengths)))
    return StageRequest(m.request_id, m.holder, tuple(ranks))


def sampling_to_pb(s: SamplingParams) -> worker_pb2.Sampling:
    return worker_pb2.Sampling(temperature=s.temperature, top_p=s.top_p, seed=s.seed)


def sampling_from_pb(m: worker_pb2.Sampling) -> SamplingParams:
    """Unset fields are the defaults: temperature 0 (greedy), top_p 1, no seed."""
    return SamplingParams(
        temperature=m.temperature,
        top_p=m.top_p or 1.0,
        seed=m.seed if m.HasField("seed") else None,
    )


def prefill_request_to_pb(r: PrefillRequest) -> worker_pb2.PrefillRequest:
    return worker_pb2.PrefillRequest(
        request_id=r.request_id,
        prompt_ids=list(r.prompt_ids),
        max_tokens=r.max_tokens,
        sampling=sampling_to_pb(r.sampling),
    )


def prefill_request_from_pb(m: worker_pb2.PrefillRequest) -> PrefillRequest:
    _check_prompt(m.request_id, m.prompt_ids, m.max_tokens)
    return PrefillRequest(
        request_id=m.request_id,
        prompt_ids=tuple(m.prompt_ids),
        max_tokens=m.max_tokens,
        sampling=sampling_from_pb(m.sampling),
    )


def generate_request_to_pb(r: GenerateRequest) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(
        request_id=r.request_id,
        prompt_ids=list(r.prompt_ids),
        max_tokens=r.max_tokens,
        sampling=sampling_to_pb(r.sampling),
    )


def generate_request_from_pb(m: worker_pb2.GenerateRequest) -> GenerateRequest:
    _check_prompt(m.request_id, m.prompt_ids, m.max_tokens)
    return GenerateRequest(
        request_id=m.request_id,
        prompt_ids=tuple(m.prompt_ids),
        max_tokens=m.max_tokens,
        sampling=sampling_from_pb(m.sampling),
    )


def decode_request_to_pb(r: DecodeRequest) -> worker_pb2.DecodeRequest:
    return worker_pb2.DecodeRequest(
        ticket=ticket_to_pb(r.ticket), max_tokens=r.max_tokens, sampling=sampling_to_pb(r.sampling)
    )


def decode_request_from_pb(m: worker_pb2.DecodeRequest) -> DecodeRequest:
    if not m.HasField("ticket"):
        raise InvalidInput("ticket: required")
    if m.max_tokens < 1:
        raise InvalidInput(f"max_tokens: must be >= 1, got {m.max_tokens}")
    return DecodeRequest(
        ticket=ticket_from_pb(m.ticket, prefix="ticket."),
        max_tokens=m.max_tokens,
        sampling=sampling_from_pb(m.sampling),
    )


def token_event_to_pb(e: TokenEvent) -> worker_pb2.TokenEvent:
    return worker_pb2.TokenEvent(
        request_id=e.request_id,
        token=e.token,
        index=e.index,
        finished=e.finished,
        ttft_ms=e.ttft_ms,
        transfer_ms=e.transfer_ms,
        kv_bytes=e.kv_bytes,
        state_bytes=e.state_bytes,
        descriptors=e.descriptors,
        logprob=e.logprob,
        cached_prompt_tokens=e.cached_prompt_tokens,
        reused_decode_tokens=e.reused_decode_tokens,
        exposed_transfer_ms=e.exposed_transfer_ms,
    )


def token_event_from_pb(m: worker_pb2.TokenEvent) -> TokenEvent:
    return TokenEvent(
        request_id=m.request_id,
        token=m.token,
        index=m.index,
        finished=m.finished,
        ttft_ms=m.ttft_ms,
        transfer_ms=m.transfer_ms,
        kv_bytes=m.kv_bytes,
        state_bytes=m.state_bytes,
        descriptors=m.descriptors,
        logprob=m.logprob,
        cached_prompt_tokens=m.cached_prompt_tokens,
        reused_decode_tokens=m.reused_decode_tokens,
        exposed_transfer_ms=m.exposed_transfer_ms,
    )


def _check_prompt(request_id: str, prompt_ids, max_tokens: int) -> None:
    validate_id(request_id, "request_id")
    if not prompt_ids:
        raise InvalidInput("prompt_ids: must hold at least one token")
    for i, token in enumerate(prompt_ids):
        _non_negative(token, f"prompt_ids[{i}]")
    if max_tokens < 1:
        raise InvalidInput(f"max_tokens: must be >= 1, got {max_tokens}")


def _non_negative(value: int, name: str) -> None:
    if value < 0:
        raise InvalidInput(f"{name}: must be >= 0, got {value}")
