"""Micro-benchmark (not a test): one decode load's local copies on the CPU, the agent's
per-range copies (`TransferAgent.copy_local`, what the worker ran before) against
`RegionCopies` over `kernels.pack`; and what `verify` adds to that load on one rank (its
digests, `transfer/vllm/digests.py`).

The copies are the worker's for the tiny Qwen3-Next's caches as vLLM allocates them, a
prompt of 900 tokens (three 384-token blocks, the last one staged by token), at TP pairs
1 -> 1, 2 -> 1 and 1 -> 2: staged spans of small ranges, then the tail's chunks.

    .venv-vllm/bin/python -m tests.vllm.bench_region_copies
"""

from __future__ import annotations

import statistics
import time
import uuid

import numpy as np
import torch

from tests.vllm.test_vllm_layout import BLOCK, GROUPS, _describe
from transfer.agent import TransferAgent, stage_small
from transfer.dataplane import make_transport
from transfer.vllm.digests import RequestCache, compute
from transfer.vllm.region_copies import RegionCopies
from transfer.vllm.stage_tail import slot_bytes

NUM_TOKENS = 699
REPEATS = 50


def _copies(tp_p: int, tp_d: int, staging_at: int):
    """Decode rank 0's staging -> cache copies, as `LoadPlanner.cache_reads` builds them."""
    from transfer.vllm.load_plan import plan_load

    p_layouts = [_describe(tp_p)[0].layout(p) for p in range(tp_p)]
    d_memory = _describe(tp_d)[0]
    d_layouts = [d_memory.layout(r) for r in range(tp_d)]
    src_ids = [(0,), (1,), (2,), (3, 4)]  # one block pool: ids distinct
    dst_ids = [(4,), (3,), (2,), (1, 0)]
    offsets = [10 * slot_bytes(layout) for layout in p_layouts]  # anywhere: not read here
    reads = plan_load(GROUPS, p_layouts, d_layouts, 0, src_ids, dst_ids, NUM_TOKENS, offsets)
    base, parts = staging_at, []
    assert reads.tail is not None
    _, tail_copies = reads.tail.shifted(base)
    parts.append(tail_copies)
    base += reads.tail.nbytes
    for src, dst, n in reads.per_source.values():
        staged = stage_small(dst, src, n, base)
        base += staged.staging_bytes
        parts.append(staged.copies)
    return tuple(np.concatenate(c) for c in zip(*parts, strict=True)), d_memory


def _time(fn) -> float:
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    torch.set_num_threads(1)
    print(f"one load's local copies, {NUM_TOKENS} tokens (median of {REPEATS}), decode rank 0")
    for tp_p, tp_d in ((1, 1), (2, 1), (1, 2)):
        _, flat, _, _ = _describe(tp_d)
        staging = torch.zeros(8 << 20, dtype=torch.uint8)
        agent = TransferAgent(make_transport("nixl", f"bench-{uuid.uuid4().hex[:8]}"))
        agent.register([flat, staging])
        region_map = agent.transport.region_map
        copies, _ = _copies(tp_p, tp_d, region_map.regions[1].start)
        kernels = RegionCopies([flat, staging], region_map)
        before = _time(lambda: agent.copy_local(*copies))  # noqa: B023
        after = _time(lambda: kernels.copy(*copies))  # noqa: B023
        print(
            f"  {tp_p}->{tp_d}: {len(copies[2])} copies, {int(copies[2].sum())} B: "
            f"agent {before * 1e3:.3f} ms, kernels.pack {after * 1e3:.3f} ms "
            f"({after / before:.2f}x)"
        )
        if tp_p == tp_d == 1:
            cache = RequestCache.of(GROUPS, [(4,), (3,), (2,), (1, 0)], BLOCK, NUM_TOKENS)
            layout = _describe(1)[0].layout(0)
            digest = _time(lambda: compute(kernels, layout, cache))  # noqa: B023
            print(f"  verify digests of that load (one rank): {digest * 1e3:.3f} ms")
        agent.close()


if __name__ == "__main__":
    main()
