"""A prefill engine's surroundings without rank processes: a fake rank worker that the real
EngineStep applies its commands to, an instance of real pools around it, and `hold`, which
keeps an engine from stepping while a test queues what one step must see."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from types import SimpleNamespace

from transfer.cache.pools import CachePools
from transfer.cache.prefix_cache import PrefixCache
from transfer.cache.staging_pool import StagingPool
from transfer.presets import get_preset
from transfer.serving.engine.checkpoints import PREFIX_UNIT
from transfer.serving.engine.instance import InstanceConfig
from transfer.serving.ranks.commands import TokenPick
from transfer.serving.ranks.rank_protocol import RankGroupDead
from transfer.serving.ranks.spec import Copies
from transfer.serving.role import ServeRole

TIMEOUT_S = 10.0
BLOCK = 16


class FakeWorker:
    """What EngineStep applies commands to. Logs (step, what, ...) per command; a prefill
    picks 100 * slot + the tokens the slot has seen; a batch holding `bad_slot` fails its
    checks (ValueError: InvalidInput), one holding `broken_slot` fails inside (RuntimeError).
    `on_step(n)` runs before the n-th prefill batch."""

    spec = SimpleNamespace(rank=0)

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.steps: list[tuple[tuple[int, int, int], ...]] = []  # (slot, context, n) per chunk
        self.chunks: list = []  # every PrefillChunk, in order
        self.step = 0
        self.bad_slot: int | None = None
        self.broken_slot: int | None = None
        self.on_step = lambda n: None

    def prefill_batch(self, chunks) -> tuple[TokenPick, ...]:
        parts = tuple((c.slot, c.context_len, len(c.tokens)) for c in chunks)
        self.on_step(len(self.steps))
        self.steps.append(parts)
        self.chunks.extend(chunks)
        self.log.append((self.step, "prefill", parts))
        if any(slot == self.bad_slot for slot, _, _ in parts):
            raise ValueError(f"slot {self.bad_slot} is broken")  # a check: nothing ran
        if any(slot == self.broken_slot for slot, _, _ in parts):
            raise RuntimeError("the step broke midway")
        return tuple(TokenPick(100 * s + c + n, -1.0) for s, c, n in parts)

    def release(self, slot: int) -> None:
        self.log.append((self.step, "release", slot))

    def stage_gather(self, copies: Copies) -> None:
        self.log.append((self.step, "stage", tuple(copies.dst)))

    def snapshot(self, *args) -> None:
        self.log.append((self.step, "snapshot", args[0]))


class _Answered:
    def __init__(self, result) -> None:
        self._result = result

    def result(self, timeout_s: float):
        return self._result


class FakeRanks:
    def __init__(self, worker: FakeWorker) -> None:
        self.worker = worker
        self.dead = False

    def submit(self, command):
        if self.dead:
            raise RankGroupDead("fake ranks: gone")
        self.worker.step += 1
        return _Answered([command.apply(self.worker)])


def fake_instance(budget: int, num_blocks: int = 64, num_slots: int = 4, **config):
    """(instance, its FakeWorker): real pools of `num_slots` request slots; with
    `prefix_cache=True` a real prefix cache whose checkpoint slots follow them."""
    worker = FakeWorker()
    pools = CachePools(BLOCK, num_blocks, num_slots)
    settings = dict(prefix_cache=False, staging_bytes=0) | config
    geometry = get_preset("tiny-qwen3-next")
    config = InstanceConfig(ServeRole.PREFILL, geometry, max_num_batched_tokens=budget, **settings)
    checkpoints = config.checkpoint_slots
    prefix = None
    if config.prefix_cache:
        slots = list(range(num_slots, num_slots + checkpoints))
        prefix = PrefixCache(pools.blocks, BLOCK, slots, unit=PREFIX_UNIT)
        pools.evictor = prefix.evict
    instance = SimpleNamespace(
        config=config,
        plan=SimpleNamespace(num_kv_blocks=num_blocks, num_state_slots=num_slots + checkpoints,
                             block_size=BLOCK),
        pools=pools, prefix=prefix, staging=StagingPool(1 << 20),
        layouts=(SimpleNamespace(staging_offset=4096),), ranks=FakeRanks(worker),
    )  # fmt: skip
    return instance, worker


@contextmanager
def hold(engine):
    """Keep the engine from stepping until the block ends: what it queues, one step sees."""
    gate, held = threading.Event(), threading.Event()
    engine.call_soon(lambda: (held.set(), gate.wait(TIMEOUT_S)))
    assert held.wait(TIMEOUT_S)
    try:
        yield
    finally:
        gate.set()
