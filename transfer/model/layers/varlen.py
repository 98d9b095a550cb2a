"""What the linear and attention layers share to run a `Batch`: the short conv and the scans
over the prefill and decode parts with per-slot states, and paged KV per sequence.

State rule (docs/bugs.md #4, #12): a sequence with context 0 starts from zeros and never reads
its slot; a sequence with context > 0 always continues from its slot, exactly as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kernels import causal_conv1d, causal_conv1d_update
from kernels.rows import index_copy_rows_
from transfer.model.batch import Batch, Part
from transfer.model.layers.common import attend, paged_read

# run(part, inputs [1, Tg, ...] each, initial_state [Ng, ...] fp32 or None) -> (out, final);
# final may be initial_state itself, updated in place (a view of the slots, or a gather)
ScanRun = Callable[[Part, Sequence[torch.Tensor], torch.Tensor | None], tuple]


def scan_chunk_size(device: torch.device) -> int:
    """Chunk length of the chunked delta rule: Triton's 64 on GPUs; on CPUs the torch path
    does O(C^2) work per token inside a chunk and runs fastest at 16 (docs/benchmarks.md,
    "Prefill on the CPU")."""
    return 64 if device.type == "cuda" else 16


# More runs than this and one gather plus one scatter cost less than a copy per run.
MAX_SLICED_RUNS = 4


def initial_states(cache: torch.Tensor, part: Part, dtype: torch.dtype) -> torch.Tensor | None:
    """[Ng, ...] states entering `part`'s sequences: the slot's for those with context, zeros
    for fresh ones; None when all are fresh (the kernels' own zero start). When the slots are
    one run, a view of the cache, which a kernel that updates its states in place (decode)
    writes directly; otherwise a private gather."""
    if part.num_fresh == len(part.fresh):
        return None
    if not part.num_fresh and len(part.slot_runs) == 1 and cache.dtype == dtype:
        _, slot, count = part.slot_runs[0]
        return cache[slot : slot + count]
    states = cache.index_select(0, part.slots).to(dtype)  # a row copy per slot
    if part.num_fresh:
        states[part.fresh] = 0
    return states.contiguous()


def _is_slots_view(cache: torch.Tensor, part: Part, states: torch.Tensor) -> bool:
    """Whether `states` are the cache's own rows of `part`'s slots (one run of them)."""
    if len(part.slot_runs) != 1:
        return False
    _, slot, count = part.slot_runs[0]
    rows = cache[slot : slot + count]
    return states.data_ptr() == rows.data_ptr() and states.stride() == rows.stride()


def store_states(cache: torch.Tensor, part: Part, final: torch.Tensor) -> None:
    """final [Ng, ...] -> the rows of `part`'s slots in cache [slots, ...]: a slice copy per
    run of slots when they are few, else one scatter."""
    if len(part.slot_runs) <= MAX_SLICED_RUNS:
        for row, slot, count in part.slot_runs:
            cache[slot : slot + count].copy_(final[row : row + count])
    else:
        index_copy_rows_(cache, part.slots, final)


def short_conv(
    x: torch.Tensor,
    batch: Batch,
    cache: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Depthwise causal conv + SiLU of x [T, C] over each sequence; `cache` [slots, C, W-1]
    (None: cache-free) gives the windows entering the step and gets the ones leaving it."""
    y = torch.empty_like(x)
    part = batch.prefill
    if part is not None:
        init = None if cache is None else initial_states(cache, part, x.dtype)
        out, final = causal_conv1d(
            part.take(x)[None], weight, bias, initial_state=init,
            output_final_state=cache is not None, cu_seqlens=part.cu_seqlens,
        )  # fmt: skip
        if cache is not None:
            store_states(cache, part, final)
        part.put(y, out[0])
    part = batch.decode
    if part is None:
        return y
    rows = part.take(x)
    if len(part.slot_runs) > MAX_SLICED_RUNS:
        window = cache.index_select(0, part.slots)
        part.put(y, causal_conv1d_update(rows, window, weight, bias))
        store_states(cache, part, window)
        return y
    # each run's windows shift in place, where they are
    out = [
        causal_conv1d_update(rows[row : row + count], cache[slot : slot + count], weight, bias)
        for row, slot, count in part.slot_runs
    ]
    part.put(y, out[0] if len(out) == 1 else torch.cat(out))
    return y


def scan(
    batch: Batch, cache: torch.Tensor | None, inputs: Sequence[torch.Tensor], run: ScanRun
) -> torch.Tensor:
    """A state-space scan over every sequence: `inputs` are per-token [T, ...] tensors;
    `run` calls the chunked kernel for the prefill part and the recurrent one for the decode
    part. `cache` [slots, ...] (None: cache-free) gives the states entering the step and gets
    the ones leaving it. Returns the output [T, ...]."""
    out = None
    for part in (batch.prefill, batch.decode):
        if part is None:
            continue
        init = None if cache is None else initial_states(cache, part, torch.float32)
        o, final = run(part, [part.take(t)[None] for t in inputs], init)
        if cache is not None and not (final is init and _is_slots_view(cache, part, init)):
            store_states(cache, part, final)
        num_tokens = batch.token_ids.shape[0]
        if part.span == slice(0, num_tokens):  # the whole step: no copy
            return o[0]
        if out is None:
            out = o.new_empty(num_tokens, *o.shape[2:])
        part.put(out, o[0])
    return out


def write_kv(batch: Batch, cache: torch.Tensor, rows: torch.Tensor) -> None:
    """rows [T, ...]: every token's KV row lands at its page of cache [NB, BS, ...]."""
    cache[batch.token_blocks, batch.token_offsets] = rows.to(cache.dtype)


def sequence_keys(
    batch: Batch, i: int, cache: torch.Tensor | None, rows: torch.Tensor
) -> torch.Tensor:
    """Keys [L, ...] of positions 0..L-1 that sequence i attends over: its new rows (of all
    T) when it has no context (always so without caches), else its context + new rows read
    back from its blocks (written by `write_kv` first)."""
    sequence, span = batch.sequences[i], batch.span(i)
    if sequence.context_len == 0 or cache is None:
        return rows[span]
    length = sequence.context_len + len(sequence.tokens)
    return paged_read(cache, batch.block_tables[i], length)


def decode_attention(
    batch: Batch, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float
) -> torch.Tensor:
    """Softmax attention of every decode token at once (the cost of a decode step is here):
    q [T, H, D] (only the decode part's rows are read); each decode token reads its context
    and itself from its blocks of k_cache / v_cache [NB, BS, HK, D|Dv] (written by
    `write_kv` first). Returns [Nd, H, Dv] in the decode part's token order."""
    part = batch.decode
    rows = part.take(q).float()
    members = torch.searchsorted(batch.cu_seqlens, part.tokens, right=True) - 1
    lengths = part.take(batch.positions) + 1
    block_size = k_cache.shape[1]
    num_blocks = -(-int(lengths.max()) // block_size)
    n, length = len(members), num_blocks * block_size
    invalid = torch.arange(length, device=q.device)[None, :] >= lengths[:, None]  # [Nd, L]
    # Whole blocks, copied a block at a time (-1 pads a table past its last block). Rows
    # past a sequence's length hold stale bytes, possibly NaN: masked out of the scores
    # and zeroed in the values, as 0 * NaN would not vanish.
    table = batch.block_tables[members, :num_blocks].clamp(min=0).flatten()
    stale = invalid.flatten().nonzero().squeeze(1)  # a row fill, not a broadcast mask
    heads, kv_heads, dv = rows.shape[1], k_cache.shape[2], v_cache.shape[-1]
    group = heads // kv_heads
    # query head h reads key head h // group: per key head, its group's queries at once.
    # Each head's rows are gathered on their own, since a head-major cache keeps a token's
    # heads apart, and each head's output is one contiguous [Nd, group, Dv] tensor, which
    # the CPU's bmm fills in one batched GEMM (into a strided view it loops per sequence).
    grouped = rows.view(n, kv_heads, group, rows.shape[2])
    out = rows.new_empty(kv_heads, n, group, dv)
    for head in range(kv_heads):
        keys = k_cache[:, :, head].index_select(0, table).view(n, length, -1).float()
        values = v_cache[:, :, head].index_select(0, table).view(n * length, dv).float()
        values.index_fill_(0, stale, 0.0)
        scores = torch.bmm(grouped[:, head], keys.transpose(1, 2)) * scale
        scores.masked_fill_(invalid[:, None, :], float("-inf"))
        torch.bmm(scores.softmax(-1), values.view(n, length, dv), out=out[head])
    return out.transpose(0, 1).reshape(n, heads, dv)


def paged_attention(
    batch: Batch, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention of a step: q [T, H, D], this step's k [T, HK, D] and v [T, HK, Dv]
    land in layer `layer`'s paged cache first (when the batch has caches). Decode tokens
    attend all at once (`decode_attention`), each prompt chunk over its context and new
    tokens on its own. Returns [T, H, Dv] in q's dtype."""
    k_cache = v_cache = None
    if batch.caches is not None:
        k_cache, v_cache = batch.caches.kv(layer, "k"), batch.caches.kv(layer, "v")
        write_kv(batch, k_cache, k)
        write_kv(batch, v_cache, v)
    o = q.new_empty(*q.shape[:2], v.shape[-1])
    batched = batch.decode is not None and k_cache is not None
    if batched:
        batch.decode.put(o, decode_attention(batch, q, k_cache, v_cache, scale).to(o.dtype))
    for i, sequence in enumerate(batch.sequences):
        if batched and not sequence.prefill:
            continue
        span = batch.span(i)
        keys = sequence_keys(batch, i, k_cache, k)
        values = sequence_keys(batch, i, v_cache, v)
        o[span] = attend(q[span], keys, values, batch.positions[span], scale)
    return o
