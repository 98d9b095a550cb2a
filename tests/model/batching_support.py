"""Shared by the batched-step tests: tiny transformers-saved models of the three families,
engines over fresh caches, one request's caches, closeness and the one-by-one reference."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from transfer.hf_geometry import from_hf_config
from transfer.model.batch import SequenceStep
from transfer.model.batch_runner import BatchEngine
from transfer.model.caches import LocalCaches
from transfer.model.checkpoint import Checkpoint
from transfer.model.distributed import TPGroup
from transfer.model.reference import full_sequence_logits
from transfer.model.runner import RankEngine

ARCHS = ("qwen3_next", "kimi_linear", "nemotron_h")
BLOCK_SIZE = 16
NUM_BLOCKS = 64
# Batched and one-by-one runs differ only in how many rows each matmul has, which changes
# CPU GEMM reduction order by an ulp or so: caches and logits agree to this much of their
# largest magnitude (observed: up to 7e-6 on the MoE Qwen model).
REL = 5e-5
# The cache-free forward runs the chunked kernels over the whole sequence, the engine the
# recurrent ones per decode token; Nemotron-H's decode also leaves dt unclamped (as
# transformers does), a slightly different function. A lost or reset state is off by O(1).
FULL_REL = 1e-3
MARGIN = 1e-3  # top-1 minus top-2 logit above which the argmax must not move


def save_checkpoint(arch: str, directory: Path) -> None:
    """A tiny random checkpoint of `arch`, written by transformers."""
    if arch == "qwen3_next":
        from tests.model.hf_models import save_hf

        save_hf("qwen3_next_moe", directory)
    elif arch == "kimi_linear":
        from tests.model.test_kimi_linear import make_hf_model

        make_hf_model().save_pretrained(directory)
    else:
        from tests.model.test_nemotron_h import make_hf_model

        make_hf_model(n_groups=1, kv_heads=1).save_pretrained(directory)


def build_model(arch: str, directory: Path, tp: TPGroup):
    """Rank `tp.rank`'s shard of the checkpoint in `directory`."""
    with Checkpoint(directory) as checkpoint:
        if arch == "qwen3_next":
            from transfer.model.qwen3_next import QwenHybridLM

            return QwenHybridLM(checkpoint, tp)
        if arch == "kimi_linear":
            from transfer.model.kimi_linear import build_kimi_linear

            return build_kimi_linear(checkpoint, from_hf_config(directory), tp)
        from transfer.model.nemotron_h import build_nemotron_h

        return build_nemotron_h(checkpoint, from_hf_config(directory), tp)


def model_of(arch: str, tmp_path_factory) -> object:
    """A tiny random checkpoint of `arch`, saved by transformers and built at TP=1, with
    the test process on one thread (what the rank processes use)."""
    torch.set_num_threads(1)
    directory = tmp_path_factory.mktemp(arch)
    save_checkpoint(arch, directory)
    return build_model(arch, directory, TPGroup.single())


@dataclass
class Engines:
    caches: LocalCaches
    engine: RankEngine
    batch: BatchEngine


