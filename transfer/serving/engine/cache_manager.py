"""An instance's cache, behind one `release(request)`: the pools, the prefix cache, the
staging pool, admission, and (decode) the held set (caches whose failed READs may still
land). A decode `Request` is admitted by `admit`, a prefill `Prompt` by `admit_prompt`;
both go back through `release`.

Only the engine thread calls it. Ranks are never called from here: what a step must tell
them (end a transfer, ask whether a held one settled, release a slot) is handed back as
rank commands for the engine's next step, and their answers come back through `ended` and
`settled`. Steps run in the order the engine sends them, so a slot released in step k is
free on the ranks before any transfer of step k or later reuses it; a transfer start that
overtakes (`DecodeEngine`) is sent only once step k has been answered (`overtake_after`).
"""

from __future__ import annotations

import logging
import time

from transfer.cache.block_hashes import block_hashes
from transfer.cache.pools import CacheFullError
from transfer.errors import CapacityError, DeadlineExceeded, InvalidInput, TransferFailed
from transfer.serving.engine.checkpoints import PREFIX_UNIT, checkpoint_positions, checkpoint_stops
from transfer.serving.engine.instance import Instance
from transfer.serving.engine.request import NO_HIT, DecodePhase, Prompt, Request
from transfer.serving.ranks.commands import Release, TransferEnd, TransferSettled
from transfer.serving.ranks.rank_protocol import RankCommand

logger = logging.getLogger(__name__)

ACQUIRED_WAIT_S = 5.0  # longest wait for room while holding a ticket
PROMPT_WAIT_S = 60.0  # longest wait for room of a prompt on a prefill instance
SETTLE_POLL_S = 0.5  # how often held caches of failed transfers are asked about


