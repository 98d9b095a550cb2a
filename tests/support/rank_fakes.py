"""A model-free rank worker and command, for tests of the rank process machinery."""

from __future__ import annotations

import time
from dataclasses import dataclass

from transfer.serving.ranks.rank_protocol import RankCommand


@dataclass(frozen=True)
class Spec:
    rank: int = 0
    tp: int = 1
    device: str = "cpu"


@dataclass(frozen=True)
class Sleep(RankCommand[float]):
    seconds: float

    def apply(self, worker) -> float:
        time.sleep(self.seconds)
        return self.seconds


@dataclass(frozen=True)
class Refuse(RankCommand[None]):
    """Fails its checks, as a command given bad input does."""

    reason: str

    def apply(self, worker) -> None:
        raise ValueError(self.reason)


def build(spec, group) -> object:
    return object()
