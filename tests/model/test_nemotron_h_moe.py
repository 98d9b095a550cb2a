"""Nemotron-H with MoE (`E`) blocks against transformers' NemotronHForCausalLM: the router's
group-limited sigmoid top-k on random inputs, the whole forward with M, E, *, - blocks, and
the hub's config forms. Greedy tokens across P/D at every TP pair:
tests/integration/test_launch_checkpoints.py."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import NemotronHConfig, NemotronHForCausalLM

from transfer.errors import InvalidInput
from transfer.hf_geometry import from_hf_config, from_hf_dict
from transfer.model.checkpoint import Checkpoint
from transfer.model.layers.common import Step
from transfer.model.layers.sigmoid_router import SigmoidRouter, routing_from_config
from transfer.model.nemotron_h import build_nemotron_h
from transfer.model.rank_weights import RankWeights

VOCAB = 256
HIDDEN = 64
BLOCKS = ["linear_attention", "moe", "full_attention", "mlp", "linear_attention", "moe"]
PATTERN = "ME*-ME"


def make_hf_model(seed: int = 0) -> NemotronHForCausalLM:
    """A random tiny MoE model: 8 experts in 2 groups, 1 group kept, top 2, scaling 2.5.
    transformers starts the router at zero (every score 0.5, top-k a tie): draw it, and a
    correction bias large enough to change some choices."""
    torch.manual_seed(seed)
    config = NemotronHConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        layers_block_type=BLOCKS,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=128,
        mamba_num_heads=8,
        mamba_head_dim=8,
        ssm_state_size=16,
        n_groups=1,
        conv_kernel=4,
        chunk_size=64,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48,
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
            elif name.endswith("gate.weight"):
                tensor.copy_(torch.randn_like(tensor) * 2.0 / HIDDEN**0.5)
            elif name.endswith("in_proj.weight"):
                tensor.mul_(8.0)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn_like(buffer))
    return model


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    torch.set_num_threads(2)
    model = make_hf_model()
    path = tmp_path_factory.mktemp("nemotron-moe")
    model.save_pretrained(path)
    return model, path


def test_router_matches_transformers_on_random_inputs(moe):
    """Sigmoid scores; the bias chooses, not weighs; the best group by its top two; norm;
    scaling. Ids compared as sets per token, weights in the same order."""
    model, path = moe
    hf_gate = model.model.layers[1].mixer.gate
    with Checkpoint(path) as checkpoint:
        router = SigmoidRouter(
            RankWeights(checkpoint, 1, 0),
            "backbone.layers.1.mixer.gate.",
            HIDDEN,
            routing_from_config(checkpoint.config),
        )
    x = torch.randn(200, HIDDEN, generator=torch.Generator().manual_seed(7))
    weights, ids = router(x)
    with torch.no_grad():
        _, hf_weights, hf_ids = hf_gate(x)
    order, hf_order = ids.argsort(-1), hf_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), hf_ids.gather(1, hf_order))
    assert torch.allclose(weights.gather(1, order), hf_weights.gather(1, hf_order))
    assert torch.allclose(weights.sum(-1), torch.full((200,), 2.5))  # renormalised, scaled
    groups = ids // 4
    assert torch.equal(groups[:, 0], groups[:, 1])  # both experts from the one kept group
    assert groups.unique().numel() == 2  # and each group wins for some tokens
    # The bias must matter here, or the test could not tell "bias chooses" from "no bias".
    unbiased = torch.sigmoid(x @ hf_gate.weight.detach().T)
    assert not torch.equal(unbiased.topk(2).indices.sort().values, ids.sort().values)


def test_full_forward_matches_transformers(moe):
    model, path = moe
    with Checkpoint(path) as checkpoint:
        ours = build_nemotron_h(checkpoint, from_hf_config(path))
    ids = torch.randint(3, VOCAB, (80,), generator=torch.Generator().manual_seed(3))
    step = Step(True, torch.arange(len(ids)), torch.zeros(0, dtype=torch.long), 0, None)
    with torch.no_grad():
        theirs = model(ids[None]).logits[0]
    assert torch.allclose(ours.forward(ids, step, all_logits=True), theirs, atol=1e-5, rtol=1e-4)


def test_hub_pattern_with_experts_gives_the_same_geometry(moe):
    _, path = moe
    config = json.loads((path / "config.json").read_text())
    del config["layers_block_type"]
    config["hybrid_override_pattern"] = PATTERN
    hub = from_hf_dict(config, "hub")
    assert hub.layers == from_hf_config(path).layers
    assert [layer.index for layer in hub.layers] == [0, 2, 4]
    assert hub.num_hidden_layers == 6


def _variant(path, tmp_path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(config))
    os.symlink(path / "model.safetensors", tmp_path / "model.safetensors")
    return tmp_path


def test_hub_pattern_checkpoint_builds_the_same_model(moe, tmp_path):
    model, path = moe
    hub = _variant(path, tmp_path, layers_block_type=None, hybrid_override_pattern=PATTERN)
    ids = torch.arange(3, 40)
    step = Step(True, torch.arange(len(ids)), torch.zeros(0, dtype=torch.long), 0, None)
    with Checkpoint(hub) as checkpoint:
        ours = build_nemotron_h(checkpoint).forward(ids, step, all_logits=True)
    with torch.no_grad():
        theirs = model(ids[None]).logits[0]
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"moe_latent_size": 16}, "moe_latent_size"),
        ({"n_group": 3}, "n_group"),
        ({"topk_group": 3}, "topk_group"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
    ],
)
def test_unsupported_or_inconsistent_routing_is_refused(moe, tmp_path, changes, message):
    _, path = moe
    variant = _variant(path, tmp_path, **changes)
    with Checkpoint(variant) as checkpoint, pytest.raises(InvalidInput, match=message):
        build_nemotron_h(checkpoint)


def test_nano_30b_preset_is_its_published_config():
    """The preset equals the geometry read from the published config.json's fields."""
    from transfer.presets import NEMOTRON_3_NANO_30B_PATTERN, get_preset

    published = {
        "model_type": "nemotron_h",
        "hybrid_override_pattern": NEMOTRON_3_NANO_30B_PATTERN,
        "num_hidden_layers": 52,
        "hidden_size": 2688,
        "vocab_size": 131072,
        "mamba_num_heads": 64,
        "mamba_head_dim": 64,
        "ssm_state_size": 128,
        "n_groups": 8,
        "conv_kernel": 4,
        "num_attention_heads": 32,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "mamba_ssm_cache_dtype": "float32",
        "torch_dtype": "bfloat16",
    }
    preset = get_preset("nemotron-3-nano-30b-a3b")
    assert preset.layers == from_hf_dict(published, "hub").layers
    assert preset.ssm_dtype == from_hf_dict(published, "hub").ssm_dtype == "float32"
    assert (len(NEMOTRON_3_NANO_30B_PATTERN), NEMOTRON_3_NANO_30B_PATTERN.count("E")) == (52, 23)
    assert (preset.num_hidden_layers, preset.hidden_size) == (52, 2688)
