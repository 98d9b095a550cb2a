"""One instance of a prefill/decode pair started in the test process (its ranks are real
processes): the instance, its worker, the gRPC server in front and its address."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from transfer.serving.decode import DecodeWorker
from transfer.serving.instance import Instance
from transfer.serving.prefill import PrefillWorker


def prompt(seed: int, length: int = 40) -> list[int]:
    """Seeded random token ids of the tiny models' vocabulary."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 512, (length,), generator=gen).tolist()


@dataclass
class Side:
    instance: Instance
    worker: PrefillWorker | DecodeWorker
    server: object
    address: str

    def close(self) -> None:
        self.server.stop(grace=0)
        self.worker.close()
        self.instance.close()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The references run in the test process, next to the ranks: one thread each keeps
    two cores sane. Import it into a module to use it there."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
