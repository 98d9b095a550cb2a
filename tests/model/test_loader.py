"""Loading checkpoints: the multimodal Qwen3.5 layout, per-rank slices, and clear errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.model.hf_models import engine_greedy, save_hf
from transfer.errors import InvalidInput, NotFound
from transfer.model.checkpoint import Checkpoint
from transfer.model.distributed import TPGroup
from transfer.model.loader import load_model

PROMPT = [11, 200, 37, 5, 90, 143, 7, 66, 250, 18]


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3_5")
    save_hf("qwen3_5", directory)
    return directory


def copy_of(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_multimodal_checkpoint_reads_the_language_model_only(qwen35, tmp_path):
    """Qwen3_5ForConditionalGeneration's layout: config under text_config, weights under
    model.language_model., plus vision and MTP tensors that must be ignored."""
    text = json.loads((qwen35 / "config.json").read_text())
    config = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
              "text_config": {**text, "model_type": "qwen3_5_text"}, "vision_config": {},
              "tie_word_embeddings": False}  # fmt: skip
    tensors = {}
    for name, tensor in load_file(qwen35 / "model.safetensors").items():
        tensors[name.replace("model.", "model.language_model.", 1)] = tensor
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
    tensors["mtp.fc.weight"] = torch.zeros(2, 2)
    multimodal = tmp_path / "mm"
    multimodal.mkdir()
    save_file(tensors, multimodal / "model.safetensors", {"format": "pt"})
    (multimodal / "config.json").write_text(json.dumps(config))
    assert engine_greedy(load_model(multimodal), PROMPT) == engine_greedy(
        load_model(qwen35), PROMPT
    )


def test_each_rank_holds_only_its_slice(qwen35):
    """TP 2: the GDN conv weight of rank r is its q, k and v heads' rows, segment by segment."""
    full = load_model(qwen35).layers[0].mixer.conv_weight  # [2*32 + 64 channels, W]
    q, k, v = full.split([32, 32, 64])
    for rank in range(2):
        part = load_model(qwen35, TPGroup(rank, 2, distributed=False)).layers[0].mixer
        rows = slice(16 * rank, 16 * (rank + 1))
        want = torch.cat([q[rows], k[rows], v[32 * rank : 32 * (rank + 1)]])
        assert torch.equal(part.conv_weight, want)
        assert part.out_proj.shape == (64, 32)


def test_missing_directory_is_not_found(tmp_path):
    with pytest.raises(NotFound, match="model: .*does not exist"):
        load_model(tmp_path / "nope")


def test_directory_without_config(qwen35, tmp_path):
    directory = copy_of(qwen35, tmp_path / "c")
    (directory / "config.json").unlink()
    with pytest.raises(InvalidInput, match="has no config.json"):
        load_model(directory)


def test_directory_without_weights(qwen35, tmp_path):
    directory = copy_of(qwen35, tmp_path / "c")
    (directory / "model.safetensors").unlink()
    with pytest.raises(InvalidInput, match=r"has no \*.safetensors weights"):
        load_model(directory)


def test_index_listing_a_missing_shard(qwen35, tmp_path):
    directory = copy_of(qwen35, tmp_path / "c")
    (directory / "model.safetensors").rename(directory / "model-00001-of-00002.safetensors")
    weight_map = {"model.norm.weight": "model-00001-of-00002.safetensors",
                  "lm_head.weight": "model-00002-of-00002.safetensors"}  # fmt: skip
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(InvalidInput, match="lists missing shards.*00002-of-00002"):
        load_model(directory)


def test_wrong_tensor_shape_names_the_tensor(qwen35, tmp_path):
    directory = copy_of(qwen35, tmp_path / "c")
    tensors = load_file(directory / "model.safetensors")
    name = "model.layers.1.self_attn.k_proj.weight"
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, directory / "model.safetensors", {"format": "pt"})
    with pytest.raises(InvalidInput, match=rf"{name}.*shape \[16, 63\], expected \[16, 64\]"):
        load_model(directory)


def test_missing_tensor_names_it(qwen35, tmp_path):
    directory = copy_of(qwen35, tmp_path / "c")
    tensors = load_file(directory / "model.safetensors")
    del tensors["model.layers.0.linear_attn.A_log"]
    save_file(tensors, directory / "model.safetensors", {"format": "pt"})
    with pytest.raises(InvalidInput, match="no tensor 'model.layers.0.linear_attn.A_log'"):
        load_model(directory)


def test_unsupported_architecture_is_named(qwen35, tmp_path):
    directory = copy_of(qwen35, tmp_path / "c")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    with pytest.raises(InvalidInput, match="model_type 'llama'"):
        load_model(directory)


def test_tp_that_cannot_split_the_ffn(qwen35):
    with pytest.raises(ValueError, match="tp=3 does not divide"):
        load_model(qwen35, TPGroup(0, 3, distributed=False))


def test_checkpoint_reads_slices_along_any_dim(qwen35):
    from transfer.geometry import Segment

    with Checkpoint(qwen35) as ckpt:
        whole = ckpt.read("model.layers.0.mlp.down_proj.weight")  # [64, 128]
        ffn = (Segment("ffn", 128, 1),)
        assert torch.equal(
            ckpt.read_dim("model.layers.0.mlp.down_proj.weight", 1, ffn, 4, 3), whole[:, 96:]
        )


def test_fused_expert_tensors_load_as_per_expert_ones(tmp_path):
    """transformers' in-memory layout (experts.gate_up_proj [E, 2I, H], experts.down_proj
    [E, H, I]) gives each rank the same expert slices as the hub's per-expert tensors."""
    per_expert = tmp_path / "per_expert"
    save_hf("qwen3_5_moe", per_expert)
    fused = copy_of(per_expert, tmp_path / "fused")
    tensors = load_file(per_expert / "model.safetensors")
    for layer in range(4):
        p = f"model.layers.{layer}.mlp.experts."
        parts = [[tensors.pop(f"{p}{e}.{n}_proj.weight") for e in range(4)]
                 for n in ("gate", "up", "down")]  # fmt: skip
        gate, up, down = (torch.stack(x) for x in parts)
        tensors[p + "gate_up_proj"] = torch.cat([gate, up], dim=1).contiguous()
        tensors[p + "down_proj"] = down.contiguous()
    save_file(tensors, fused / "model.safetensors", {"format": "pt"})
    for rank in range(2):
        tp = TPGroup(rank, 2, distributed=False)
        a, b = (load_model(d, tp).layers[1].mlp for d in (per_expert, fused))
        assert torch.equal(a.gate_up, b.gate_up) and torch.equal(a.down, b.down)
        assert a.gate_up.shape == (4, 32, 64)  # 2 x 16 of the 32 intermediate columns
    assert engine_greedy(load_model(fused), PROMPT) == engine_greedy(load_model(per_expert), PROMPT)