class CacheManager:
    """Admits requests into the pools and takes their caches back."""

    def __init__(self, instance: Instance, wait_s: float = ACQUIRED_WAIT_S) -> None:
        self.instance = instance
        self.pools = instance.pools
        self.prefix = instance.prefix
        self.staging = instance.staging
        self.wait_s = wait_s
        self.max_queue = instance.config.max_queue
        self.waiting: list[Request] = []  # acquired, waiting for room, oldest first
        self.held: dict[str, Request] = {}  # request id -> a request whose READs may land
        self._ending: list[Request] = []  # released: their transfer's end is still to ask
        self._asked: list[Request] = []  # TransferEnd sent, answer not in yet
        self._commands: list[RankCommand] = []  # frees for the next step
        self._freed: list[Request] = []  # freed by the commands above
        # ("slot" | "block", id) -> the step that carried its last Release
        self._released_in: dict[tuple[str, int], int] = {}
        self._last_settle_poll = 0.0
        self.frees = 0  # caches given back so far: a waiting request tries again after one

    # -- admission ------------------------------------------------------------------------

    def admit(self, request: Request, total_tokens: int) -> bool:
        """Blocks for `total_tokens` and a slot for `request` (True), or False while it waits
        for room. Raises when it can never fit (InvalidInput), when the queue is full
        (CapacityError), when it waited too long (DeadlineExceeded), or when a cache under its
        id is still held (TransferFailed: this attempt moved nothing)."""
        rid = request.request_id
        if rid in self.held:  # a retry under its id, while the last one's READs may land
            raise TransferFailed(
                f"request_id {rid!r}: an earlier transfer under this id may still move "
                "bytes, and its cache is held until it settles",
                settled=True,
            )
        need, total = self.pools.blocks_for(total_tokens), self.pools.blocks.num_total
        if need > total:
            raise InvalidInput(
                f"num_tokens: {total_tokens} tokens need {need} KV blocks of "
                f"{self.pools.block_size}; this instance has {total} in all (--gpu-mem)"
            )
        ticket, held = request.ticket, ()
        if self.prefix is not None and ticket.block_hashes:
            # the state always crosses whole, so every full prompt block counts
            held = self.prefix.match(ticket.block_hashes, ticket.num_tokens, rid, False).block_ids
        try:
            cache = self.pools.allocate(rid, total_tokens, held)
        except CacheFullError:
            if held:
                self.pools.blocks.free_request(rid)
            return self._wait(request)
        except BaseException:
            if held:
                self.pools.blocks.free_request(rid)
            raise
        if request in self.waiting:
            self.waiting.remove(request)
        request.blocks, request.slot = tuple(cache.block_ids), cache.slot_ids[0]
        request.held_prefix = len(held)
        return True

    def admit_prompt(self, prompt: Prompt) -> bool:
        """Blocks and a slot for `prompt`, behind its longest prefix hit (True), or False
        while it waits for room. Raises as `admit` does (InvalidInput, CapacityError,
        DeadlineExceeded)."""
        rid, num_tokens = prompt.request_id, prompt.num_tokens
        need, total = self.pools.blocks_for(num_tokens), self.pools.blocks.num_total
        if need > total:
            raise InvalidInput(
                f"num_tokens: {num_tokens} tokens need {need} KV blocks of "
                f"{self.pools.block_size}; this instance has {total} in all (--gpu-mem)"
            )
        prompt.frees_seen = self.frees
        if not prompt.hashes:
            prompt.hashes = block_hashes(prompt.prompt_ids, self.pools.block_size)
            prompt.unit_hashes = prompt.hashes
            if self.prefix is not None and self.pools.block_size != PREFIX_UNIT:
                prompt.unit_hashes = block_hashes(prompt.prompt_ids, PREFIX_UNIT)
        hit = NO_HIT
        if self.prefix is not None:
            hit = self.prefix.match(prompt.unit_hashes, num_tokens - 1, rid)
        try:
            cache = self.pools.allocate(rid, num_tokens, prefix_blocks=hit.block_ids)
        except BaseException as exc:
            if hit.block_ids:
                self.pools.blocks.free_request(rid)
            self._let_go(hit)
            if isinstance(exc, CacheFullError):
                return self._wait(prompt)
            raise
        self.forget_waiting(prompt)
        prompt.blocks, prompt.slot, prompt.hit = tuple(cache.block_ids), cache.slot_ids[0], hit
        prompt.done = prompt.cached_tokens = hit.num_tokens
        prompt.restore_from = -1 if hit.checkpoint_slot is None else hit.checkpoint_slot
        prompt.copy_block = -1 if hit.copy_from is None else hit.copy_from
        if self.prefix is not None:
            interval = self.instance.config.checkpoint_interval
            positions = checkpoint_positions(num_tokens, hit.num_tokens, interval)
            prompt.stops = checkpoint_stops(prompt.unit_hashes, positions)
        return True

    def let_go(self, prompt: Prompt) -> None:
        """The prompt's first chunk copied its hit's state and partial block (or never
        will): unpin the checkpoint and drop the reference on the block it copied from."""
        hit, prompt.hit = prompt.hit, NO_HIT
        self._let_go(hit)

    def _let_go(self, hit) -> None:
        if hit.checkpoint_slot is not None:
            self.prefix.unpin(hit.checkpoint_slot)
        if hit.copy_from is not None:
            self.prefix.release_copy_source(hit.copy_from)

    def _wait(self, request: Request | Prompt) -> bool:
        now = time.monotonic()
        if request not in self.waiting:
            if len(self.waiting) >= self.max_queue:
                raise CapacityError(
                    f"request {request.request_id!r}: no room, and {len(self.waiting)} "
                    f"requests already wait (--max-queue {self.max_queue})"
                )
            request.waited_since = now
            self.waiting.append(request)
        elif now - request.waited_since > self.wait_s:
            self.waiting.remove(request)
            raise DeadlineExceeded(
                f"request {request.request_id!r}: no room within {self.wait_s:g}s"
            )
        return False

    def forget_waiting(self, request: Request | Prompt) -> None:
        if request in self.waiting:
            self.waiting.remove(request)

    # -- release --------------------------------------------------------------------------

    def release(self, request: Request | Prompt) -> None:
        """Take `request`'s cache back, whatever ended it (done, failure, cancel). Once no
        READ of it can still land, its slot is released on the ranks and its blocks and
        slot go back to the pools; until then it is HELD (docs/bugs.md #14). A prompt's
        prefix hit is let go too."""
        self.forget_waiting(request)
        if isinstance(request, Prompt):
            self.let_go(request)
        if request.slot < 0:  # it never had a cache
            self._done(request)
        elif request.transfer_started:
            self._ending.append(request)
        else:
            self._free(request)

    def commands(self, step: int = -1) -> tuple[list[RankCommand], list[Request]]:
        """The frees step `step` carries, and the requests whose transfer's end it must
        ask (`end_command`; their answers go to `ended`)."""
        commands, self._commands = self._commands, []
        ending, self._ending = self._ending, []
        self._asked += ending
        for request in self._freed:
            for key in _cache_keys(request.slot, request.blocks):
                self._released_in[key] = step
            request.released.set()
        self._freed = []
        return commands, ending

    def overtake_after(self, slot: int, blocks: tuple[int, ...]) -> int | None:
        """The step whose answer a transfer start into `slot` and `blocks` must wait for
        before it may overtake the steps at the ranks: the last to carry the Release of
        one of them (every step that may touch them was sent no later). -1 when none did;
        None while the Release of one of them is in no step yet."""
        keys = _cache_keys(slot, blocks)
        unsent = set().union(*(_cache_keys(r.slot, r.blocks) for r in self._freed))
        if keys & unsent:
            return None
        return max(self._released_in.get(key, -1) for key in keys)

    def settle_polls(self) -> list[Request]:
        """Held requests to ask about this step (every SETTLE_POLL_S)."""
        now = time.monotonic()
        if not self.held or now - self._last_settle_poll < SETTLE_POLL_S:
            return []
        self._last_settle_poll = now
        return list(self.held.values())

    @staticmethod
    def end_command(request: Request) -> RankCommand:
        """Forget its transfer; answers whether none of its READs can still land."""
        return TransferEnd(request.request_id)

    @staticmethod
    def settle_command(request: Request) -> RankCommand:
        return TransferSettled(request.request_id)

    def ended(self, request: Request, settled: bool) -> None:
        """The ranks' answer to the request's TransferEnd: free, or hold until settled."""
        self._asked.remove(request)
        if settled:
            self._free(request)
        else:
            logger.warning("transfer of %r may still move bytes: holding its cache until settled",
                           request.request_id)  # fmt: skip
            request.phase = DecodePhase.HELD
            self.held[request.request_id] = request
            request.released.set()  # no step touches it any more

    def settled(self, request: Request, settled: bool) -> None:
        if settled and self.held.pop(request.request_id, None) is not None:
            self._free(request)

    def _free(self, request: Request | Prompt) -> None:
        """Release the slot on the ranks (in the next step) and the cache in the pools now:
        anything that reuses them is sent after that Release."""
        rid = request.request_id
        self.staging.free(rid)
        self._commands.append(Release(request.slot))
        self.pools.free(rid)
        self.frees += 1
        self._freed.append(request)  # `released` once its Release is handed to a step
        request.phase = type(request.phase).DONE  # DecodePhase or PrefillPhase

    def _done(self, request: Request | Prompt) -> None:
        self.staging.free(request.request_id)
        request.phase = type(request.phase).DONE
        request.released.set()

    @property
    def busy(self) -> bool:
        """Whether frees or ends are still to be sent or answered."""
        return bool(self._commands or self._ending or self._asked or self._freed)

    def held_requests(self) -> list[str]:
        return sorted(self.held)


def _cache_keys(slot: int, blocks: tuple[int, ...]) -> set[tuple[str, int]]:
    return {("slot", slot), *(("block", b) for b in blocks)}
