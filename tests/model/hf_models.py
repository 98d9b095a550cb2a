"""Tiny random transformers models of the real classes, saved as checkpoints, and greedy
references computed by transformers itself (a test-only dependency)."""

from __future__ import annotations

from pathlib import Path

import torch

from transfer.model.caches import LocalCaches
from transfer.model.runner import RankEngine, blocks_needed

BLOCK_SIZE = 16
NEW_TOKENS = 8

_GDN = dict(
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
)
_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    head_dim=16,
    initializer_range=0.2,  # larger than the default 0.02: logits far from tied
    dtype="float32",
    **_GDN,
)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=32)  # fmt: skip
LAYERS = ["linear_attention", "full_attention", "linear_attention", "linear_attention",
          "full_attention"]  # fmt: skip

# name -> (config class, model class, config kwargs). KV heads 2 split at TP 2; 1 replicates.
ARCHS = {
    "qwen3_next_dense": (
        "Qwen3NextConfig", "Qwen3NextForCausalLM",
        dict(_COMMON, num_key_value_heads=2, num_hidden_layers=4, num_experts=0),
    ),
    "qwen3_next_moe": (
        "Qwen3NextConfig", "Qwen3NextForCausalLM",
        dict(_COMMON, **_MOE, num_key_value_heads=1, layer_types=LAYERS,
             num_hidden_layers=len(LAYERS), mlp_only_layers=[2], decoder_sparse_step=1),
    ),
    "qwen3_5": (
        "Qwen3_5TextConfig", "Qwen3_5ForCausalLM",
        dict(_COMMON, num_key_value_heads=1, layer_types=LAYERS, num_hidden_layers=len(LAYERS)),
    ),
    "qwen3_5_moe": (
        "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
        dict(_COMMON, **_MOE, num_key_value_heads=2, num_hidden_layers=4, vocab_size=255),
    ),
}  # fmt: skip


def build_hf(arch: str, seed: int = 0):
    """A tiny random transformers model: a Qwen `ARCHS` entry, or "kimi_linear" /
    "nemotron_h" as their model tests build them."""
    if arch == "kimi_linear":
        from tests.model.test_kimi_linear import make_hf_model

        return make_hf_model()
    if arch == "nemotron_h_moe":
        from tests.model.test_nemotron_h_moe import make_hf_model

        return make_hf_model(seed)
    if arch == "nemotron_h":
        from tests.model.test_nemotron_h import make_hf_model

        return make_hf_model(n_groups=1, kv_heads=1)  # B, C and the KV head replicate at TP 2
    import transformers

    config_cls, model_cls, kwargs = ARCHS[arch]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**kwargs)
    return getattr(transformers, model_cls)(config).eval()


def save_hf(arch: str, directory: Path, seed: int = 0):
    model = build_hf(arch, seed)
    model.save_pretrained(directory)
    return model


def hf_greedy(model, prompt: list[int], new_tokens: int = NEW_TOKENS):
    """(tokens, per-step top-1 minus top-2 logit margins) of transformers' greedy generate."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
            output_scores=True, return_dict_in_generate=True, pad_token_id=0,
        )  # fmt: skip
    margins = [float(s[0].topk(2).values.diff().abs()) for s in out.scores]
    return out.sequences[0, len(prompt) :].tolist(), margins


def pick_prompt(model, length: int, candidates: int = 6, seed: int = 0):
    """The random prompt of `length` whose smallest greedy margin is largest, with its
    tokens and that margin: parity is checked where fp32 reduction order cannot flip it."""
    gen = torch.Generator().manual_seed(seed * 1000 + length)
    best = None
    for _ in range(candidates):
        prompt = torch.randint(0, model.config.vocab_size, (length,), generator=gen).tolist()
        tokens, margins = hf_greedy(model, prompt)
        if best is None or min(margins) > best[2]:
            best = (prompt, tokens, min(margins))
    return best


def engine_greedy(model, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    """Our greedy tokens: prefill through a RankEngine over LocalCaches, then decode steps."""
    geometry = model.geometry
    num_blocks = blocks_needed(len(prompt) + new_tokens, BLOCK_SIZE) + 1
    caches = LocalCaches(
        geometry, tp=model.tp.size, num_blocks=num_blocks, block_size=BLOCK_SIZE, num_slots=2
    )
    engine = RankEngine(geometry, caches, model.tp, model=model)
    blocks = list(reversed(range(num_blocks)))[: num_blocks - 1]  # out of order on purpose
    first = engine.prefill(prompt, blocks, slot=1)
    return [first] + engine.decode(first, len(prompt), blocks, 1, new_tokens - 1)