def engines(model, num_slots: int = 4, block_size: int = BLOCK_SIZE) -> Engines:
    caches = LocalCaches(
        model.geometry, tp=model.tp.size, num_blocks=NUM_BLOCKS, block_size=block_size,
        num_slots=num_slots,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(7)
    for tensor in caches.tensors.values():  # stale bytes a fresh prefill must never read
        tensor.copy_(torch.randn(tensor.shape, generator=gen))
    engine = RankEngine(model.geometry, caches, model.tp, model=model)
    return Engines(caches, engine, BatchEngine(engine))


def request_caches(caches: LocalCaches, slot: int, blocks, num_tokens: int) -> dict:
    """One request's caches: its slot's states and its first `num_tokens` KV rows in order."""
    out = {}
    for (layer, name), data in caches.tensors.items():
        kv = data.shape[0] == caches.num_blocks and name in ("k", "v", "kv")
        out[layer, name] = (
            data[list(blocks)].flatten(0, 1)[:num_tokens] if kv else data[slot]
        ).clone()
    return out


def assert_close(ours: torch.Tensor, theirs: torch.Tensor, what: str, rel: float = REL) -> None:
    scale = float(theirs.abs().max()) or 1.0
    diff = float((ours.float() - theirs.float()).abs().max())
    assert diff <= rel * scale, f"{what}: max diff {diff:.3g} > {rel} x {scale:.3g}"


def assert_caches_close(ours: dict, theirs: dict, what: str, rel: float = REL) -> None:
    assert ours.keys() == theirs.keys()
    for key in theirs:
        assert_close(ours[key], theirs[key], f"{what} {key}", rel)


def assert_same_choices(
    ours: torch.Tensor, theirs: torch.Tensor, what: str, rel: float = REL
) -> int:
    """Logits [n, vocab] close, and the same argmax wherever theirs has a clear margin;
    returns how many steps had one."""
    assert_close(ours, theirs, f"{what} logits", rel)
    top = theirs.topk(2, dim=-1)
    clear = (top.values[:, 0] - top.values[:, 1]) > MARGIN
    assert torch.equal(ours.argmax(-1)[clear], top.indices[clear, 0]), what
    return int(clear.sum())


def reference(model, prompt: list[int], new_tokens: int):
    """One request alone through the per-request engine: (greedy tokens [new_tokens],
    their logits [new_tokens, vocab], its caches right after prefill)."""
    e = engines(model, num_slots=1)
    blocks = list(range(-(-(len(prompt) + new_tokens) // BLOCK_SIZE)))
    logits = [e.engine.prefill_logits(prompt, blocks, 0)]
    prefilled = request_caches(e.caches, 0, blocks, len(prompt))
    tokens = [int(logits[0].argmax())]
    for i in range(new_tokens - 1):
        logits.append(e.engine.decode_step_logits(tokens[-1], len(prompt) + i, blocks, 0))
        tokens.append(int(logits[-1].argmax()))
    # Checked against the cache-free forward of the whole sequence, which shares no cache
    # path with the engine: a reference that lost or reset a state would pass otherwise.
    full = full_sequence_logits(model, prompt + tokens[:-1])[len(prompt) - 1 :]
    assert_close(torch.stack(logits), full, "per-request engine vs cache-free", rel=FULL_REL)
    return tokens, torch.stack(logits), prefilled


def random_prompt(vocab: int, length: int) -> list[int]:
    return torch.randint(3, vocab, (length,)).tolist()


@dataclass
class Request:
    """A request of a scheduled run: its prompt, the step it arrives at, its tokens."""

    prompt: list[int]
    arrive: int
    new_tokens: int
    ref_tokens: list[int]
    slot: int | None = None
    blocks: list[int] | None = None
    done: bool = False

    def __post_init__(self) -> None:
        self.logits: list[torch.Tensor] = []


def run_schedule(e: Engines, requests: list[Request], order_seed: int) -> list[int]:
    """Continuous batching in miniature: each step, every running request decodes its next
    reference token (teacher forcing) and arrivals with a free slot prefill, in a shuffled
    order; finished requests free their slot and blocks at once, for later arrivals to
    reuse. Fills each request's `logits`; returns the batch size of every step."""
    free_slots = list(range(e.caches.num_slots))
    free_blocks = torch.randperm(NUM_BLOCKS).tolist()
    order = torch.Generator().manual_seed(order_seed)
    sizes, step = [], 0
    while not all(r.done for r in requests):
        pairs = []
        for r in requests:
            if r.slot is not None and not r.done:
                k = len(r.logits)
                pairs.append((r, SequenceStep.decode(
                    r.ref_tokens[k - 1], r.slot, r.blocks, len(r.prompt) + k - 1
                )))  # fmt: skip
            elif r.slot is None and r.arrive <= step and free_slots:
                need = -(-(len(r.prompt) + r.new_tokens) // BLOCK_SIZE)
                r.slot, r.blocks = free_slots.pop(0), [free_blocks.pop() for _ in range(need)]
                pairs.append((r, SequenceStep(r.prompt, r.slot, r.blocks)))
        pairs = [pairs[i] for i in torch.randperm(len(pairs), generator=order).tolist()]
        logits = e.batch.step_logits([s for _, s in pairs])
        for (r, _), row in zip(pairs, logits, strict=True):
            r.logits.append(row)
            if len(r.logits) == r.new_tokens:
                r.done = True
                e.engine.release(r.slot)
                free_slots.append(r.slot)
                free_blocks.extend(r.blocks)
        sizes.append(len(pairs))
        step += 1
    return sizes
