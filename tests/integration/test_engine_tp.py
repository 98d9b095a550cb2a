"""Real tensor parallelism: TP gloo processes against the TP=1 engine, and caches moved
between TP>1 and TP=1 (re-sliced by hand through the geometry's shard ranges), which is
what a P->D transfer with different TP on the two sides does."""

from __future__ import annotations

import multiprocessing
import traceback
from pathlib import Path

import pytest
import torch

from transfer.geometry import CacheTensor, LayerSpec, ModelGeometry, Role
from transfer.model.caches import LocalCaches
from transfer.model.distributed import init_tp_group
from transfer.model.reference import reference_model
from transfer.model.runner import RankEngine
from transfer.presets import get_preset

pytestmark = pytest.mark.slow

PROMPT = [7, 300, 45, 12, 499, 81, 3, 150, 222, 64, 9, 18, 401, 5, 77, 260, 31]
NEW_TOKENS = 5
BLOCK_SIZE = 8
NUM_BLOCKS = 8
P_BLOCKS, P_SLOT = [3, 0, 6], 0  # where every engine prefills
D_BLOCKS, D_SLOT = [1, 7, 4], 1  # where transferred requests land
TIMEOUT_S = 240


def generate(engine: RankEngine, blocks, slot, first_logits=None):
    """Greedy tokens and their logits [1 + NEW_TOKENS, vocab]; prefills unless given the
    first token's logits (the slot then already holds the prompt)."""
    logits = [engine.prefill_logits(PROMPT, blocks, slot) if first_logits is None else first_logits]
    tokens = [int(logits[0].argmax())]
    for i in range(NEW_TOKENS):
        logits.append(engine.decode_step_logits(tokens[-1], len(PROMPT) + i, blocks, slot))
        tokens.append(int(logits[-1].argmax()))
    return tokens, torch.stack(logits)


def rank_index(tensor: CacheTensor, tp: int, rank: int) -> torch.Tensor | None:
    """Global indices along the sharded axis of the `CacheAccess` view that `rank` holds:
    heads for KV/SSM, channels segment by segment for conv; None when replicated (MLA)."""
    if tensor.role is Role.CONV:
        parts, offset = [], 0
        for seg in tensor.segments:
            units = seg.units_on_rank(tp, rank)
            start = offset + units.start * seg.unit_elems
            parts.append(torch.arange(start, offset + units.stop * seg.unit_elems))
            offset += seg.num_units * seg.unit_elems
        return torch.cat(parts)
    (seg,) = tensor.segments
    if seg.num_units == 1:
        return None
    units = seg.units_on_rank(tp, rank)
    return torch.arange(units.start, units.stop)


def views(caches, layer: LayerSpec, tensor: CacheTensor) -> torch.Tensor:
    if tensor.role is Role.KV:
        return caches.kv(layer.index, tensor.name)
    if tensor.role is Role.SSM:
        return caches.ssm(layer.index)
    return caches.conv(layer.index, tensor.name)


def move_request(geometry: ModelGeometry, src, src_tp: int, dst, dst_tp: int, dst_rank: int):
    """Fill dst rank `dst_rank` (D_BLOCKS, D_SLOT) from all `src` ranks (P_BLOCKS, P_SLOT)."""
    for layer in geometry.layers:
        for tensor in layer.cache_tensors():
            kv = tensor.role is Role.KV
            src_rows, dst_rows = (P_BLOCKS, D_BLOCKS) if kv else ([P_SLOT], [D_SLOT])
            out = views(dst, layer, tensor)
            want = rank_index(tensor, dst_tp, dst_rank)
            for src_rank, caches in enumerate(src):
                have = rank_index(tensor, src_tp, src_rank)
                data = views(caches, layer, tensor)
                for s, d in zip(src_rows, dst_rows, strict=True):
                    if want is None:  # replicated: read it from one source rank only
                        if src_rank == dst_rank % src_tp:
                            out[d].copy_(data[s])
                        continue
                    for j, unit in enumerate(want.tolist()):
                        hit = (have == unit).nonzero()
                        if len(hit):
                            out[d].select(1 if kv else 0, j).copy_(
                                data[s].select(1 if kv else 0, int(hit[0]))
                            )


def make_caches(geometry, tp):
    return LocalCaches(geometry, tp=tp, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, num_slots=2)


