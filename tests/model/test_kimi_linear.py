"""Kimi-Linear built from a transformers checkpoint: geometry, caches and greedy tokens
against KimiLinearForCausalLM, at TP=1 in process and TP=2 over gloo."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from transformers import KimiLinearConfig, KimiLinearForCausalLM

from tests.model.parity_kimi_nemotron import (
    hf_caches,
    pick_prompt,
    rank_slice,
    run_engine,
    run_ranks,
)
from transfer.errors import InvalidInput
from transfer.geometry import KDASpec, LayerKind, MLASpec
from transfer.hf_geometry import from_hf_config, from_hf_dict
from transfer.model.checkpoint import Checkpoint
from transfer.model.distributed import TPGroup
from transfer.model.kimi_linear import build_kimi_linear
from transfer.model.layers.common import Step
from transfer.model.layers.kimi_moe import KimiMoE, Routing
from transfer.model.rank_weights import RankWeights

VOCAB = 256
PROMPT_LEN = 80  # more than one 64-token chunk
NEW_TOKENS = 6
LAYER_TYPES = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    num_local_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    n_shared_experts=1,
    layer_types=LAYER_TYPES,
    mlp_layer_types=["dense", "sparse", "sparse", "dense"],
    linear_head_dim=16,
    linear_num_heads=4,
    linear_conv_kernel_dim=4,
    dtype="float32",
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def make_hf_model(**overrides) -> KimiLinearForCausalLM:
    """A random tiny model; norm weights and the router bias moved off their ones / zeros
    init, so that a model ignoring them would fail."""
    torch.manual_seed(0)
    model = KimiLinearForCausalLM(KimiLinearConfig(**{**CONFIG, **overrides})).eval()
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("norm.weight"):
                tensor.add_(0.2 * torch.randn_like(tensor))
            elif name.endswith("e_score_correction_bias"):
                tensor.copy_(0.05 * torch.randn_like(tensor))
    return model


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    torch.set_num_threads(2)
    model = make_hf_model()
    path = tmp_path_factory.mktemp("kimi")
    model.save_pretrained(path)
    best, prompt, tokens, logits = pick_prompt(model, VOCAB, PROMPT_LEN, NEW_TOKENS)
    assert best > 1e-3, f"no prompt with a clear greedy margin ({best})"
    with torch.no_grad():
        past = model(torch.tensor([prompt]), use_cache=True).past_key_values
    caches = hf_caches(past, from_hf_config(path))
    return SimpleNamespace(
        model=model, path=path, prompt=prompt, tokens=tokens, logits=logits, caches=caches
    )


@pytest.fixture(scope="module")
def tp1(kimi):
    return run_engine("kimi_linear", kimi.path, kimi.prompt, NEW_TOKENS, TPGroup.single())


def test_geometry_from_the_transformers_config(kimi):
    geometry = from_hf_config(kimi.path)
    kda, mla = KDASpec(4, 16, 4), MLASpec(4, 32, 8, 16, 16)
    assert [(layer.index, layer.spec) for layer in geometry.layers] == [
        (0, kda), (1, kda), (2, mla), (3, kda)
    ]  # fmt: skip
    assert (geometry.hidden_size, geometry.vocab_size, geometry.num_hidden_layers) == (64, 256, 4)
    assert geometry.dtype == "float32"


def test_hub_config_form_gives_the_same_geometry(kimi):
    config = json.loads((kimi.path / "config.json").read_text())
    for key in ("layer_types", "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim"):
        del config[key]
    config["linear_attn_config"] = {
        "full_attn_layers": [3],  # 1-based
        "kda_layers": [1, 2, 4],
        "head_dim": 16,
        "num_heads": 4,
        "short_conv_kernel_size": 4,
    }
    hub = from_hf_dict(config, "hub")
    assert hub.layers == from_hf_config(kimi.path).layers


@pytest.mark.parametrize("form", ["layer_types", "linear_attn_config", "neither"])
def test_layer_kinds_follow_transformers_for_every_config_form(kimi, form):
    """transformers' layer_types, the hub's 1-based lists, or transformers' default."""
    data = json.loads((kimi.path / "config.json").read_text())
    data.update(num_hidden_layers=9, layer_types=[LAYER_TYPES[0]] * 9)
    data["layer_types"][2] = data["layer_types"][6] = "full_attention"
    del data["mlp_layer_types"]
    if form != "layer_types":
        del data["layer_types"]
    if form == "linear_attn_config":
        data["linear_attn_config"] = {
            "full_attn_layers": [3, 7],
            "kda_layers": [1, 2, 4, 5, 6, 8, 9],
            "head_dim": 16,
            "num_heads": 4,
            "short_conv_kernel_size": 4,
        }
    theirs = KimiLinearConfig.from_dict(data).layer_types
    kinds = {"full_attention": LayerKind.MLA, "linear_attention": LayerKind.KDA}
    geometry = from_hf_dict(data, form)
    assert [layer.kind for layer in geometry.layers] == [kinds[t] for t in theirs]
    assert "full_attention" in theirs


