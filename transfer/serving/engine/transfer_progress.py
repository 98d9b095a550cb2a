"""A decode request's transfer after its start, on the engine thread: its polls, a
stream's further posts, its deadline, and every way it fails (a rank's error, a FAILED
status, a post refused, its lease not renewed). Once DONE it goes to
`DecodeSetup.transferred`; a failure ends the request through `DecodeEngine.finish`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from transfer.serving.engine.request import DecodePhase, Request
from transfer.serving.engine.step import Answer
from transfer.serving.engine.transfers import Outcome, Transfer
from transfer.serving.ranks.commands import TransferPoll
from transfer.trace import TracePoint, mark

if TYPE_CHECKING:
    from transfer.serving.engine.decode_engine import DecodeEngine


class TransferProgress:
    def __init__(self, engine: DecodeEngine) -> None:
        self.engine = engine

    def advance(self, request: Request, now: float) -> None:
        """A TRANSFERRING request, at the start of a step: past its deadline, or due a poll."""
        transfer, engine = request.transfer, self.engine
        if transfer.outcome is Outcome.PENDING and now > transfer.deadline > 0:
            self.failed(request, f"not done within {engine.transfer_deadline_s:g}s")
        elif transfer.wants_poll(now):
            transfer.polling = True
            engine.add_command(TransferPoll(request.request_id),
                               lambda a, r=request: self.on_poll(r, a))  # fmt: skip

    def on_poll(self, request: Request, answer: Answer) -> None:
        """The answer to its TransferStart or a TransferPoll."""
        transfer = request.transfer
        if self.engine.is_ending(request) or transfer is None:
            return
        if isinstance(answer, BaseException):  # the command itself failed on a rank
            transfer.polling = False
            self._ended(request, transfer, str(answer), answer)
            return
        post = transfer.advance(request.request_id, answer)
        if post is not None:
            self.engine.add_command(post, lambda a, r=request: self._on_post(r, a))
        if transfer.outcome is Outcome.FAILED:
            self.failed(request, transfer.failure)
        elif transfer.outcome is Outcome.DONE:
            mark(TracePoint.TRANSFER_DONE, request.request_id)
            self.engine.setup.transferred(request)

    def heartbeat_failed(self, request: Request, error: BaseException) -> None:
        """The lease could not be renewed: prefill may reuse the cache being read."""
        if self.engine.is_ending(request) or request.phase is not DecodePhase.TRANSFERRING:
            return
        self._ended(request, request.transfer, str(error), error)

    def failed(self, request: Request, reason: str) -> None:
        """The READs failed (or ran out of time): the peer is forgotten (the next request
        handshakes again) and the request ends once its transfer has settled."""
        transfer = request.transfer
        transfer.fail(reason)
        self._record_failed(transfer)
        self.engine.setup.peers.forget(transfer.peer.address)
        request.transfer_failure = (
            f"transfer of {request.request_id!r} from {transfer.peer.instance_id} failed: "
            f"{transfer.failure}"
        )
        self.engine.finish(request, None)

    def _on_post(self, request: Request, answer: Answer) -> None:
        if isinstance(answer, BaseException) and not self.engine.is_ending(request):
            self.failed(request, str(answer))

    def _ended(self, request: Request, transfer: Transfer, reason: str, error) -> None:
        transfer.fail(reason)
        self._record_failed(transfer)
        self.engine.finish(request, error)

    def _record_failed(self, transfer: Transfer) -> None:
        if self.engine.metrics is not None:
            self.engine.metrics.record_transfer("failed", transfer.seconds, None, 0)
