"""The commands a worker's control process runs on its rank processes (`RankWorker`), and
what each rank answers. Torch-free: the control process imports it."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

from transfer.control.types import GREEDY, SamplingParams
from transfer.serving.ranks.rank_protocol import RankCommand
from transfer.serving.ranks.spec import Copies, RankReads
from transfer.serving.role import ServeRole

if TYPE_CHECKING:
    from transfer.serving.ranks.rank_worker import RankWorker


@dataclass(frozen=True)
class RankInfo:
    """What the handshake publishes of one rank."""

    metadata: bytes  # transport metadata
    layout: bytes  # the rank's Layout as JSON


@dataclass(frozen=True)
class TokenPick:
    """The token the ranks picked (rank 0's choice, on every rank) and its logprob."""

    token: int
    logprob: float


class TransferState(enum.Enum):
    PENDING = "pending"
    DONE = "done"  # every READ landed; the slot is READY
    FAILED = "failed"


@dataclass(frozen=True)
class RankTransferStatus:
    """One rank's view of a transfer into it."""

    state: TransferState
    seconds: float = 0.0  # from posting to the first poll that saw every READ done
    reason: str = ""  # why it failed
    progress: tuple[int, ...] = ()  # a stream's latest progress words (the reading rank's)


@dataclass(frozen=True)
class StreamSource:
    """Where a streamed request's progress is: its entry's arena offset on each prefill
    rank. One decode rank reads them all (`reader_rank`)."""

    entries: tuple[int, ...]
    reader_rank: int = 0


@dataclass(frozen=True)
class Info(RankCommand[RankInfo]):
    def apply(self, worker: RankWorker) -> RankInfo:
        return worker.info()


@dataclass(frozen=True)
class AddPeers(RankCommand[None]):
    """Connect to every rank of prefill instance `instance` (`staging`: arena offsets of
    their staging areas, read once to set the connections up)."""

    instance: str
    metadata: tuple[bytes, ...]
    staging: tuple[int, ...]

    def apply(self, worker: RankWorker) -> None:
        worker.add_peers(self.instance, list(self.metadata), list(self.staging))


@dataclass(frozen=True)
class PrefillChunk:
    """`tokens` of a prompt after its first `context_len` (0: the prompt starts here, in
    a FREE slot), into `block_ids`/`slot`; the chunk that ends the prompt picks token 0 of
    the `sampling` stream. Prefix cache: `restore_from` (a checkpoint slot, or -1) is copied
    into `slot` before the step (the state after `context_len` cached tokens), and `slot`
    is copied into `checkpoint_to` (or -1) after it. A hit that ends inside a block names
    the cached block holding its last rows as `copy_block` (or -1): its first
    `context_len % block_size` KV rows are copied into the prompt's own block at
    `context_len // block_size` before the step (copy on write). A streamed prompt's chunks
    publish their progress (`transfer.serving.ranks.progress`) as the step's layer groups finish."""

    tokens: tuple[int, ...]
    context_len: int
    block_ids: tuple[int, ...]
    slot: int
    sampling: SamplingParams = GREEDY
    restore_from: int = -1
    checkpoint_to: int = -1
    stream_key: int = 0  # layer-wise streaming: publish progress under this key (0: don't)
    ends_prompt: bool = False  # this chunk's pick is the prompt's first token
    copy_block: int = -1


@dataclass(frozen=True)
class PrefillBatch(RankCommand[tuple[TokenPick, ...]]):
    """One forward step over several prompts' chunks (varlen, one all-reduce per sublayer
    for all); answers a pick per chunk (meaningful only for chunks that end a prompt). A
    batch that fails its checks runs nothing."""

    chunks: tuple[PrefillChunk, ...]

    def apply(self, worker: RankWorker) -> tuple[TokenPick, ...]:
        return worker.prefill_batch(self.chunks)


@dataclass(frozen=True)
class StageGather(RankCommand[None]):
    """Pack `copies[rank]` (a held ticket's ranges) into this rank's staging area."""

    copies: tuple[Copies, ...]

    def apply(self, worker: RankWorker) -> None:
        worker.stage_gather(self.copies[worker.spec.rank])


@dataclass(frozen=True)
class Snapshot(RankCommand[None]):
    """Write this rank's cache of the request for `launch --verify`."""

    request_id: str
    side: ServeRole  # PREFILL or DECODE
    block_ids: tuple[int, ...]
    slot: int
    num_tokens: int

    def apply(self, worker: RankWorker) -> None:
        worker.snapshot(
            self.request_id, self.side, list(self.block_ids), self.slot, self.num_tokens
        )


@dataclass(frozen=True)
class Release(RankCommand[None]):
    slot: int

    def apply(self, worker: RankWorker) -> None:
        worker.release(self.slot)


@dataclass(frozen=True)
class TransferStart(RankCommand[RankTransferStatus]):
    """Mark `slot`/`block_ids` FILLING and post each rank's READs (`reads[rank]`); a
    `stream` also starts reading the prefill ranks' progress. Answers the transfer's
    status: DONE already for a small whole transfer that landed within the rank's
    `TRANSFER_SETTLE_S`."""

    request_id: str
    instance: str
    reads: tuple[RankReads, ...]
    slot: int
    block_ids: tuple[int, ...]
    deadline_s: float
    stream: StreamSource | None = None  # more READs follow (`TransferPost`) as prefill runs

    def apply(self, worker: RankWorker) -> RankTransferStatus:
        return worker.transfer_start(
            self.request_id,
            self.instance,
            self.reads,
            self.slot,
            list(self.block_ids),
            self.deadline_s,
            self.stream,
        )


@dataclass(frozen=True)
class TransferPost(RankCommand[None]):
    """Post more READs (`reads[rank]`) of a streamed transfer; `last` seals it: it is DONE
    once every READ posted so far has landed."""

    request_id: str
    reads: tuple[RankReads, ...]
    last: bool = False

    def apply(self, worker: RankWorker) -> None:
        worker.transfer_post(self.request_id, self.reads, self.last)


@dataclass(frozen=True)
class TransferPoll(RankCommand[RankTransferStatus]):
    request_id: str

    def apply(self, worker: RankWorker) -> RankTransferStatus:
        return worker.transfer_poll(self.request_id)


@dataclass(frozen=True)
class TransferEnd(RankCommand[bool]):
    """Forget the transfer; answers whether none of its READs can still move bytes."""

    request_id: str

    def apply(self, worker: RankWorker) -> bool:
        return worker.transfer_end(self.request_id)


@dataclass(frozen=True)
class TransferSettled(RankCommand[bool]):
    """Whether no READ of an ended transfer can still move bytes."""

    request_id: str

    def apply(self, worker: RankWorker) -> bool:
        return worker.transfer_settled(self.request_id)


@dataclass(frozen=True)
class DecodeStep:
    """One request's part of a `DecodeBatch`: feed `token` at `position`; its pick is the
    next token, token `index` of the `sampling` stream (0 is the one prefill picked).
    `token` None feeds what the slot's previous decode step picked, which must have been
    for `position`: a step sent before that pick came back (pipelined decode)."""

    token: int | None
    position: int
    block_ids: tuple[int, ...]
    slot: int
    sampling: SamplingParams = GREEDY
    index: int = 1


@dataclass(frozen=True)
class DecodeBatch(RankCommand[tuple[TokenPick, ...]]):
    """One forward step for several requests, each a `DecodeStep` (one token each, distinct
    slots and blocks): one all-reduce per sublayer for the whole batch. Answers their picks
    in order. A batch that fails its checks runs nothing."""

    steps: tuple[DecodeStep, ...]

    def apply(self, worker: RankWorker) -> tuple[TokenPick, ...]:
        return worker.decode_batch(self.steps)