def test_full_forward_matches_transformers(kimi):
    with Checkpoint(kimi.path) as checkpoint:
        model = build_kimi_linear(checkpoint, from_hf_config(kimi.path), TPGroup.single())
    ids = torch.tensor(kimi.prompt)
    step = Step(True, torch.arange(len(ids)), torch.zeros(0, dtype=torch.long), 0, None)
    ours = model.forward(ids, step, all_logits=True)
    with torch.no_grad():
        theirs = kimi.model(ids[None]).logits[0]
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=1e-4)


def test_greedy_tokens_match_transformers_at_tp1(kimi, tp1):
    tokens, logits, _ = tp1
    assert tokens == kimi.tokens
    assert len(set(tokens)) > 1
    assert torch.allclose(logits, kimi.logits, atol=1e-5, rtol=1e-4)


def test_prefill_caches_hold_what_transformers_caches(kimi, tp1):
    """KDA: the last W-1 projected inputs per q/k/v and the fp32 state; MLA: the normed
    latent and the unrotated k_rot of every prompt token."""
    _, _, prefilled = tp1
    assert prefilled.keys() == kimi.caches.keys()
    for key, theirs in kimi.caches.items():
        assert torch.allclose(prefilled[key], theirs, atol=1e-5, rtol=1e-4), key


def test_q_lora_and_the_mlp_fallbacks(tmp_path):
    """q_a_proj -> q_a_layernorm -> q_b_proj, and first_k_dense_replace when the config has
    no mlp_layer_types (the hub's form)."""
    model = make_hf_model(q_lora_rank=16, mlp_layer_types=["dense", "dense", "sparse", "sparse"])
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["mlp_layer_types"]
    config["first_k_dense_replace"] = 2
    (tmp_path / "config.json").write_text(json.dumps(config))
    with Checkpoint(tmp_path) as checkpoint:
        assert checkpoint.has("model.layers.2.self_attn.q_b_proj.weight")
        ours = build_kimi_linear(checkpoint, from_hf_config(tmp_path), TPGroup.single())
    ids = torch.arange(3, 73)
    step = Step(True, torch.arange(70), torch.zeros(0, dtype=torch.long), 0, None)
    with torch.no_grad():
        theirs = model(ids[None]).logits[0]
    assert torch.allclose(ours.forward(ids, step, all_logits=True), theirs, atol=1e-5, rtol=1e-4)


def test_router_matches_transformers(kimi):
    """Sigmoid scores, the correction bias choosing (not weighting), group top-k, scaling."""
    hf_moe = kimi.model.model.layers[1].mlp
    with Checkpoint(kimi.path) as checkpoint:
        w = RankWeights(checkpoint, 1, 0)
        routing = Routing(8, 2, 2, 1, True, kimi.model.config.routed_scaling_factor)
        moe = KimiMoE(w, "model.layers.1.block_sparse_moe.", 64, routing, 32, 1)
    x = torch.randn(50, 64)
    weights, ids = moe.route(x)
    with torch.no_grad():
        _, hf_weights, hf_ids = hf_moe.gate(x)
    order, hf_order = ids.argsort(-1), hf_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), hf_ids.gather(1, hf_order))
    assert torch.allclose(weights.gather(1, order), hf_weights.gather(1, hf_order))


def test_wrong_geometry_is_refused(kimi):
    geometry = from_hf_config(kimi.path)
    fewer = type(geometry)(geometry.name, geometry.layers[:3], 64, VOCAB, 3)
    with Checkpoint(kimi.path) as checkpoint, pytest.raises(InvalidInput, match="geometry"):
        build_kimi_linear(checkpoint, fewer, TPGroup.single())
    assert {layer.kind for layer in geometry.layers} == {LayerKind.KDA, LayerKind.MLA}


@pytest.mark.slow
def test_tp2_matches_transformers_and_reslices_tp1_caches(kimi, tp1, tmp_path):
    tp1_tokens, tp1_logits, tp1_caches = tp1
    ranks = run_ranks("kimi_linear", kimi.path, kimi.prompt, NEW_TOKENS, 2, tmp_path)
    geometry = from_hf_config(kimi.path)
    for rank, (tokens, logits, caches) in enumerate(ranks):
        assert tokens == kimi.tokens
        assert torch.allclose(logits, tp1_logits, atol=1e-5, rtol=1e-4)
        for layer in geometry.layers:
            for tensor in layer.cache_tensors():
                want = rank_slice(tensor, tp1_caches[layer.index, tensor.name], 2, rank)
                got = caches[layer.index, tensor.name]
                assert got.shape == want.shape, (layer.index, tensor.name)
                assert torch.allclose(got, want, atol=1e-5, rtol=1e-4), (layer.index, tensor.name)
