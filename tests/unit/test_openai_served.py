"""What the HTTP front end reads of a model: make-tiny's tokenizer as transformers reads it,
end tokens, context length and name; a preset has no tokenizer."""

from __future__ import annotations

import json

import pytest

from transfer.cli import main
from transfer.errors import InvalidInput
from transfer.serving.openai.served import DEFAULT_CONTEXT, load_served_model

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the capital of France?"},
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("served") / "my-tiny"
    assert main(["make-tiny", str(directory)]) == 0
    return directory


def test_make_tiny_writes_a_tokenizer_transformers_reads_like_we_do(tiny_dir):
    from transformers import AutoConfig, AutoTokenizer

    model = load_served_model(str(tiny_dir))
    hf = AutoTokenizer.from_pretrained(tiny_dir)
    text = "The cache of a request moves from prefill to decode. Ünïcödé ✓"
    assert model.codec.encode(text) == hf(text, add_special_tokens=False)["input_ids"]
    assert model.codec.decode(model.codec.encode(text)) == text
    rendered = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert model.codec.render_chat(MESSAGES) == rendered
    eos = AutoConfig.from_pretrained(tiny_dir).eos_token_id
    assert set(model.eos_token_ids) == set(eos) and hf.eos_token_id in eos


def test_name_context_and_end_tokens_come_from_the_checkpoint(tiny_dir):
    config = json.loads((tiny_dir / "config.json").read_text())
    model = load_served_model(str(tiny_dir))
    assert model.name == "my-tiny"
    assert model.max_model_len == config["max_position_embeddings"]
    capped = load_served_model(str(tiny_dir), name="served", max_model_len=100)
    assert (capped.name, capped.max_model_len) == ("served", 100)
    assert (
        load_served_model(str(tiny_dir), max_model_len=1 << 20).max_model_len
        == (config["max_position_embeddings"])
    )


def test_generation_config_end_tokens_are_added(tiny_dir, tmp_path):
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((tiny_dir / name).read_bytes())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert {7, 9} <= set(load_served_model(str(tmp_path)).eos_token_ids)


def test_a_preset_serves_token_ids_only():
    model = load_served_model("tiny-kimi-linear")
    assert model.codec is None and model.name == "tiny-kimi-linear"
    assert model.max_model_len >= 2
    assert load_served_model("qwen3-next-80b-a3b").max_model_len == DEFAULT_CONTEXT
    with pytest.raises(InvalidInput, match="max_model_len"):
        load_served_model("tiny-kimi-linear", max_model_len=1)
