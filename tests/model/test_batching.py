"""Batched steps (`BatchEngine`) equal the same requests run one by one through the
per-request engine, for Qwen3-Next (MoE), Kimi-Linear and Nemotron-H: mixed prompt lengths in
one step, decode tokens beside prefills, requests joining and leaving between steps (their
slots and blocks reused), chunked prefill, a transferred state continued; the slot lifecycle
per sequence; TP=2 over gloo.

Prefill steps are row-invariant (transfer/model/row_invariant.py): a prompt's caches and
logits after a step it shares, or after chunks cut at multiples of 64, are the bits of the
prompt alone in one pass. Decode steps keep their natural GEMM shapes, whose rows reduce in
another order by the batch's row count on CPU, so decode logits are compared to `REL` of
their magnitude and greedy choices wherever the margin is clear (batching_support)."""

from __future__ import annotations

import multiprocessing
import traceback
from pathlib import Path

import pytest
import torch

from tests.model.batching_support import (
    ARCHS,
    BLOCK_SIZE,
    NUM_BLOCKS,
    Request,
    assert_caches_close,
    assert_close,
    assert_same_choices,
    build_model,
    engines,
    model_of,
    random_prompt,
    reference,
    request_caches,
    run_schedule,
    save_checkpoint,
)
from transfer.errors import InvalidInput
from transfer.model.batch import SequenceStep
from transfer.model.distributed import init_tp_group
from transfer.model.slots import CacheFillingError, SlotPhase

TIMEOUT_S = 300
CHUNKED_REL = 5e-4  # observed up to 9e-5
# (prompt length, arrival step, new tokens); 3 slots, so the last two wait for freed ones
SCHEDULE = [(20, 0, 3), (45, 0, 6), (70, 1, 4), (9, 2, 5), (33, 2, 3)]


@pytest.fixture(scope="module", params=ARCHS)
def model(request, tmp_path_factory):
    return model_of(request.param, tmp_path_factory)


