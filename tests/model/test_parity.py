"""Greedy tokens of our model (RankEngine over paged caches) equal transformers' generate,
for tiny random Qwen3-Next (dense, MoE), Qwen3.5 and Qwen3.5-MoE checkpoints saved by
transformers, at TP=1 in-process and at TP=2 over gloo; prompts short and longer than one
64-token chunk of the chunked GDN kernel."""

from __future__ import annotations

import multiprocessing
import traceback
from pathlib import Path

import pytest
import torch

from tests.model.hf_models import ARCHS, engine_greedy, pick_prompt, save_hf
from transfer.model.distributed import init_tp_group
from transfer.model.loader import load_model

PROMPT_LENGTHS = (13, 100)
MIN_MARGIN = 1e-3  # top-1 minus top-2 logit, far above fp32 reduction-order noise (~1e-5)
TIMEOUT_S = 300


@pytest.fixture(scope="module", params=sorted(ARCHS))
def checkpoint(request, tmp_path_factory):
    """(arch, directory, [(prompt, transformers' tokens)])."""
    torch.set_num_threads(2)
    directory = tmp_path_factory.mktemp(request.param)
    hf = save_hf(request.param, directory)
    cases = []
    for length in PROMPT_LENGTHS:
        prompt, tokens, margin = pick_prompt(hf, length)
        assert margin > MIN_MARGIN, f"no candidate prompt with a clear greedy path ({margin})"
        assert len(set(tokens)) > 1, "a degenerate model would hide cache bugs"
        cases.append((prompt, tokens))
    return request.param, directory, cases


def test_tp1_matches_transformers(checkpoint):
    _, directory, cases = checkpoint
    model = load_model(directory)
    for prompt, tokens in cases:
        assert engine_greedy(model, prompt) == tokens, f"prompt of {len(prompt)} tokens"


def _rank_main(rank: int, directory: str, cases, init_method: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    out = Path(out_dir)
    try:
        tp = init_tp_group(rank, 2, init_method, timeout_s=TIMEOUT_S)
        model = load_model(directory, tp)
        got = [engine_greedy(model, prompt) for prompt, _ in cases]
        torch.save(got, out / f"rank{rank}.pt")
        tp.close()
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def run_tp2(directory: Path, cases, out_dir: Path) -> list[list[list[int]]]:
    ctx = multiprocessing.get_context("spawn")
    init_method = f"file://{out_dir / 'rendezvous'}"
    procs = [
        ctx.Process(target=_rank_main, args=(r, str(directory), cases, init_method, str(out_dir)))
        for r in range(2)
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
    assert [p.exitcode for p in procs] == [0, 0]
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(2)]


@pytest.mark.slow
def test_tp2_matches_transformers(checkpoint, tmp_path):
    _, directory, cases = checkpoint
    for got in run_tp2(directory, cases, tmp_path):
        assert got == [tokens for _, tokens in cases]
