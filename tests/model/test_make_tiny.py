"""`pdxfer make-tiny` writes checkpoints transformers loads and generates the same tokens from,
and the tiny presets run that same checkpoint (written once into the cache directory)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from tests.model.hf_models import engine_greedy, pick_prompt
from transfer.cli import main
from transfer.hf_geometry import from_hf_config
from transfer.model.loader import load_model, tiny_checkpoint
from transfer.presets import TINY_HF_CONFIGS, get_preset

PROMPTS = ([3, 141, 59, 265, 35, 89, 79, 32, 38, 46, 26, 43, 383, 27, 95, 28, 84, 197],
           list(range(5, 385, 5)))  # fmt: skip


@pytest.fixture(scope="module", params=sorted(TINY_HF_CONFIGS))
def tiny_dir(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param) / "ckpt"
    assert main(["make-tiny", "--model", request.param, str(directory)]) == 0
    return request.param, directory


def test_transformers_loads_it_and_generates_our_tokens(tiny_dir):
    from transformers import AutoModelForCausalLM

    name, directory = tiny_dir
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == TINY_HF_CONFIGS[name]["architectures"]
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    assert type(hf).__name__ == config["architectures"][0]
    ours = load_model(directory)
    for length in (18, 76):  # one chunk of the linear layers' kernels, and more
        prompt, tokens, margin = pick_prompt(hf, length, candidates=3)
        assert margin > 1e-2  # the tiny init keeps greedy choices clear
        assert engine_greedy(ours, prompt) == tokens


def test_preset_geometry_is_the_checkpoint_geometry(tiny_dir):
    name, directory = tiny_dir
    assert dataclasses.replace(from_hf_config(directory), name=name) == get_preset(name)
    assert get_preset(name).dtype == "float32"


def test_preset_runs_the_same_seeded_checkpoint(tiny_dir, tmp_path, monkeypatch):
    name, directory = tiny_dir
    monkeypatch.setenv("PDXFER_CACHE", str(tmp_path))
    cached = tiny_checkpoint(name, seed=0)
    assert cached.parent == tmp_path / "tiny" and tiny_checkpoint(name, seed=0) == cached
    assert (cached / "model.safetensors").read_bytes() == (
        directory / "model.safetensors"
    ).read_bytes()
    preset = load_model(name, seed=0)
    assert preset.geometry == get_preset(name)
    assert engine_greedy(preset, PROMPTS[0]) == engine_greedy(load_model(directory), PROMPTS[0])
    other = load_model(name, seed=1)
    assert not torch.equal(other.embed, preset.embed)


def test_unknown_tiny_model_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["make-tiny", "--model", "qwen3-next-80b-a3b", str(tmp_path)])
    assert "invalid choice" in capsys.readouterr().err
