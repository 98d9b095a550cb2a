"""Nemotron-H built from a transformers checkpoint: geometry, caches and greedy tokens
against NemotronHForCausalLM, at TP=1 in process and TP=2 over gloo, with n_groups 1 (B and
C replicated on both ranks, the gated norm's one group spanning them) and 2 (split)."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from transformers import NemotronHConfig, NemotronHForCausalLM

from tests.model.parity_kimi_nemotron import (
    hf_caches,
    pick_prompt,
    rank_slice,
    run_engine,
    run_ranks,
)
from transfer.geometry import GQASpec, LayerKind, Mamba2Spec
from transfer.hf_geometry import from_hf_config, from_hf_dict
from transfer.model.checkpoint import Checkpoint
from transfer.model.distributed import TPGroup
from transfer.model.layers.common import Step
from transfer.model.nemotron_h import build_nemotron_h

VOCAB = 256
PROMPT_LEN = 80  # more than one 64-token chunk
NEW_TOKENS = 6
BLOCKS = ["linear_attention", "mlp", "full_attention", "linear_attention", "mlp"]
TIME_STEP_MIN = 0.05
# n_groups, num_key_value_heads: at TP 2 the single group and KV head are replicated.
CASES = {"groups1": (1, 1), "groups2": (2, 2)}


def make_hf_model(n_groups: int, kv_heads: int) -> NemotronHForCausalLM:
    """A random tiny model. dt_bias spans softplus values on both sides of time_step_min, so
    prefill's clamp (and decode's lack of one) matters; in_proj is scaled up so that the scan,
    not the D skip, dominates the Mamba2 output; norm weights and D move off ones."""
    torch.manual_seed(0)
    config = NemotronHConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        layers_block_type=BLOCKS,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        head_dim=16,
        intermediate_size=128,
        mamba_num_heads=8,
        mamba_head_dim=8,
        ssm_state_size=16,
        n_groups=n_groups,
        conv_kernel=4,
        chunk_size=64,
        time_step_min=TIME_STEP_MIN,
        dtype="float32",
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = NemotronHForCausalLM(config).eval()
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
                tensor.add_(0.2 * torch.randn_like(tensor))
            elif name.endswith("in_proj.weight"):
                tensor.mul_(8.0)
            elif name.endswith(".D"):
                tensor.copy_(torch.rand_like(tensor) + 0.5)
            elif name.endswith("dt_bias"):
                tensor.copy_(torch.linspace(-8.0, 0.0, tensor.numel()))
    return model


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def nemotron(request, tmp_path_factory):
    torch.set_num_threads(2)
    n_groups, kv_heads = CASES[request.param]
    model = make_hf_model(n_groups, kv_heads)
    path = tmp_path_factory.mktemp(f"nemotron-{request.param}")
    model.save_pretrained(path)
    best, prompt, tokens, logits = pick_prompt(model, VOCAB, PROMPT_LEN, NEW_TOKENS)
    assert best > 1e-3, f"no prompt with a clear greedy margin ({best})"
    with torch.no_grad():
        past = model(torch.tensor([prompt]), use_cache=True).past_key_values
    return SimpleNamespace(
        model=model,
        path=path,
        n_groups=n_groups,
        kv_heads=kv_heads,
        prompt=prompt,
        tokens=tokens,
        logits=logits,
        caches=hf_caches(past, from_hf_config(path)),
    )


@pytest.fixture(scope="module")
def tp1(nemotron):
    return run_engine("nemotron_h", nemotron.path, nemotron.prompt, NEW_TOKENS, TPGroup.single())


def test_geometry_from_the_transformers_config(nemotron):
    geometry = from_hf_config(nemotron.path)
    mamba = Mamba2Spec(8, 8, 16, nemotron.n_groups, 4)
    gqa = GQASpec(4, nemotron.kv_heads, 16)
    assert [(layer.index, layer.spec) for layer in geometry.layers] == [
        (0, mamba), (2, gqa), (3, mamba)
    ]  # fmt: skip
    assert (geometry.hidden_size, geometry.vocab_size, geometry.num_hidden_layers) == (64, 256, 5)
    assert (geometry.dtype, geometry.ssm_dtype) == ("float32", "float32")


def test_hub_pattern_gives_the_same_geometry(nemotron):
    config = json.loads((nemotron.path / "config.json").read_text())
    del config["layers_block_type"]
    config["hybrid_override_pattern"] = "M-*M-"
    config["mamba_ssm_cache_dtype"] = "bfloat16"
    hub = from_hf_dict(config, "hub")
    assert hub.layers == from_hf_config(nemotron.path).layers
    assert hub.ssm_dtype == "bfloat16"


def test_pattern_blocks_follow_transformers(nemotron):
    data = json.loads((nemotron.path / "config.json").read_text())
    del data["layers_block_type"]
    data["hybrid_override_pattern"] = "M-*ME-M*"
    del data["time_step_limit"]  # json.loads leaves its encoded infinity, transformers refuses it
    theirs = NemotronHConfig.from_dict(data).layers_block_type
    kinds = {"linear_attention": LayerKind.MAMBA2, "full_attention": LayerKind.GQA}
    geometry = from_hf_dict(data, "pattern")
    assert geometry.num_hidden_layers == len(theirs) == 8
    assert [(layer.index, layer.kind) for layer in geometry.layers] == [
        (i, kinds[t]) for i, t in enumerate(theirs) if t in kinds
    ]


def test_full_forward_matches_transformers(nemotron):
    with Checkpoint(nemotron.path) as checkpoint:
        assert checkpoint.has("backbone.embeddings.weight")
        model = build_nemotron_h(checkpoint, from_hf_config(nemotron.path))
    ids = torch.tensor(nemotron.prompt)
    step = Step(True, torch.arange(len(ids)), torch.zeros(0, dtype=torch.long), 0, None)
    with torch.no_grad():
        theirs = nemotron.model(ids[None]).logits[0]
    assert torch.allclose(model.forward(ids, step, all_logits=True), theirs, atol=1e-5, rtol=1e-4)


def test_greedy_tokens_match_transformers_at_tp1(nemotron, tp1):
    tokens, logits, _ = tp1
    assert tokens == nemotron.tokens
    assert len(set(tokens)) > 1
    assert torch.allclose(logits, nemotron.logits, atol=1e-5, rtol=1e-4)


def test_prefill_caches_hold_what_transformers_caches(nemotron, tp1):
    """Mamba2: the last W-1 x|B|C inputs before the conv and the fp32 state [H, P, N];
    attention: K and V of every prompt token."""
    _, _, prefilled = tp1
    assert prefilled.keys() == nemotron.caches.keys()
    for key, theirs in nemotron.caches.items():
        assert torch.allclose(prefilled[key], theirs, atol=1e-5, rtol=1e-4), key


def test_dt_bias_puts_heads_on_both_sides_of_the_clamp(nemotron):
    """The fixture is only a test of the prefill clamp if some heads' dt starts below it."""
    dt_bias = nemotron.model.model.layers[0].mixer.dt_bias
    dt = torch.nn.functional.softplus(dt_bias)
    assert (dt < TIME_STEP_MIN).any() and (dt > TIME_STEP_MIN).any()
    assert math.isclose(nemotron.model.config.time_step_min, TIME_STEP_MIN)


@pytest.mark.slow
def test_tp2_matches_transformers_and_reslices_tp1_caches(nemotron, tp1, tmp_path):
    _, tp1_logits, tp1_caches = tp1
    ranks = run_ranks("nemotron_h", nemotron.path, nemotron.prompt, NEW_TOKENS, 2, tmp_path)
    geometry = from_hf_config(nemotron.path)
    for rank, (tokens, logits, caches) in enumerate(ranks):
        assert tokens == nemotron.tokens
        assert torch.allclose(logits, tp1_logits, atol=1e-5, rtol=1e-4)
        for layer in geometry.layers:
            for tensor in layer.cache_tensors():
                want = rank_slice(tensor, tp1_caches[layer.index, tensor.name], 2, rank)
                got = caches[layer.index, tensor.name]
                assert got.shape == want.shape, (layer.index, tensor.name)
                assert torch.allclose(got, want, atol=1e-5, rtol=1e-4), (layer.index, tensor.name)
