"""One record per request, with its phase. Only the engine thread moves a request from one
phase to the next; a gRPC handler only submits the request and drains `out`.

Decode:  ACQUIRING -> ACQUIRED -> TRANSFERRING -> RUNNING -> DONE
         ACQUIRING -> TRANSFERRING: a direct READ starts before its Acquire answers (its
                      transfer counts as done only once `acquired`)
         ACQUIRED, TRANSFERRING or RUNNING -> HELD (a READ may still land) -> DONE
Prefill: QUEUED -> ALLOCATED -> PREFILLING -> PUBLISHED -> DONE (`Prompt`); any phase may end
in DONE on a failure. Layer-wise streaming publishes its ticket at ALLOCATED, before the
prompt has run (the handler gets the ticket then), and reaches PUBLISHED once it has.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from transfer.cache.prefix_cache import PrefixHit
from transfer.control.types import DecodeRequest, PrefillRequest, Ticket

logger = logging.getLogger(__name__)


class DecodePhase(enum.Enum):
    ACQUIRING = "acquiring"  # handshaking with its prefill instance, or acquiring the ticket
    ACQUIRED = "acquired"  # the ticket is ours; waiting for room, or planning its READs
    TRANSFERRING = "transferring"  # READs posted on the ranks
    RUNNING = "running"  # in the decode batch
    HELD = "held"  # ended, but a READ may still land in its cache: kept out of the pools
    DONE = "done"  # its cache is back in the pools and its stream has ended


class PrefillPhase(enum.Enum):
    QUEUED = "queued"  # waiting for room (or for the free of an earlier request of its id)
    ALLOCATED = "allocated"  # blocks and slot taken; no chunk has run yet
    PREFILLING = "prefilling"  # some of its chunks ran (or a dump snapshot is being written)
    PUBLISHED = "published"  # its whole cache is written and its ticket is live
    DONE = "done"  # its cache is back in the pools (or it never had one)


END = object()  # the last item of a request's `out`, after its last token


@dataclass(eq=False)  # compared by identity
class Request:
    """A decode request on this instance, from its ticket's arrival to its cache's return.

    It owns what it takes: `blocks` and `slot` (allocated by the cache manager), its staging
    extent (keyed by `request_id` in the staging pool), the acquired `ticket`, and `out`, the
    queue its handler drains: TokenEvents, then `END` or the exception that ended it (or
    `sink`, which gets them a step at a time).
    """

    decode: DecodeRequest
    arrived: float = field(default_factory=time.perf_counter)
    phase: DecodePhase = DecodePhase.ACQUIRING
    ticket: Ticket | None = None  # the router's copy until the Acquire answers, then its answer
    ticket_open: bool = False  # acquired and neither released nor aborted yet
    acquired: bool = False  # the Acquire answered with the ticket its READs use
    blocks: tuple[int, ...] = ()
    slot: int = -1
    held_prefix: int = 0  # leading blocks the prefix cache already had
    prompt_blocks: tuple[int, ...] = ()  # the blocks the prompt's KV fills
    peer: Any = None  # the prefill instance it reads from (`peers.Peer`)
    transfer: Any = None  # the transfer in flight (`transfers.Transfer`)
    transfer_started: bool = False  # TransferStart sent: its end must be asked of the ranks
    exposed_s: float = 0.0  # the transfer as TTFT saw it
    last_token: int = -1  # the last pick delivered
    scheduled: int = 0  # decode steps sent to the ranks
    delivered: int = 0  # of those, steps whose pick came back
    # Its steps sent before this count went up are void: they fail at the ranks for want
    # of a pick, or their answers are ignored (`decode_batches`).
    resends: int = 0
    alone: bool = False  # a batch holding it failed its checks: its next steps run alone
    error: BaseException | None = None
    transfer_failure: str = ""  # why its transfer failed (the error says once it settled)
    waiting_on: int = 0  # its calls out (a plan, a peer call) whose answers must come first
    cancelled: bool = False  # set by the handler's thread when its consumer leaves
    # Set by the handler's thread once its consumer asks for token 1: decoding starts
    # then, so token 0 arrives with the cache exactly as transferred (docs/bugs.md #14).
    consumer_ready: bool = False
    waited_since: float = 0.0  # when it started waiting for room (time.monotonic())
    out: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    # Instead of `out`: called on the engine thread with each step's [(sink_tag, item)] of
    # every request sharing the sink (item: a TokenEvent, the error, or None at the end).
    sink: Any = None
    sink_tag: Any = None
    released: threading.Event = field(default_factory=threading.Event)  # no step touches it

    @property
    def request_id(self) -> str:
        return self.decode.ticket.request_id

    @property
    def address(self) -> str:
        return self.decode.ticket.address

    @property
    def max_tokens(self) -> int:
        return self.decode.max_tokens

    @property
    def last_index(self) -> int:
        """The stream index of its last token."""
        return self.max_tokens - 1

    @property
    def wants_step(self) -> bool:
        """Running, alive, and not yet sent a step for its last token."""
        alive = self.phase is DecodePhase.RUNNING and self.error is None and not self.cancelled
        alive = alive and self.consumer_ready
        return alive and 1 + self.scheduled <= self.last_index

    @property
    def steps_out(self) -> int:
        """Its decode steps at the ranks whose picks have not come back."""
        return self.scheduled - self.delivered


NO_HIT = PrefixHit((), None, 0)


def _never() -> bool:
    return False


@dataclass(eq=False)  # compared by identity
class Prompt:
    """A prefill request on this instance, from its arrival to its cache's return.

    It owns its `blocks` and `slot`, its prefix `hit` (references on cached blocks, a pinned
    checkpoint) until its first chunk has copied them, its staging extent (keyed by
    `request_id` in the staging pool), its `ticket`, and `out`, which its handler drains:
    the Ticket, or the exception that ended it.
    """

    prefill: PrefillRequest
    is_cancelled: Callable[[], bool] = _never  # the caller went away (any thread may ask)
    phase: PrefillPhase = PrefillPhase.QUEUED
    arrived: float = field(default_factory=time.monotonic)
    blocks: tuple[int, ...] = ()
    slot: int = -1
    hit: PrefixHit = NO_HIT
    hashes: tuple[bytes, ...] = ()  # one per full block: the ticket's, for decode and the router
    unit_hashes: tuple[bytes, ...] = ()  # one per full PREFIX_UNIT: this instance's prefix cache
    stops: dict[int, bytes] = field(default_factory=dict)  # checkpoint position -> unit hash
    cached_tokens: int = 0  # its prefix hit's tokens (in the cache before its first chunk)
    done: int = 0  # prompt tokens already in the cache
    restore_from: int = -1  # the checkpoint slot to start from (until the first chunk ran)
    copy_block: int = -1  # the cached block whose rows the hit ends in (until the first chunk)
    stream_key: int = 0  # layer-wise streaming: the ranks publish progress under this key
    alone: bool = False  # a batch holding it failed its checks: its next chunk runs alone
    first: Any = None  # the TokenPick its last chunk made
    ticket: Ticket | None = None
    waited_since: float = 0.0  # when it started waiting for room (time.monotonic())
    frees_seen: int = -1  # the cache's free count at its last try for room
    out: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    released: threading.Event = field(default_factory=threading.Event)  # no step touches it
    transfer_started: bool = False  # never: no READ lands in a prefill instance's cache

    @property
    def request_id(self) -> str:
        return self.prefill.request_id

    @property
    def cancelled(self) -> bool:
        """`is_cancelled()`, false if it raises: a broken callback must not stop the loop."""
        try:
            return self.is_cancelled()
        except Exception:  # noqa: BLE001
            logger.exception("is_cancelled of %r failed", self.request_id)
            return False

    @property
    def prompt_ids(self) -> tuple[int, ...]:
        return self.prefill.prompt_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prefill.prompt_ids)
