"""`pdxfer launch --model DIR --prompts FILE` on checkpoints that transformers itself made:
the tokens that cross P/D equal transformers' greedy `generate`, at every TP pair."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.model.hf_models import pick_prompt, save_hf
from tests.support.launch import MAIN, ROOT

NEW_TOKENS = 8  # hf_models.NEW_TOKENS: the greedy path pick_prompt checked
PROMPT_LENGTHS = (13, 100)  # the second spans two 64-token chunks
MIN_MARGIN = 1e-3

# (arch, prefill TP, decode TP): every pair on a model whose KV heads split at TP 2 and on
# one whose single KV head is replicated, one pair each for the other two Qwen kinds, and
# every pair for Kimi-Linear (its MLA latent replicated on every rank), Nemotron-H and
# Nemotron-H with MoE blocks (M, E, *, -; experts and the shared expert split over ranks).
CASES = [
    ("qwen3_next_moe", 1, 1),
    ("qwen3_next_moe", 2, 1),
    ("qwen3_next_moe", 1, 2),
    ("qwen3_next_moe", 2, 2),
    ("qwen3_5", 2, 1),
    ("qwen3_5", 1, 2),
    ("qwen3_next_dense", 2, 2),
    ("qwen3_5_moe", 2, 1),
    ("kimi_linear", 1, 1),
    ("kimi_linear", 2, 1),
    ("kimi_linear", 1, 2),
    ("kimi_linear", 2, 2),
    ("nemotron_h", 1, 1),
    ("nemotron_h", 2, 1),
    ("nemotron_h", 1, 2),
    ("nemotron_h", 2, 2),
    ("nemotron_h_moe", 1, 1),
    ("nemotron_h_moe", 2, 1),
    ("nemotron_h_moe", 1, 2),
    ("nemotron_h_moe", 2, 2),
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """arch -> (directory, prompts file, transformers' tokens per prompt); built lazily."""
    built: dict[str, tuple] = {}

    def get(arch: str):
        if arch not in built:
            torch.set_num_threads(2)
            directory = tmp_path_factory.mktemp(arch)
            hf = save_hf(arch, directory)
            lines, expected = [], []
            for length in PROMPT_LENGTHS:
                prompt, tokens, margin = pick_prompt(hf, length)
                assert margin > MIN_MARGIN, f"{arch}: no prompt with a clear greedy path"
                lines.append(json.dumps({"prompt_token_ids": prompt}))
                expected.append(tokens)
            prompts = directory / "prompts.jsonl"
            prompts.write_text("\n".join(lines) + "\n")
            built[arch] = (directory, prompts, expected)
        return built[arch]

    return get


def launch(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", MAIN, "launch", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


@pytest.mark.slow
@pytest.mark.parametrize("arch, prefill_tp, decode_tp", CASES)
def test_tokens_equal_transformers(checkpoints, arch, prefill_tp, decode_tp):
    directory, prompts, expected = checkpoints(arch)
    result = launch(
        "--model", str(directory), "--prompts", str(prompts), "--json", "--verify",
        "--prefill-tp", str(prefill_tp), "--decode-tp", str(decode_tp),
        "--max-tokens", str(NEW_TOKENS),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    rows = report["per_request"]
    assert [row["index"] for row in rows] == [0, 1]
    assert [row["output_token_ids"] for row in rows] == expected
    assert all(len(set(tokens)) > 1 for tokens in expected)  # a degenerate model hides bugs
    assert report["verified"] == 2  # caches bit-exact after the transfer, tokens vs TP=1
    assert "text" not in rows[0]  # no tokenizer.json in these checkpoints


def test_missing_checkpoint_directory_is_a_clear_error(tmp_path):
    result = launch("--model", str(tmp_path / "nowhere"))
    assert result.returncode == 2
    assert "does not exist" in result.stderr and "nowhere" in result.stderr


def test_directory_without_weights_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_next"}))
    result = launch("--model", str(tmp_path))
    assert result.returncode == 2
    assert "safetensors" in result.stderr or "config" in result.stderr


@pytest.mark.parametrize(
    "lines, message",
    [
        (['{"prompt_token_ids": [1, 2, 99999]}'], "prompt_token_ids"),
        (["not json"], ":1: not JSON"),
        (['{"prompt_token_ids": [1]}', '{"tokens": [1]}'], ":2: needs"),
        (['{"prompt": "hello"}'], "tokenizer.json"),
        ([], "no requests"),
    ],
)
def test_bad_prompts_file_names_the_line(tmp_path, lines, message):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(lines))
    result = launch("--model", "tiny-qwen3-next", "--prompts", str(prompts))
    assert result.returncode == 2, result.stderr
    assert message in result.stderr


def test_text_prompts_use_the_checkpoint_tokenizer(tmp_path):
    """make-tiny writes a tokenizer: text prompts are encoded and answers decoded."""
    directory = tmp_path / "tiny"
    made = subprocess.run(
        [sys.executable, "-c", MAIN, "make-tiny", "--model", "tiny-qwen3-next", str(directory)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "Paris is the capital of"}) + "\n")
    result = launch(
        "--model", str(directory), "--prompts", str(prompts), "--json", "--max-tokens", "4"
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    row = json.loads(result.stdout)["per_request"][0]
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    assert row["prompt_tokens"] == len(
        tokenizer.encode("Paris is the capital of", add_special_tokens=False).ids
    )
    assert row["text"] == tokenizer.decode(row["output_token_ids"], skip_special_tokens=True)
