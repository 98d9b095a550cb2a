"""Shared by the Kimi-Linear and Nemotron-H model tests: greedy runs of transformers and of
our rank engines, prompt choice by logit margin, caches in our layout, TP=2 gloo ranks."""

from __future__ import annotations

import multiprocessing
import traceback
from pathlib import Path

import torch

from transfer.geometry import CacheTensor, LayerKind, ModelGeometry, Role
from transfer.hf_geometry import from_hf_config
from transfer.model.caches import LocalCaches
from transfer.model.checkpoint import Checkpoint
from transfer.model.distributed import TPGroup, init_tp_group
from transfer.model.runner import RankEngine

BLOCK_SIZE = 16
NUM_BLOCKS = 8
BLOCKS = [5, 0, 7, 2, 4, 1]  # scattered on purpose: 96 tokens
SLOT = 1
TIMEOUT_S = 300


def builder(family: str):
    if family == "kimi_linear":
        from transfer.model.kimi_linear import build_kimi_linear

        return build_kimi_linear
    from transfer.model.nemotron_h import build_nemotron_h

    return build_nemotron_h


# -- transformers -----------------------------------------------------------------------


def hf_greedy(model, prompt: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and the logits [new_tokens, vocab] that chose them."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        max_new_tokens=new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    return tokens, torch.cat(out.logits).float()


def margin(logits: torch.Tensor) -> float:
    """The smallest top-1 minus top-2 logit gap over the steps [steps, vocab]."""
    top = logits.topk(2, dim=-1).values
    return float((top[:, 0] - top[:, 1]).min())


def pick_prompt(model, vocab: int, length: int, new_tokens: int, candidates: int = 16):
    """The random prompt (of `candidates`) whose greedy run has the widest smallest margin."""
    gen = torch.Generator().manual_seed(1234)
    best = None
    for _ in range(candidates):
        prompt = torch.randint(3, vocab, (length,), generator=gen).tolist()
        tokens, logits = hf_greedy(model, prompt, new_tokens)
        if best is None or margin(logits) > best[0]:
            best = (margin(logits), prompt, tokens, logits)
    return best


def hf_caches(past, geometry: ModelGeometry) -> dict[tuple[int, str], torch.Tensor]:
    """transformers' cache after a prefill, in our per-request layout: conv windows
    [channels, W-1] (theirs keep W inputs), states [heads, ., .], KV [tokens, ...]."""
    out = {}
    for layer in geometry.layers:
        cached = past.layers[layer.index]
        if layer.kind.is_linear:
            conv = cached.conv_states[0][0, :, 1:]
            out[layer.index, "ssm"] = cached.recurrent_states[0][0].float()
            if layer.kind is LayerKind.KDA:
                for name, part in zip(("conv_q", "conv_k", "conv_v"), conv.chunk(3), strict=True):
                    out[layer.index, name] = part
            else:
                out[layer.index, "conv"] = conv
        elif layer.kind is LayerKind.MLA:
            out[layer.index, "kv"] = torch.cat([cached.keys[0, 0], cached.values[0, 0]], -1)
        else:
            out[layer.index, "k"] = cached.keys[0].transpose(0, 1)
            out[layer.index, "v"] = cached.values[0].transpose(0, 1)
    return out


# -- our engine -------------------------------------------------------------------------


def request_caches(caches: LocalCaches, geometry: ModelGeometry, num_tokens: int) -> dict:
    """One request's caches: slot SLOT's states, and its KV gathered from BLOCKS in order."""
    out = {}
    for layer in geometry.layers:
        for tensor in layer.cache_tensors():
            data = caches.tensors[layer.index, tensor.name]
            kv = tensor.role is Role.KV
            out[layer.index, tensor.name] = (
                data[BLOCKS].flatten(0, 1)[:num_tokens] if kv else data[SLOT]
            ).clone()
    return out


def run_engine(family: str, path: Path, prompt: list[int], new_tokens: int, tp: TPGroup):
    """Greedy tokens, their logits [new_tokens, vocab] and the prefill's request caches."""
    geometry = from_hf_config(path)
    with Checkpoint(path) as checkpoint:
        model = builder(family)(checkpoint, geometry, tp)
    caches = LocalCaches(
        geometry, tp=tp.size, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, num_slots=2
    )
    engine = RankEngine(geometry, caches, tp, model=model)
    logits = [engine.prefill_logits(prompt, BLOCKS, SLOT)]
    prefilled = request_caches(caches, geometry, len(prompt))
    tokens = [int(tp.broadcast_(logits[0].argmax().reshape(1)).item())]
    for i in range(new_tokens - 1):
        logits.append(engine.decode_step_logits(tokens[-1], len(prompt) + i, BLOCKS, SLOT))
        tokens.append(int(tp.broadcast_(logits[-1].argmax().reshape(1)).item()))
    return tokens, torch.stack(logits), prefilled


# -- TP ranks ---------------------------------------------------------------------------


def rank_rows(tensor: CacheTensor, tp: int, rank: int) -> torch.Tensor | None:
    """Global indices along the sharded axis of a request cache that `rank` holds: heads
    (axis 0 of states, axis 1 of KV) or channels (conv); None when replicated."""
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


def rank_slice(tensor: CacheTensor, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    rows = rank_rows(tensor, tp, rank)
    if rows is None:
        return full
    return full.index_select(1 if tensor.role is Role.KV else 0, rows)


def _rank_main(rank, tp_size, family, path, prompt, new_tokens, init_method, out_dir) -> None:
    torch.set_num_threads(1)
    out = Path(out_dir)
    try:
        tp = init_tp_group(rank, tp_size, init_method, timeout_s=TIMEOUT_S)
        result = run_engine(family, Path(path), prompt, new_tokens, tp)
        torch.save(result, out / f"rank{rank}.pt")
        tp.close()
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def run_ranks(family: str, path: Path, prompt, new_tokens: int, tp_size: int, out_dir: Path):
    """`run_engine` on `tp_size` gloo processes; each rank's result."""
    ctx = multiprocessing.get_context("spawn")
    init_method = f"file://{out_dir / 'rendezvous'}"
    args = (tp_size, family, str(path), prompt, new_tokens, init_method, str(out_dir))
    procs = [ctx.Process(target=_rank_main, args=(rank, *args)) for rank in range(tp_size)]
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
