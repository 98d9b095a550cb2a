"""TP group helpers: argument checks and the world-size-1 gloo path (multi-rank: integration)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from transfer.model.caches import LocalCaches
from transfer.model.distributed import TPGroup, init_tp_group
from transfer.model.runner import RankEngine
from transfer.presets import get_preset


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((0, 0), {}, "world_size must be >= 1"),
        ((2, 2), {"master_port": 1234}, r"rank must be in \[0, 2\)"),
        ((0, 2), {}, "give init_method or master_port"),
        ((0, 2), {"init_method": "tcp://x:1", "master_port": 1}, "only one of"),
        ((0, 2), {"master_port": 70000}, "master_port must be in"),
    ],
)
def test_bad_group_arguments(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        init_tp_group(*args, **kwargs)
    assert not dist.is_initialized()


def test_world_size_one_without_rendezvous_is_single_process():
    tp = init_tp_group(0, 1)
    assert (tp.rank, tp.size, tp.distributed) == (0, 1, False)
    x = torch.ones(3)
    assert tp.all_reduce_(x) is x and torch.equal(x, torch.ones(3))
    assert tp.broadcast_object({"cmd": 1}) == {"cmd": 1}


def test_world_size_one_through_gloo_runs_the_engine(tmp_path):
    tp = init_tp_group(0, 1, f"file://{tmp_path / 'rendezvous'}")
    try:
        assert tp.distributed and dist.get_backend() == "gloo"
        assert tp.broadcast_object(["prefill", 3]) == ["prefill", 3]
        geometry = get_preset("tiny-qwen3-next")
        caches = LocalCaches(geometry, num_blocks=2, block_size=8, num_slots=1)
        engine = RankEngine(geometry, caches, tp)
        single = RankEngine(
            geometry, LocalCaches(geometry, num_blocks=2, block_size=8, num_slots=1)
        )
        assert engine.prefill([1, 2, 3], [0], 0) == single.prefill([1, 2, 3], [0], 0)
    finally:
        tp.close()
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="not initialised"):
        TPGroup.from_group()
