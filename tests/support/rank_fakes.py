"""A model-free rank worker and command, for tests of the rank process machinery."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from types import SimpleNamespace

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


@dataclass(frozen=True)
class HoldUntil(RankCommand[None]):
    """Runs until `path` exists: the test decides when the rank takes its next command."""

    path: str
    timeout_s: float = 30.0

    def apply(self, worker) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not os.path.exists(self.path):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.path} did not appear within {self.timeout_s} s")
            time.sleep(0.005)


@dataclass(frozen=True)
class Tick(RankCommand[int]):
    """Answers how many Ticks the rank ran before it: the order the rank ran them in."""

    overtakes: bool = False

    def apply(self, worker) -> int:
        worker.ticks += 1
        return worker.ticks - 1


def build(spec, group) -> object:
    return SimpleNamespace(ticks=0)
