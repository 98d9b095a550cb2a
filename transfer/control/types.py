"""Frozen dataclasses that cross the control-plane boundary, and their validation.

Core code sees only these; `convert.py` maps them to and from protobuf.
"""

from __future__ import annotations

import enum
import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass

from transfer.errors import InvalidInput

WIRE_VERSION = "1"
COMPAT_FIELDS = ("geometry", "dtypes", "block_size", "layout_version", "wire_version")
MAX_ID_LEN = 256


class FreeReason(str, enum.Enum):
    """Why a ticket's blocks and slot went back to the prefill pools."""

    RELEASED = "released"
    ABORTED = "aborted"
    EXPIRED = "expired"


@dataclass(frozen=True)
class ControlConfig:
    """Bounds the control plane validates against, and the lease length.

    `block_size` ties the block count to the token count: a ticket holds exactly
    ceil(num_tokens / block_size) blocks.
    """

    num_kv_blocks: int
    num_state_slots: int
    block_size: int
    max_blocks_per_request: int
    lease_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("num_kv_blocks", "num_state_slots", "block_size", "max_blocks_per_request"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidInput(f"{name}: must be a positive int, got {value!r}")
        if not (
            isinstance(self.lease_s, (int, float))
            and math.isfinite(self.lease_s)
            and self.lease_s > 0
        ):
            raise InvalidInput(
                f"lease_s: must be a positive number of seconds, got {self.lease_s!r}"
            )


@dataclass(frozen=True)
class Ticket:
    """One finished prefill: where its cache lives and until when it is kept.

    `lease_deadline` is unix seconds; `address` is the prefill instance's control endpoint.
    """

    request_id: str
    instance_id: str
    block_ids: tuple[int, ...]
    slot_id: int
    num_tokens: int
    first_token: int
    lease_deadline: float
    address: str = ""
    first_logprob: float = 0.0  # the first token's log-probability under the model
    abort_key: str = ""  # Abort must present it (drawn by the prefill instance)
    cached_tokens: int = 0  # prompt tokens served from the prefill side's prefix cache
    block_hashes: tuple[bytes, ...] = ()  # chained hash of each full prompt block
    stream_key: int = 0  # non-zero: published before prefill ran (docs/streaming.md)

    def same_publish(self, other: Ticket) -> bool:
        """Whether `other` is this publish (a renewed lease changes only its deadline): a
        freed ticket never returns under its abort key."""
        mine = (self.request_id, self.abort_key, self.block_ids, self.slot_id, self.num_tokens)
        return mine == (other.request_id, other.abort_key, other.block_ids, other.slot_id,
                        other.num_tokens)  # fmt: skip


@dataclass(frozen=True)
class HandshakeRequest:
    instance_id: str
    compat: Mapping[str, str]
    compat_hash: str


@dataclass(frozen=True)
class HandshakeReply:
    """What a decode instance learns about a prefill instance, per TP rank (opaque bytes)."""

    instance_id: str
    compat: Mapping[str, str]
    compat_hash: str
    rank_metadata: tuple[bytes, ...] = ()
    rank_layouts: tuple[bytes, ...] = ()


MAX_STAGE_RANGES = 1 << 20  # per rank: a request's ranges, never more than its blocks x layers


@dataclass(frozen=True)
class RankGather:
    """The byte ranges one prefill rank packs back to back, in order."""

    src_offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return sum(self.lengths)


@dataclass(frozen=True)
class StageRequest:
    """Pack `ranks[r]`'s ranges on prefill rank r into staging (one entry per rank)."""

    request_id: str
    holder: str
    ranks: tuple[RankGather, ...]

    @property
    def nbytes(self) -> int:
        """The staging extent one rank needs: the largest rank's bytes."""
        return max((g.nbytes for g in self.ranks), default=0)


MAX_SEED = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    """How a request's tokens are picked. Temperature 0 is greedy; otherwise softmax of
    logits / temperature, cut to the smallest set of tokens whose probability reaches
    `top_p`, drawn with a generator seeded from (seed, token index). The router fills a
    missing seed, so prefill and decode draw from one stream."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        t, p = self.temperature, self.top_p
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise InvalidInput(f"sampling.temperature: must be a finite number >= 0, got {t!r}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise InvalidInput(f"sampling.top_p: must be in (0, 1], got {p!r}")
        seed = self.seed
        if seed is not None and (
            isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED
        ):
            raise InvalidInput(f"sampling.seed: must be an int in [0, 2**64), got {seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = SamplingParams()


@dataclass(frozen=True)
class PrefillRequest:
    request_id: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = GREEDY


@dataclass(frozen=True)
class DecodeRequest:
    ticket: Ticket
    max_tokens: int
    sampling: SamplingParams = GREEDY


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = GREEDY


@dataclass(frozen=True)
class TokenEvent:
    """One generated token; the transfer figures are filled on the first event of a request."""

    request_id: str
    token: int
    index: int
    finished: bool = False
    ttft_ms: float = 0.0
    transfer_ms: float = 0.0
    kv_bytes: int = 0
    state_bytes: int = 0
    descriptors: int = 0
    logprob: float = 0.0  # the token's log-probability under the model (before sampling)
    cached_prompt_tokens: int = 0  # prompt tokens the prefill side found in its prefix cache
    reused_decode_tokens: int = 0  # prompt tokens whose KV the decode side already held
    exposed_transfer_ms: float = 0.0  # prefill done -> decode holds every byte (docs/streaming.md)


def make_compat(
    *, geometry: str, dtypes: str, block_size: int, layout_version: str | int, **extra: str
) -> dict[str, str]:
    """The compatibility fields of this build; the caller names its geometry and dtypes, the wire version is ours."""
    fields = {
        "geometry": str(geometry),
        "dtypes": str(dtypes),
        "block_size": str(block_size),
        "layout_version": str(layout_version),
        "wire_version": WIRE_VERSION,
        **{k: str(v) for k, v in extra.items()},
    }
    validate_compat(fields)
    return fields


def compat_hash(fields: Mapping[str, str]) -> str:
    """sha256 over the sorted `key=value` lines."""
    text = "\n".join(f"{k}={fields[k]}" for k in sorted(fields))
    return hashlib.sha256(text.encode()).hexdigest()


def compat_mismatch(ours: Mapping[str, str], theirs: Mapping[str, str]) -> list[str]:
    """Names of the fields whose values differ (a key missing on one side counts)."""
    return sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))


def validate_compat(fields: Mapping[str, str], name: str = "compat") -> None:
    missing = [k for k in COMPAT_FIELDS if not fields.get(k)]
    if missing:
        raise InvalidInput(f"{name}.{missing[0]}: required compatibility field is missing or empty")


def validate_id(value: str, name: str) -> None:
    if not isinstance(value, str) or not value:
        raise InvalidInput(f"{name}: must be a non-empty string")
    if len(value) > MAX_ID_LEN or not value.isprintable():
        raise InvalidInput(f"{name}: must be at most {MAX_ID_LEN} printable characters")


def validate_blocks(block_ids: tuple[int, ...], slot_id: int, config: ControlConfig) -> None:
    """Range and uniqueness of a ticket's block ids and slot id."""
    if len(block_ids) > config.max_blocks_per_request:
        raise InvalidInput(
            f"block_ids: {len(block_ids)} blocks exceed max_blocks_per_request={config.max_blocks_per_request}"
        )
    seen: set[int] = set()
    for i, block in enumerate(block_ids):
        if not 0 <= block < config.num_kv_blocks:
            raise InvalidInput(
                f"block_ids[{i}]: {block} is out of range [0, {config.num_kv_blocks})"
            )
        if block in seen:
            raise InvalidInput(f"block_ids[{i}]: block {block} appears twice")
        seen.add(block)
    if not 0 <= slot_id < config.num_state_slots:
        raise InvalidInput(f"slot_id: {slot_id} is out of range [0, {config.num_state_slots})")


def validate_ticket_fields(
    request_id: str,
    block_ids: tuple[int, ...],
    slot_id: int,
    num_tokens: int,
    first_token: int,
    config: ControlConfig,
) -> None:
    """Everything a prefill must get right before its ticket is published."""
    validate_id(request_id, "request_id")
    if num_tokens < 1:
        raise InvalidInput(f"num_tokens: must be >= 1, got {num_tokens}")
    if first_token < 0:
        raise InvalidInput(f"first_token: must be >= 0, got {first_token}")
    validate_blocks(block_ids, slot_id, config)
    expected = -(-num_tokens // config.block_size)
    if len(block_ids) != expected:
        raise InvalidInput(
            f"block_ids: {len(block_ids)} blocks for {num_tokens} tokens, expected {expected} "
            f"(block_size={config.block_size})"
        )
