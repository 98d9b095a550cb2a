"""What crosses between the connector's two halves inside vLLM.

- Worker -> scheduler, once at start-up (vLLM's `get_handshake_metadata` /
  `set_xfer_handshake_metadata`): each TP rank's `RankHandshake`, which the scheduler half's
  gRPC TransferService answers Handshake with.
- Scheduler -> workers, every step (`build_connector_meta` / `bind_connector_metadata`):
  `StepMetadata`, the loads to start on decode and the releases to report on prefill; with a
  load from a prefill instance the workers have not read yet, that instance's `PrefillPeer`
  (the scheduler half handshakes, so no worker ever waits on the control plane).

Plain, picklable dataclasses: vLLM pickles them between its processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)

from transfer.vllm.ticket import Ticket


@dataclass(frozen=True)
class RankHandshake(KVConnectorHandshakeMetadata):
    """One TP rank's registration: what a peer needs to read its memory.

    layout: the rank's `Layout.to_dict()`, offsets over the registered regions.
    agent_metadata: the transport's opaque metadata (`Transport.register`).
    stage_start / stage_slot_bytes: the rank's stage slots (`stage_tail`), slot `s` at
    `stage_start + s * stage_slot_bytes`; slot bytes 0: this rank stages nothing.
    digest_start / digest_slot_bytes: the rank's digest tables (`digests`, verify), slot `s`
    at `digest_start + s * digest_slot_bytes`; slot bytes 0: verify is off.
    """

    tp_rank: int
    tp_size: int
    layout: dict
    agent_metadata: bytes
    stage_start: int = 0
    stage_slot_bytes: int = 0
    digest_start: int = 0
    digest_slot_bytes: int = 0


@dataclass(frozen=True)
class StageSpec:
    """Prefill: gather the first `tokens` tokens of attention block `block` into stage slot
    `slot` once this step's forward has written them."""

    request_id: str
    block: int
    tokens: int
    slot: int


@dataclass(frozen=True)
class PrefillPeer:
    """A prefill instance as its Handshake reply describes it, one entry per prefill TP rank.

    layouts: each rank's layout as JSON bytes (`Layout.to_dict()`, as `RankHandshake.layout`).
    agent_metadata: each rank's transport metadata, for `TransferAgent.connect`.
    """

    instance_id: str
    layouts: tuple[bytes, ...]
    agent_metadata: tuple[bytes, ...]


@dataclass(frozen=True)
class DigestSpec:
    """Prefill (verify): digest the request's cache into digest slot `slot` once this step's
    forward has written it. block_ids: the ticket's, per vLLM KV-cache group."""

    request_id: str
    block_ids: tuple[tuple[int, ...], ...]
    num_tokens: int
    slot: int


@dataclass(frozen=True)
class LoadSpec:
    """One request decode pulls: the prefill ticket and where its cache lands locally.

    block_ids: per vLLM KV-cache group, this side's block ids, as allocated.
    num_tokens: tokens whose cache crosses (the prompt minus its last token).
    """

    request_id: str
    ticket: Ticket
    block_ids: tuple[tuple[int, ...], ...]
    num_tokens: int


@dataclass
class StepMetadata(KVConnectorMetadata):
    """One scheduler step's orders to every worker.

    loads: requests whose reads start now (decode).
    released: request ids whose prefill blocks decode released or whose lease lapsed; each
        worker reports them back as finished sending, and vLLM then frees the blocks.
    stages: prefill's partial last blocks to gather after this step's forward.
    peers: by control address, the prefill instances this step's loads read that no earlier
        step's loads did (each announced with the first load that needs it).
    digests: prefill's requests to digest after this step's forward (verify).
    """

    loads: list[LoadSpec] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    stages: list[StageSpec] = field(default_factory=list)
    peers: dict[str, PrefillPeer] = field(default_factory=dict)
    digests: list[DigestSpec] = field(default_factory=list)
