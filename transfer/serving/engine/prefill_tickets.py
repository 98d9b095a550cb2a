"""A prefill instance's tickets as its engine loop sees them: the `TicketStore`, publishing
a prompt's ticket (whole, or early for a layer-wise stream), and Stage gathers of a live
ticket's ranges into one staging extent. Engine thread only, apart from the store itself
(thread-safe: the TransferService's handlers call it)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

from transfer.control.errors import UnknownRequest
from transfer.control.metrics import WorkerMetrics
from transfer.control.tickets import TicketStore
from transfer.control.types import ControlConfig, FreeReason, Ticket
from transfer.errors import CapacityError, PdxferError
from transfer.serving.engine.instance import Instance
from transfer.serving.engine.request import PrefillPhase, Prompt
from transfer.serving.engine.step import Answer, Handler
from transfer.serving.ranks.commands import StageGather
from transfer.serving.ranks.progress import next_key
from transfer.serving.ranks.spec import Copies
from transfer.trace import TracePoint, mark


class PrefillTickets:
    """Publishes prompts' tickets into `store` and stages their ranges."""

    def __init__(
        self,
        instance: Instance,
        instance_id: str,
        address: str,
        lease_s: float,
        on_free: Callable[[Ticket, FreeReason], None],
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self.instance = instance
        self.metrics = metrics
        plan = instance.plan
        config = ControlConfig(
            num_kv_blocks=plan.num_kv_blocks,
            num_state_slots=plan.num_state_slots,
            block_size=plan.block_size,
            max_blocks_per_request=plan.num_kv_blocks,
            lease_s=lease_s,
        )
        self.store = TicketStore(
            config, on_free, instance_id=instance_id, address=address, metrics=metrics
        )
        self._keys: dict[int, int] = {}  # slot -> the stream key it last had

    def publish(self, prompt: Prompt) -> None:
        """Its cache is written: publish its ticket (a streamed one's is live already).
        Raises PdxferError (InvalidInput) when the store refuses it."""
        mark(TracePoint.PREFILL_DONE, prompt.request_id)
        if prompt.ticket is None:
            first = prompt.first
            prompt.ticket = self.store.publish(
                prompt.request_id, list(prompt.blocks), prompt.slot, prompt.num_tokens,
                first.token, first_logprob=first.logprob, cached_tokens=prompt.cached_tokens,
                block_hashes=prompt.hashes,
            )  # fmt: skip
            prompt.out.put(prompt.ticket)
        prompt.phase = PrefillPhase.PUBLISHED

    def publish_early(self, prompt: Prompt) -> None:
        """Layer-wise streaming: publish the ticket now, with a fresh key for the slot; the
        prompt prefills in the next steps, and decode reads each part once the ranks
        publish it. The caller has its ticket then: the ticket's free ends the prompt."""
        key = next_key(self._keys.get(prompt.slot, 0))
        self._keys[prompt.slot] = key
        prompt.stream_key = key
        prompt.ticket = self.store.publish(
            prompt.request_id, list(prompt.blocks), prompt.slot, prompt.num_tokens, 0,
            cached_tokens=prompt.cached_tokens, block_hashes=prompt.hashes, stream_key=key,
        )  # fmt: skip
        prompt.is_cancelled = _never
        prompt.out.put(prompt.ticket)

    def is_live(self, prompt: Prompt) -> bool:
        """Whether its ticket is still in the store (a free may be on its way)."""
        return prompt.ticket is not None and self.store.get(prompt.request_id) is not None

    def stage(
        self, prompt: Prompt | None, rid: str, copies: tuple[Copies, ...], nbytes: int,
        future: Future,
    ) -> tuple[StageGather, Handler] | None:  # fmt: skip
        """The gather of `copies` (placed from 0) into a new staging extent under `rid`,
        and its answer's handler, which resolves `future` with the extent's arena offset;
        None when `future` is answered already (no live ticket, no room)."""
        staging, base = self.instance.staging, self.instance.layouts[0].staging_offset
        if prompt is None or self.store.get(rid) is None:
            future.set_exception(UnknownRequest(f"request_id {rid!r}: no live ticket to stage"))
            return None
        try:
            offset = staging.allocate(rid, nbytes)
        except PdxferError as exc:  # WrongState: the ticket holds an extent already
            future.set_exception(exc)
            return None
        if offset is None:
            future.set_exception(CapacityError(
                f"staging: {nbytes} bytes asked, the largest free extent is "
                f"{staging.largest_free_bytes} of {staging.capacity_bytes}"
            ))  # fmt: skip
            return None
        placed = tuple(Copies(c.src, c.dst + base + offset, c.nbytes) for c in copies)

        def staged(answer: Answer) -> None:
            if isinstance(answer, BaseException):
                staging.free(rid)
                future.set_exception(answer)
            elif prompt.phase is PrefillPhase.DONE or self.store.get(rid) is None:
                # freed while staging: the free's event gives the extent back with the cache
                future.set_exception(UnknownRequest(f"request_id {rid!r}: freed while staging"))
            else:
                if self.metrics is not None:
                    self.metrics.transfers_staged.inc()
                future.set_result(base + offset)

        return StageGather(placed), staged


def _never() -> bool:
    return False
