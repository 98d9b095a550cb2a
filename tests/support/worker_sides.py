"""One instance of a prefill/decode pair started in the test process (its ranks are real
processes): the instance, its worker, the gRPC server in front and its address."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from tests.support.ucx_env import pristine_ucx_env
from transfer.control.client import ClientOptions
from transfer.control.server import serve
from transfer.net import free_port
from transfer.presets import get_preset
from transfer.serving.engine.decode import DecodeWorker
from transfer.serving.engine.instance import Instance, InstanceConfig
from transfer.serving.engine.prefill import PrefillWorker


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


def start_prefill(config: InstanceConfig, name: str, lease_s: float = 30.0) -> Side:
    """A prefill instance behind its gRPC server, on loopback."""
    with pristine_ucx_env():
        instance = Instance(config)
    address = f"127.0.0.1:{free_port()}"
    worker = PrefillWorker(instance, name, address, lease_s)
    server = serve(address, store=worker.store, identity=worker.identity, prefill=worker.prefill)
    worker.start()
    return Side(instance, worker, server, address)


def start_decode(config: InstanceConfig, name: str, prefills: list[Side]) -> Side:
    """A decode instance that may read from `prefills`, behind its gRPC server."""
    with pristine_ucx_env():
        instance = Instance(config)
    address = f"127.0.0.1:{free_port()}"
    worker = DecodeWorker(
        instance, name, ClientOptions(timeout_s=60.0), known_prefill=[p.address for p in prefills]
    )
    server = serve(
        address,
        decode=worker.decode,
        decode_start=worker.start_decode,
        register_prefill=worker.register_prefill,
    )
    return Side(instance, worker, server, address)


@contextlib.contextmanager
def running_pair(model: str, name: str, **fields) -> Iterator[tuple[Side, Side]]:
    """A prefill instance and a decode instance that reads from it, of `model` (a preset),
    16 MiB of cache each and `fields` of `InstanceConfig` (serve's defaults otherwise),
    until the block ends."""

    def config(role: str) -> InstanceConfig:
        return InstanceConfig(role, get_preset(model), budget_bytes=16 << 20, **fields)

    prefill = start_prefill(config("prefill"), f"prefill-{name}")
    try:
        decode = start_decode(config("decode"), f"decode-{name}", [prefill])
        try:
            yield prefill, decode
        finally:
            decode.close()
    finally:
        prefill.close()
