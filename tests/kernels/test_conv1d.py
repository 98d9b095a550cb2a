"""causal_conv1d / causal_conv1d_update: Triton (interpreted) vs the fp32 torch reference."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
import torch.nn.functional as F

from kernels.conv1d import causal_conv1d, causal_conv1d_update

BOUND = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
D, W = 80, 4  # D spans two channel tiles, the second partial


def _inputs(batch, seq_len, dtype, num_seqs=None):
    x = torch.randn(batch, seq_len, D, dtype=dtype)
    weight = torch.randn(D, W, dtype=dtype)
    bias = torch.randn(D, dtype=dtype)
    state = torch.randn(num_seqs or batch, D, W - 1, dtype=dtype)
    return x, weight, bias, state


def test_naive_matches_torch_conv1d(backend, rel_err):
    backend("torch")
    x, weight, bias, _ = _inputs(2, 19, torch.float32)
    y, _ = causal_conv1d(x, weight, bias, activation=None)
    ref = F.conv1d(x.transpose(1, 2), weight[:, None], bias, padding=W - 1, groups=D)
    assert rel_err(y, ref[:, :, :19].transpose(1, 2)) < 1e-6


@pytest.mark.kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("activation", ["silu", None])
def test_conv_triton_matches_naive(backend, rel_err, dtype, with_state, activation):
    x, weight, bias, state = _inputs(2, 19, dtype)  # T=19: not a multiple of W or of the tile
    state = state if with_state else None
    out = {}
    for name in ("torch", "triton"):
        backend(name)
        out[name] = causal_conv1d(x, weight, bias, activation, state, output_final_state=True)
    assert rel_err(out["triton"][0], out["torch"][0]) < BOUND[dtype]
    assert torch.equal(out["triton"][1], out["torch"][1])  # the state is copied inputs


@pytest.mark.kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_matches_separate_sequences(backend, rel_err, dtype):
    lengths = [5, 0, 2, 23]  # empty, shorter than W-1, longer than one tile
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    x, weight, bias, state = _inputs(1, sum(lengths), dtype, num_seqs=len(lengths))
    for name in ("torch", "triton"):
        backend(name)
        y, final = causal_conv1d(x, weight, bias, "silu", state, True, cu_seqlens)
        for n, (bos, eos) in enumerate(pairwise(cu_seqlens.tolist())):
            y_n, final_n = causal_conv1d(
                x[:, bos:eos], weight, bias, "silu", state[n : n + 1], output_final_state=True
            )
            if eos > bos:
                assert rel_err(y[:, bos:eos], y_n) < BOUND[dtype], name
                # the reference computes each output alone, whatever else is in the call
                assert name != "torch" or torch.equal(y[:, bos:eos], y_n)
            assert torch.equal(final[n], final_n[0]), name


@pytest.mark.parametrize("split", [1, 7, 30])
def test_naive_prefill_in_two_calls_equals_one_bit_for_bit(backend, split):
    """A chunked prefill or a prefix-cache hit computes a sequence's tail in a later call,
    among other sequences: its outputs must not change in the last bit (D=80 leaves a
    partial vector at the end of every row)."""
    backend("torch")
    x, weight, bias, state = _inputs(1, 41, torch.float32)
    y_full, final_full = causal_conv1d(x, weight, bias, "silu", state, True)
    y_head, final = causal_conv1d(x[:, :split], weight, bias, "silu", state, True)
    other = torch.randn(1, 9, D)  # another sequence packed before the tail
    cu_seqlens = torch.tensor([0, 9, 9 + 41 - split])
    packed = torch.cat([other, x[:, split:]], dim=1)
    states = torch.cat([torch.randn(1, D, W - 1), final])
    y_tail, finals = causal_conv1d(packed, weight, bias, "silu", states, True, cu_seqlens)
    assert torch.equal(torch.cat([y_head, y_tail[:, 9:]], dim=1), y_full)
    assert torch.equal(finals[1], final_full[0])


@pytest.mark.kernels
@pytest.mark.parametrize("name", ["torch", "triton"])
def test_short_sequence_final_state_keeps_initial_tail(backend, name):
    backend(name)
    x, weight, _, state = _inputs(2, 1, torch.float32)
    _, final = causal_conv1d(x, weight, initial_state=state, output_final_state=True)
    assert torch.equal(final, torch.cat([state[:, :, 1:], x.transpose(1, 2)], dim=2))
    _, final = causal_conv1d(x, weight, output_final_state=True)
    assert torch.equal(final[:, :, : W - 2], torch.zeros(2, D, W - 2))
    assert torch.equal(final[:, :, W - 2], x[:, 0])


def _strided_state(layout: str, batch: int, dtype: torch.dtype):
    """(arena, conv_state view [B,D,W-1]) as an arena of per-slot states would give it."""
    if layout == "channels_x_time":
        arena = torch.randn(batch + 2, D + 8, W - 1, dtype=dtype)
        return arena, arena[1 : batch + 1, 4 : 4 + D]
    arena = torch.randn(batch + 2, W - 1, D + 8, dtype=dtype)  # time x channels
    return arena, arena[1 : batch + 1, :, 4 : 4 + D].transpose(1, 2)


@pytest.mark.kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["channels_x_time", "time_x_channels"])
def test_update_triton_matches_naive_on_strided_state(backend, rel_err, dtype, layout):
    arena, state = _strided_state(layout, 3, dtype)
    x, weight, bias = torch.randn(3, D, dtype=dtype), torch.randn(D, W, dtype=dtype), None
    out = {}
    for name in ("torch", "triton"):
        backend(name)
        arena_copy = arena.clone()
        view = torch.as_strided(arena_copy, state.shape, state.stride(), state.storage_offset())
        y = causal_conv1d_update(x, view, weight, bias)
        out[name] = (y, arena_copy)
    assert rel_err(out["triton"][0], out["torch"][0]) < BOUND[dtype]
    assert torch.equal(out["triton"][1], out["torch"][1])  # same state, nothing outside moved
    new_state = torch.as_strided(
        out["torch"][1], state.shape, state.stride(), state.storage_offset()
    )
    assert torch.equal(new_state, torch.cat([state[:, :, 1:], x[:, :, None]], dim=2))
    changed = out["torch"][1] != arena
    touched = torch.zeros_like(changed)
    torch.as_strided(touched, state.shape, state.stride(), state.storage_offset()).fill_(True)
    assert not (changed & ~touched).any()


@pytest.mark.kernels
@pytest.mark.parametrize("name", ["torch", "triton"])
@pytest.mark.parametrize("layout", ["channels_x_time", "time_x_channels"])
def test_prefill_then_decode_equals_one_pass(backend, rel_err, name, layout):
    backend(name)
    prompt, steps = 13, 5
    x, weight, bias, _ = _inputs(2, prompt + steps, torch.float32)
    y_full, final_full = causal_conv1d(x, weight, bias, output_final_state=True)

    y_prefill, final = causal_conv1d(x[:, :prompt], weight, bias, output_final_state=True)
    _, state = _strided_state(layout, 2, torch.float32)
    state.copy_(final)
    decoded = [causal_conv1d_update(x[:, prompt + i], state, weight, bias) for i in range(steps)]
    y = torch.cat([y_prefill, torch.stack(decoded, dim=1)], dim=1)
    assert rel_err(y, y_full) < BOUND[torch.float32]
    assert torch.equal(state, final_full)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"x": torch.randn(4, D)}, "x"),
        ({"weight": torch.randn(D + 1, W)}, "weight"),
        ({"weight": torch.randn(D, 1)}, "weight"),
        ({"bias": torch.randn(D - 1)}, "bias"),
        ({"activation": "gelu"}, "activation"),
        ({"initial_state": torch.randn(2, D, W)}, "initial_state"),
        ({"cu_seqlens": torch.tensor([0, 3, 10])}, "batch must be 1"),
        ({"x": torch.randn(1, 10, D), "cu_seqlens": torch.tensor([0, 6, 3, 10])}, "cu_seqlens"),
        ({"x": torch.randn(1, 10, D), "cu_seqlens": torch.tensor([0, 9])}, "cu_seqlens"),
        ({"x": torch.randn(1, 10, D), "cu_seqlens": torch.tensor([0.0, 10.0])}, "cu_seqlens"),
        ({"x": torch.randint(0, 9, (2, 10, D))}, "x"),
    ],
)
def test_conv_rejects_bad_input(backend, kwargs, field):
    backend("torch")
    args = {"x": torch.randn(2, 10, D), "weight": torch.randn(D, W)} | kwargs
    with pytest.raises(ValueError, match=field):
        causal_conv1d(**args)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"conv_state": torch.randn(3, D, W)}, "conv_state"),
        ({"conv_state": torch.randn(2, D, W - 1)}, "conv_state"),
        (
            {"conv_state": torch.randn(3, D, W - 1, dtype=torch.float64).to(torch.int32)},
            "conv_state",
        ),
        ({"x": torch.randn(3, 1, D)}, "x"),
        ({"activation": "relu"}, "activation"),
    ],
)
def test_update_rejects_bad_input(backend, kwargs, field):
    backend("torch")
    args = {"x": torch.randn(3, D), "conv_state": torch.randn(3, D, W - 1)}
    args |= {"weight": torch.randn(D, W)} | kwargs
    with pytest.raises(ValueError, match=field):
        causal_conv1d_update(**args)


@pytest.mark.kernels
@pytest.mark.slow  # a subprocess that compiles with LLVM and ptxas
def test_kernels_compile_for_sm90(compile_sm90):
    module, jobs = "kernels.conv1d.triton", []
    for dtype in ("*bf16", "*fp32"):
        ints = dict.fromkeys(("seq_len", "D", "s_n", "s_d", "s_w"), "i32")
        flags = dict(W=4, HAS_INITIAL=True, IS_VARLEN=True, BLOCK_D=64)
        fwd = dict(x=dtype, weight=dtype, bias=dtype, initial_state=dtype, y=dtype)
        fwd |= dict(tiles="*i64", cu_seqlens="*i64", **ints)
        fwd_flags = dict(flags, SILU=True, HAS_BIAS=True, BLOCK_T=16)
        final = dict(x=dtype, initial_state=dtype, final_state=dtype, cu_seqlens="*i64", **ints)
        final_flags = dict(flags, BLOCK_W=4)
        update = dict(x=dtype, conv_state=dtype, weight=dtype, bias=dtype, y=dtype)
        update |= dict.fromkeys(("D", "s_xb", "s_xd", "s_b", "s_d", "s_w"), "i32")
        update_flags = dict(W=4, SILU=True, HAS_BIAS=True, BLOCK_W=4, BLOCK_D=64)
        for name, signature, constexprs in [
            ("_conv_fwd_kernel", fwd, fwd_flags),
            ("_conv_final_state_kernel", final, final_flags),
            ("_conv_update_kernel", update, update_flags),
        ]:
            signature = signature | dict.fromkeys(constexprs, "constexpr")
            jobs.append((module, name, signature, constexprs, ["x"]))
    assert all(".entry" in ptx for ptx in compile_sm90(jobs))
