"""The decode engine's handshakes with its prefill instances, on the engine thread: at most
one Handshake in flight per address, its answer turned into an AddPeers at the ranks and a
Peer in the table, then whoever waited on it resumed (a request goes on to its Acquire) or
failed with the handshake's error."""

from __future__ import annotations

import json
import logging
from concurrent.futures import Future
from typing import TYPE_CHECKING

from transfer.cache.layout import Layout
from transfer.control.client import TransferClient
from transfer.control.peer_client import PeerEvent
from transfer.errors import PeerUnavailable
from transfer.serving.engine.peers import Peer
from transfer.serving.engine.request import Request
from transfer.serving.ranks.commands import AddPeers

if TYPE_CHECKING:
    from transfer.serving.engine.decode_setup import DecodeSetup

logger = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 10.0  # the Handshake call's own deadline (AddPeers follows it)


class Handshakes:
    """The handshakes in flight, and the requests and callers waiting on each."""

    def __init__(self, setup: DecodeSetup) -> None:
        self.setup = setup
        self.engine = setup.engine
        self._handshaking: dict[str, list[Request]] = {}  # address -> requests waiting on it
        self._waiters: dict[str, list[Future]] = {}  # address -> callers of `when_handshaken`

    def acquire_when_handshaken(self, request: Request, address: str) -> None:
        """Acquire `request`'s ticket once `address` is handshaken."""
        self._handshake(address)
        self._handshaking[address].append(request)

    def prewarm(self, address: str) -> None:
        """Handshake with a prefill instance before its first ticket, so that no request's
        exposed transfer pays for connecting. A failure is only logged: the first request
        handshakes again."""
        if self.setup.peers.get(address) is None:
            self._handshake(address)

    def when_handshaken(self, address: str, instance_id: str, done: Future) -> None:
        """Resolve `done` with the peer at `address` once handshaken (now, if it is), or
        with the handshake's error. A handshake in flight is joined, never doubled: two
        AddPeers for one peer could leave a warm-up READ queued behind a caller that has
        already moved on (test_bug14 stops the prefill rank right after)."""
        peer = self.setup.peers.get(address, instance_id)
        if peer is not None:
            done.set_result(peer)
            return
        self._handshake(address)
        self._waiters.setdefault(address, []).append(done)

    def _handshake(self, address: str) -> None:
        """Start a handshake with `address` unless one is in flight."""
        if address in self._handshaking:
            return
        self._handshaking[address] = []
        self.engine.peer_client.handshake(address, self.engine.instance_id,
                                          self.setup.instance.compat, tag=address,
                                          timeout_s=HANDSHAKE_TIMEOUT_S)  # fmt: skip

    def handshaken(self, event: PeerEvent) -> None:
        """The Handshake's answer: add the peer at the ranks, then to the table."""
        address = event.address
        if not event.ok:
            self._handshake_failed(address, event.error)
            return
        reply = event.result
        layouts = tuple(Layout.from_dict(json.loads(b)) for b in reply.rank_layouts)
        staging = tuple(layout.staging_offset for layout in layouts)
        command = AddPeers(reply.instance_id, tuple(reply.rank_metadata), staging)

        def added(answer) -> None:
            if isinstance(answer, BaseException):
                self._handshake_failed(
                    address, PeerUnavailable(f"connecting to {address}: {answer}")
                )
                return
            options = self.setup.options
            client = TransferClient(address, token=options.token, tls=options.tls,
                                    timeout_s=options.timeout_s)  # fmt: skip
            peer = Peer(reply.instance_id, address, layouts, client)
            self.setup.peers.add(peer)
            logger.info("handshake with %s (%s): tp %d", reply.instance_id, address, len(layouts))
            for waiter in self._waiters.pop(address, []):
                waiter.set_result(peer)
            for request in self._handshaking.pop(address, []):
                if not self.engine.is_ending(request):
                    self.setup.acquire(request, peer)

        self.engine.add_command(command, added)

    def _handshake_failed(self, address: str, error: BaseException) -> None:
        waiting = self._handshaking.pop(address, [])
        waiters = self._waiters.pop(address, [])
        if not waiting and not waiters:
            logger.info("handshake with %s: %s (the first request tries again)", address, error)
        for waiter in waiters:
            waiter.set_exception(error)
        for request in waiting:
            if not self.engine.is_ending(request):
                self.engine.finish(request, error)