def test_mixed_prompt_lengths_in_one_step(model):
    lengths = (5, 37, 70, 1)  # one longer than a 64-token kernel chunk, one of a single token
    prompts = [random_prompt(model.geometry.vocab_size, n) for n in lengths]
    refs = [reference(model, p, 1) for p in prompts]
    e = engines(model)
    blocks = torch.randperm(NUM_BLOCKS).tolist()
    steps = []
    for i, p in enumerate(prompts):
        need = -(-len(p) // BLOCK_SIZE)
        steps.append(SequenceStep(p, 3 - i, [blocks.pop() for _ in range(need)]))
    out = e.batch.step(steps)
    assert out.tokens == out.logits.argmax(-1).tolist()
    for i, (step, (_, logits, caches)) in enumerate(zip(steps, refs, strict=True)):
        # a prefill step is row-invariant (transfer/model/row_invariant.py): bit for bit
        assert torch.equal(out.logits[i], logits[0]), f"prompt {i}"
        ours = request_caches(e.caches, step.slot, step.block_ids, len(step.tokens))
        assert [key for key in caches if not torch.equal(ours[key], caches[key])] == []
        assert e.engine.slot_phase(step.slot) is SlotPhase.READY


def test_requests_join_and_leave_between_steps(model):
    vocab = model.geometry.vocab_size
    requests = []
    for length, arrive, new in SCHEDULE:
        prompt = random_prompt(vocab, length)
        tokens, logits, _ = reference(model, prompt, new)
        requests.append(Request(prompt, arrive, new, tokens))
        requests[-1].ref_logits = logits
    e = engines(model, num_slots=3)
    sizes = run_schedule(e, requests, order_seed=int(torch.randint(1 << 30, ())))
    assert max(sizes) == 3 and len(sizes) > 6  # full steps, and arrivals that had to wait
    clear = 0
    for i, r in enumerate(requests):
        clear += assert_same_choices(torch.stack(r.logits), r.ref_logits, f"request {i}")
    assert clear >= 0.8 * sum(r.new_tokens for r in requests), "too few clear choices"
    assert all(e.engine.slot_phase(s) is SlotPhase.FREE for s in range(3))


def test_chunked_prefill_equals_one_shot(model):
    """3 chunks of 40 tokens, each in a step with another request's decode token; the second
    beside a fresh prompt too (fresh and continuing sequences in one chunked-kernel call)."""
    vocab, new = model.geometry.vocab_size, 4
    prompt, other, third = (random_prompt(vocab, n) for n in (120, 30, 25))
    tokens, logits, prefilled = reference(model, prompt, new)
    o_tokens, o_logits, _ = reference(model, other, 6)
    _, t_logits, t_prefilled = reference(model, third, 1)
    e = engines(model)
    blocks, o_blocks, t_blocks = list(range(8, 16)), [40, 3, 17], [50, 51]
    ours, theirs = [], [e.batch.step_logits([SequenceStep(other, 0, o_blocks)])[0]]
    for c in range(3):
        steps = [
            SequenceStep(prompt[40 * c : 40 * c + 40], 2, blocks, 40 * c),
            SequenceStep.decode(o_tokens[c], 0, o_blocks, len(other) + c),
        ]
        if c == 1:
            steps.insert(1, SequenceStep(third, 3, t_blocks))
        out = e.batch.step_logits(steps)
        theirs.append(out[-1])
        if c == 1:
            assert_same_choices(out[1:2], t_logits, "fresh prompt beside a chunk")
            t_caches = request_caches(e.caches, 3, t_blocks, len(third))
            assert_caches_close(t_caches, t_prefilled, "fresh prompt beside a chunk")
    ours.append(out[0])
    caches = request_caches(e.caches, 2, blocks, len(prompt))
    for k in range(1, new):
        step = SequenceStep.decode(tokens[k - 1], 2, blocks, len(prompt) + k - 1)
        ours.append(e.batch.step_logits([step])[0])
    # The chunked kernels sum a prompt in 64-token chunks from its start: chunk boundaries
    # at 40 and 80 change the order, so this is looser than REL.
    assert_caches_close(caches, prefilled, "chunked prefill", rel=CHUNKED_REL)
    assert_same_choices(torch.stack(ours), logits, "chunked prefill", rel=CHUNKED_REL)
    assert_same_choices(torch.stack(theirs), o_logits[:4], "decode beside the chunks")


def test_chunks_cut_at_multiples_of_64_equal_one_shot_bit_for_bit(model):
    """Where the prefill batcher cuts a prompt that does not fit a step: the scans' chunks
    and the attention tiles restart there as in one pass, beside whatever else runs."""
    vocab = model.geometry.vocab_size
    prompt, other = random_prompt(vocab, 150), random_prompt(vocab, 30)
    _, logits, prefilled = reference(model, prompt, 1)
    o_tokens, _, _ = reference(model, other, 4)
    e = engines(model)
    blocks, o_blocks = list(range(20, 30)), [40, 3, 17]
    e.batch.step_logits([SequenceStep(other, 0, o_blocks)])
    for c, start in enumerate((0, 64, 128)):
        chunk = SequenceStep(prompt[start : start + 64], 2, blocks, start)
        out = e.batch.step_logits(
            [SequenceStep.decode(o_tokens[c], 0, o_blocks, len(other) + c), chunk]
        )
    assert torch.equal(out[1], logits[0])
    caches = request_caches(e.caches, 2, blocks, len(prompt))
    assert [key for key in prefilled if not torch.equal(caches[key], prefilled[key])] == []


def test_transferred_state_continues_beside_a_fresh_prefill(model):
    """docs/bugs.md #4: a sequence with context continues from its slot exactly (a state
    that arrived by transfer), while a fresh prefill in the same step starts from zeros."""
    vocab = model.geometry.vocab_size
    prompt, fresh = random_prompt(vocab, 50), random_prompt(vocab, 12)
    tokens, logits, prefilled = reference(model, prompt, 3)
    f_tokens, f_logits, _ = reference(model, fresh, 1)
    e = engines(model)
    slot, blocks = 1, [30, 2, 11, 5]
    e.engine.mark_filling(slot, blocks)
    positions = torch.arange(len(prompt))
    pages = (torch.tensor(blocks)[positions // BLOCK_SIZE], positions % BLOCK_SIZE)
    for (layer, name), data in prefilled.items():  # what a transfer writes
        target = e.caches.tensors[layer, name]
        if name in ("k", "v", "kv"):
            target[pages] = data
        else:
            target[slot] = data
    e.engine.mark_ready(slot)
    out = e.batch.step(
        [SequenceStep(fresh, 0, [7]), SequenceStep.decode(tokens[0], slot, blocks, len(prompt))]
    )
    assert_same_choices(out.logits[:1], f_logits, "fresh prefill")
    assert_same_choices(out.logits[1:], logits[1:2], "transferred request")


def test_sequences_share_prefix_blocks_they_only_read(model):
    """Two requests over one cached prefix (as the decode side's prefix cache hands out)
    decode in one step; a block that a sequence of the step writes may not be shared."""
    e = engines(model)
    prompt = random_prompt(model.geometry.vocab_size, 2 * BLOCK_SIZE + 5)
    first = int(e.batch.step([SequenceStep(prompt, 0, [3, 4, 5])]).logits.argmax())
    e.engine.copy_state(0, 1)
    for tensor in e.caches.tensors.values():  # the partial last block is each one's own
        if tensor.shape[0] == NUM_BLOCKS:
            tensor[6] = tensor[5]
    pos = len(prompt)
    alone = e.batch.step_logits([SequenceStep.decode(first, 0, [3, 4, 5], pos)])
    e.engine.copy_state(1, 0)  # undo the step alone: slot 0 as it was
    both = e.batch.step_logits([
        SequenceStep.decode(first, 0, [3, 4, 5], pos),
        SequenceStep.decode(first, 1, [3, 4, 6], pos),
    ])  # fmt: skip
    assert_close(both[0], alone[0], "shared prefix, batched vs alone")
    assert torch.equal(both[0], both[1])  # the same bytes in, the same step
    with pytest.raises(InvalidInput, match=r"sequences\[1\].block_ids: block 5"):
        e.batch.step([
            SequenceStep.decode(first, 0, [3, 4, 5], pos + 1),
            SequenceStep.decode(first, 1, [3, 4, 5], pos + 1),
        ])  # fmt: skip


def test_slot_lifecycle_holds_per_sequence(model):
    e = engines(model)
    vocab = model.geometry.vocab_size
    e.engine.mark_filling(2, [9, 10])
    prefill = SequenceStep(random_prompt(vocab, 5), 0, [1])
    with pytest.raises(CacheFillingError):
        e.batch.step([prefill, SequenceStep.decode(4, 2, [9, 10], 3)])
    with pytest.raises(CacheFillingError):  # a block that a transfer is filling
        e.batch.step([prefill, SequenceStep(random_prompt(vocab, 5), 1, [10])])
    assert e.engine.slot_phase(0) is SlotPhase.FREE, "a refused step changed a slot"
    with pytest.raises(ValueError, match="holds no request state"):
        e.batch.step([prefill, SequenceStep.decode(4, 1, [3], 5)])
    bad = {
        "sequences[1].slot": [prefill, SequenceStep([5], 0, [2])],
        "sequences[1].block_ids": [prefill, SequenceStep([5], 1, [1])],
        "sequences[0]: a decode step": [SequenceStep.decode(4, 0, [1], 0)],
        "sequences[0].tokens": [SequenceStep([vocab], 0, [1])],
    }
    for field, steps in bad.items():
        with pytest.raises(InvalidInput, match=field.replace("[", r"\[").replace("]", r"\]")):
            e.batch.step(steps)
    assert e.engine.slot_phase(0) is SlotPhase.FREE
    e.batch.step([prefill])
    with pytest.raises(ValueError, match="live request"):
        e.batch.step([prefill])


def _tp2_main(rank: int, arch: str, directory: str, init_method: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    out = Path(out_dir)
    try:
        tp = init_tp_group(rank, 2, init_method, timeout_s=TIMEOUT_S)
        model = build_model(arch, Path(directory), tp)
        torch.manual_seed(11)  # the same prompts on both ranks
        requests = []
        for length, arrive, new in SCHEDULE:
            prompt = random_prompt(model.geometry.vocab_size, length)
            tokens, logits, _ = reference(model, prompt, new)
            requests.append(Request(prompt, arrive, new, tokens))
            requests[-1].ref_logits = logits
        run_schedule(engines(model, num_slots=3), requests, order_seed=5)
        result = [(torch.stack(r.logits), r.ref_logits) for r in requests]
        torch.save(result, out / f"rank{rank}.pt")
        tp.close()
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


@pytest.mark.slow
def test_tp2_batched_equals_one_by_one(tmp_path):
    """Nemotron-H with one B/C group: its gated norm adds an all-reduce over the batch."""
    arch, directory = "nemotron_h", tmp_path / "ckpt"
    save_checkpoint(arch, directory)
    ctx = multiprocessing.get_context("spawn")
    init_method = f"file://{tmp_path / 'rendezvous'}"
    args = (arch, str(directory), init_method, str(tmp_path))
    procs = [ctx.Process(target=_tp2_main, args=(r, *args)) for r in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(TIMEOUT_S)
        if proc.is_alive():
            proc.kill()
            proc.join(10)
    errors = [p.read_text() for p in sorted(tmp_path.glob("rank*.err"))]
    assert not errors, "\n".join(errors)
    assert [p.exitcode for p in procs] == [0, 0]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for i, ((ours0, ref0), (ours1, ref1)) in enumerate(zip(*ranks, strict=True)):
        assert torch.equal(ours0, ours1) and torch.equal(ref0, ref1), "ranks disagree"
        assert_same_choices(ours0, ref0, f"request {i}")


# six sequences' slots of 12: one run, two runs, and more runs than the slices are used for
SLOT_LAYOUTS = {
    "one run": [3, 4, 5, 6, 7, 8],
    "two runs": [0, 1, 2, 9, 10, 11],
    "scattered": [10, 0, 8, 2, 6, 4],
}


@pytest.mark.parametrize("layout", SLOT_LAYOUTS)
def test_state_slices_equal_gather_and_scatter_bit_for_bit(model, layout, monkeypatch):
    """Steps read and write the states of consecutive slots as slices of the cache, and
    those of scattered slots by gather and scatter (`varlen.MAX_SLICED_RUNS`): caches and
    logits have the same bits either way, after a prefill and after decode steps."""
    from transfer.model.layers import varlen

    slots = SLOT_LAYOUTS[layout]
    prompts = [random_prompt(model.geometry.vocab_size, 5 + 7 * i) for i in range(len(slots))]
    runs = []
    for max_runs in (varlen.MAX_SLICED_RUNS, -1):  # the default, then never sliced
        monkeypatch.setattr(varlen, "MAX_SLICED_RUNS", max_runs)
        e = engines(model, num_slots=12)
        blocks = [[4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3] for i in range(len(slots))]
        steps = [SequenceStep(p, s, b) for p, s, b in zip(prompts, slots, blocks, strict=True)]
        logits = [e.batch.step_logits(steps)]
        for k in range(3):
            tokens = logits[-1].argmax(-1).tolist()
            logits.append(e.batch.step_logits([
                SequenceStep.decode(t, s, b, len(p) + k)
                for t, s, b, p in zip(tokens, slots, blocks, prompts, strict=True)
            ]))  # fmt: skip
        runs.append((torch.stack(logits), {k: t.clone() for k, t in e.caches.tensors.items()}))
    (sliced, sliced_caches), (gathered, gathered_caches) = runs
    assert torch.equal(sliced, gathered)
    for key, tensor in gathered_caches.items():
        assert torch.equal(sliced_caches[key], tensor), key
