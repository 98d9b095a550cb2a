"""Values that cross the transport boundary: operations, transfer states, notifications."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Op(enum.Enum):
    """READ pulls the peer's bytes into the local arena; WRITE pushes local bytes to the peer."""

    READ = "READ"
    WRITE = "WRITE"


class State(enum.Enum):
    PENDING = "PENDING"
    DONE = "DONE"
    FAILED = "FAILED"


@dataclass(frozen=True)
class TransferStatus:
    """What `Transport.poll` answers. `reason` says why a transfer FAILED, else it is empty.

    `settled` is False while a FAILED transfer may still move bytes: the backend could not
    stop it (NIXL cannot cancel a one-sided operation in flight), so its ranges on both
    sides must not be reused yet. Later polls turn it True once nothing can move any more.
    """

    state: State
    reason: str = ""
    settled: bool = True

    @property
    def pending(self) -> bool:
        return self.state is State.PENDING

    @property
    def done(self) -> bool:
        return self.state is State.DONE

    @property
    def failed(self) -> bool:
        return self.state is State.FAILED

    @classmethod
    def failure(cls, reason: str, settled: bool = True) -> TransferStatus:
        return cls(State.FAILED, reason, settled)


PENDING = TransferStatus(State.PENDING)
DONE = TransferStatus(State.DONE)


@dataclass(frozen=True)
class Notification:
    """A message a peer attached to a transfer that touched this side's arena."""

    peer: str
    message: bytes