def _rank_main(rank: int, tp_size: int, model: str, init_method: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    out = Path(out_dir)
    try:
        tp = init_tp_group(rank, tp_size, init_method, timeout_s=TIMEOUT_S)
        geometry = get_preset(model)
        caches = make_caches(geometry, tp_size)
        engine = RankEngine(geometry, caches, tp, seed=0)
        first_logits = engine.prefill_logits(PROMPT, P_BLOCKS, P_SLOT)
        prefilled = {k: t.clone() for k, t in caches.tensors.items()}
        tokens, logits = generate(engine, P_BLOCKS, P_SLOT, first_logits)
        # TP=1 prefill -> this rank: the decode side of a TP 1 -> tp_size transfer.
        tp1 = make_caches(geometry, 1)
        tp1.tensors = torch.load(out / "tp1_prefill.pt")
        engine.mark_filling(D_SLOT, D_BLOCKS)
        move_request(geometry, [tp1], 1, caches, tp_size, rank)
        engine.mark_ready(D_SLOT)
        tp1_first = torch.load(out / "tp1_first_logits.pt")
        moved_tokens, _ = generate(engine, D_BLOCKS, D_SLOT, tp1_first)
        result = {"prefilled": prefilled, "tokens": tokens, "logits": logits}
        result["moved_tokens"] = moved_tokens
        torch.save(result, out / f"rank{rank}.pt")
        tp.close()
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def run_ranks(model: str, tp_size: int, out_dir: Path) -> list[dict]:
    ctx = multiprocessing.get_context("spawn")
    init_method = f"file://{out_dir / 'rendezvous'}"
    procs = [
        ctx.Process(target=_rank_main, args=(rank, tp_size, model, init_method, str(out_dir)))
        for rank in range(tp_size)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(TIMEOUT_S)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(10)
    errors = [p.read_text() for p in sorted(out_dir.glob("rank*.err"))]
    assert not errors, "\n".join(errors)
    assert [p.exitcode for p in procs] == [0] * tp_size
    return [torch.load(out_dir / f"rank{rank}.pt") for rank in range(tp_size)]


# TP=4 puts each of tiny-qwen3-next's 2 KV heads on 2 ranks (docs/bugs.md #2); at TP=2
# tiny-nemotron-h's one Mamba2 group (B and C) is on both ranks, its gated norm spanning them.
@pytest.fixture(
    scope="module",
    params=[
        ("tiny-qwen3-next", 2),
        ("tiny-kimi-linear", 2),
        ("tiny-nemotron-h", 2),
        ("tiny-qwen3-next", 4),
    ],
    ids=lambda p: f"{p[0]}-tp{p[1]}",
)
def runs(request, tmp_path_factory):
    torch.set_num_threads(1)
    model, tp_size = request.param
    geometry = get_preset(model)
    out_dir = tmp_path_factory.mktemp(model)
    caches = make_caches(geometry, 1)
    engine = RankEngine(geometry, caches, model=reference_model(geometry))
    first_logits = engine.prefill_logits(PROMPT, P_BLOCKS, P_SLOT)
    torch.save({k: t.clone() for k, t in caches.tensors.items()}, out_dir / "tp1_prefill.pt")
    torch.save(first_logits, out_dir / "tp1_first_logits.pt")
    tokens, logits = generate(engine, P_BLOCKS, P_SLOT, first_logits)
    return geometry, (tokens, logits), run_ranks(model, tp_size, out_dir)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_tp_generates_what_tp1_does(runs):
    _, (tokens, logits), ranks = runs
    for result in ranks:
        assert result["tokens"] == tokens
        assert rel_err(result["logits"], logits) < 1e-4
    assert len(set(tokens)) > 1


def test_ranks_share_cache_bytes_exactly_where_they_share_heads(runs):
    geometry, _, ranks = runs
    tp = len(ranks)
    for layer in geometry.layers:
        for tensor in layer.cache_tensors():
            shards = [r["prefilled"][layer.index, tensor.name] for r in ranks]
            for r in range(1, tp):
                have, first = rank_index(tensor, tp, r), rank_index(tensor, tp, 0)
                same_heads = have is None or torch.equal(have, first)
                assert torch.equal(shards[r], shards[0]) == same_heads, (
                    layer.index,
                    tensor.name,
                    r,
                )


def test_prefill_tp_decode_tp1(runs):
    geometry, (tokens, logits), ranks = runs
    src = []
    for result in ranks:
        caches = make_caches(geometry, len(ranks))
        caches.tensors = result["prefilled"]
        src.append(caches)
    engine = RankEngine(geometry, make_caches(geometry, 1), model=reference_model(geometry))
    engine.mark_filling(D_SLOT, D_BLOCKS)
    move_request(geometry, src, len(ranks), engine.caches, 1, 0)
    engine.mark_ready(D_SLOT)
    got_tokens, got_logits = generate(engine, D_BLOCKS, D_SLOT, logits[0])
    assert got_tokens == tokens
    assert rel_err(got_logits, logits) < 1e-4


def test_prefill_tp1_decode_tp(runs):
    _, (tokens, _), ranks = runs
    for result in ranks:
        assert result["moved_tokens"] == tokens
