"""The prefill instances decode's scheduler half has handshaken with, by control address.

The first ticket naming an address sends one Handshake there through the `PeerClient` (never
blocking vLLM); its reply -- each prefill rank's layout and transport metadata -- goes to the
workers with the first load that reads that instance (`StepMetadata.peers`), so no worker
ever waits on the control plane. A handshake that got no answer (deadline passed, peer
unreachable) is sent again, up to HANDSHAKE_TRIES in all; one that failed for good is
forgotten, and the next ticket naming the address tries again (the prefill may have been
restarting).
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Iterable, Mapping

from transfer.control.peer_client import PeerClient, PeerEvent, PeerOp, unanswered
from transfer.control.types import HandshakeReply
from transfer.vllm.metadata import PrefillPeer

logger = logging.getLogger(__name__)

# Handshakes sent to an address before its waiting requests compute locally, when none was
# answered: on a starved 2-core host a 1 -> 2 pair's prefill answered an Acquire but not the
# Handshake sent beside it, twice, within control_timeout_s (2026-12-05, load average 20).
HANDSHAKE_TRIES = 3


class PrefillPeers:
    """Handshakes by control address: in flight, answered, and announced to the workers."""

    def __init__(self, peers: PeerClient, compat: Mapping[str, str]):
        self._peers = peers
        self._compat = dict(compat)
        self._known: dict[str, PrefillPeer | None] = {}  # None: the handshake is in flight
        self._announced: set[str] = set()
        self._tries: dict[str, int] = {}  # handshakes sent to an address, while pending

    def ensure(self, address: str) -> None:
        """Handshake with `address` unless that is done or under way."""
        if address not in self._known:
            self._known[address] = None
            self._send(address)

    def ready(self, address: str) -> bool:
        return self._known.get(address) is not None

    def on_handshake(self, event: PeerEvent) -> str | None:
        """Record a Handshake's answer; returns why it failed for good, or None (answered, or
        sent again)."""
        assert event.op is PeerOp.HANDSHAKE
        error = str(event.error) if event.error is not None else _invalid(event.result)
        if error is not None:
            tries = self._tries.get(event.address, 0)
            if unanswered(event) and tries < HANDSHAKE_TRIES:
                logger.warning(
                    "pdxfer: handshake %d of %d with %s got no answer (%s); trying again",
                    tries,
                    HANDSHAKE_TRIES,
                    event.address,
                    error,
                )
                self._send(event.address)
                return None
            self._tries.pop(event.address, None)
            self._known.pop(event.address, None)
            return error
        self._tries.pop(event.address, None)
        reply: HandshakeReply = event.result
        peer = PrefillPeer(reply.instance_id, tuple(reply.rank_layouts), tuple(reply.rank_metadata))
        self._known[event.address] = peer
        logger.info(
            "pdxfer: handshake with %s (%s): tp %d, %d B to the workers",
            reply.instance_id,
            event.address,
            len(peer.layouts),
            len(pickle.dumps(peer)),
        )
        return None

    def announce(self, addresses: Iterable[str]) -> dict[str, PrefillPeer]:
        """The answered handshakes of `addresses` the workers have not been sent yet."""
        new: dict[str, PrefillPeer] = {}
        for address in addresses:
            if address in self._announced:
                continue
            peer = self._known.get(address)
            assert peer is not None, f"a load from {address} before its handshake answered"
            new[address] = peer
            self._announced.add(address)
        return new

    def _send(self, address: str) -> None:
        self._tries[address] = self._tries.get(address, 0) + 1
        self._peers.handshake(address, self._peers.holder, self._compat)


def _invalid(reply: HandshakeReply) -> str | None:
    ranks = len(reply.rank_metadata)
    if ranks == 0 or len(reply.rank_layouts) != ranks:
        return f"the reply has {len(reply.rank_layouts)} rank layouts for {ranks} ranks"
    return None
