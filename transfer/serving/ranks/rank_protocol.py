"""What crosses between a control process and its rank processes, whatever the ranks do.

A command is a frozen dataclass whose `apply(worker)` runs it on one rank's worker; every
rank of a group runs the same command object and answers for itself. A rank whose command
raised answers a `RankFailure` instead, which the control side raises as a
`RankCommandError` of the failure's kind. Torch-free: the control process imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from transfer.errors import (
    CapacityError,
    Closed,
    DeadlineExceeded,
    InvalidInput,
    NotFound,
    PdxferError,
    PeerUnavailable,
    WrongState,
)
from transfer.model.slots import CacheFillingError

R = TypeVar("R")


class RankCommand(Generic[R]):
    """A command every rank runs; `R` is what one rank answers. Rank 0 runs commands in the
    order it received them, except that one that `overtakes` runs before those received
    earlier that have not started yet: its sender vouches that it touches nothing they do."""

    overtakes: bool = False

    def apply(self, worker: Any) -> R:
        raise NotImplementedError


@dataclass(frozen=True)
class Stop(RankCommand[None]):
    """End the command loop; the rank closes its worker and exits."""

    def apply(self, worker: Any) -> None:
        return None


HEARTBEAT_S = 1.0  # how often a rank process says it lives


@dataclass(frozen=True)
class RankLaunch:
    """What a rank process reads on stdin before anything else."""

    spec: Any  # has .rank, .tp and .device; the build function reads the rest
    build: str  # "module:function" called as f(spec, group): the rank's worker
    dist_init: str | None  # gloo/nccl rendezvous ("tcp://host:port") when tp > 1
    parent_pid: int
    conn_fd: int | None = None  # rank 0's end of the command connection
    heartbeat: str | None = None  # a file the rank touches every HEARTBEAT_S while it lives


# The error kinds a rank failure keeps across the process boundary, most specific first.
_KINDS: tuple[type[PdxferError], ...] = (
    CacheFillingError,  # a WrongState the lifecycle tests tell apart (bugs 4 and 6)
    InvalidInput,
    NotFound,
    WrongState,
    CapacityError,
    PeerUnavailable,
    DeadlineExceeded,
    Closed,
)
_BUILTIN_KINDS: tuple[tuple[type[Exception], type[PdxferError]], ...] = (
    (ValueError, InvalidInput),
    (LookupError, NotFound),
    (ConnectionError, PeerUnavailable),
    (TimeoutError, DeadlineExceeded),
)


def kind_of(exc: BaseException) -> type[PdxferError] | None:
    """The `transfer.errors` kind `exc` belongs to, or None (an internal error)."""
    for kind in _KINDS:
        if isinstance(exc, kind):
            return kind
    for builtin, kind in _BUILTIN_KINDS:
        if isinstance(exc, builtin):
            return kind
    return None


@dataclass(frozen=True)
class RankFailure:
    """What a rank answers when its command raised."""

    rank: int
    error: str  # the exception's class name
    message: str
    kind: type[PdxferError] | None = None

    @classmethod
    def of(cls, rank: int, exc: BaseException) -> RankFailure:
        return cls(rank, type(exc).__name__, str(exc) or type(exc).__name__, kind_of(exc))


class RankGroupDead(PeerUnavailable):
    """The rank processes are gone (or closed); the group cannot serve any more."""


class RankCommandError(PdxferError):
    """A command failed on at least one rank; `failures` says where and why."""

    def __init__(self, what: str, failures: list[RankFailure]) -> None:
        first = failures[0]
        super().__init__(f"{what} failed on rank {first.rank}: {first.error}: {first.message}")
        self.what = what  # the command's class name, or "start"
        self.failures = failures

    @property
    def kind(self) -> type[PdxferError] | None:
        """The error kind of the first rank's failure (e.g. `CacheFillingError`); None for an
        internal error."""
        return self.failures[0].kind


class RankInputError(RankCommandError, InvalidInput):
    """Every failing rank rejected its input."""


class RankStateError(RankCommandError, WrongState):
    """Every failing rank was in the wrong state for the command."""


class RankPeerError(RankCommandError, PeerUnavailable):
    """Every failing rank could not reach a peer."""


class RankCapacityError(RankCommandError, CapacityError):
    """Every failing rank ran out of room."""


_ERRORS: dict[type[PdxferError], type[RankCommandError]] = {
    InvalidInput: RankInputError,
    WrongState: RankStateError,
    PeerUnavailable: RankPeerError,
    CapacityError: RankCapacityError,
}


def command_error(what: str, failures: list[RankFailure]) -> RankCommandError:
    """The exception for `failures`: of their kind when every failing rank agrees on one."""
    kinds = {f.kind for f in failures}
    error = _ERRORS.get(kinds.pop()) if len(kinds) == 1 else None
    return (error or RankCommandError)(what, failures)


def same_on_every_rank(results: list[R], what: str) -> R:
    """The one answer every rank gave (they broadcast rank 0's picks). Ranks of a TP group
    that disagree have diverged: an internal error (PdxferError), after the step ran."""
    if any(r != results[0] for r in results[1:]):
        raise PdxferError(f"{what}: the ranks disagree: {results}")
    return results[0]
