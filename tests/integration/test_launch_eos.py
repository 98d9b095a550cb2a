"""`pdxfer launch` ends a request at the checkpoint's eos_token_id, as transformers'
`generate` and the HTTP API do, unless `--ignore-eos` asks for fixed lengths."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.model.hf_models import NEW_TOKENS, pick_prompt, save_hf
from tests.support.launch import MAIN, ROOT

MIN_MARGIN = 1e-3


def launch_json(*args: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", MAIN, "launch", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def set_eos(directory, eos: int) -> None:
    """Make `eos` the checkpoint's end token in both files transformers reads it from."""
    for name in ("config.json", "generation_config.json"):
        path = directory / name
        data = json.loads(path.read_text()) if path.is_file() else {}
        data["eos_token_id"] = eos
        path.write_text(json.dumps(data))


@pytest.mark.slow
def test_tokens_stop_at_eos_like_transformers_generate(tmp_path):
    torch.set_num_threads(2)
    hf = save_hf("qwen3_next_moe", tmp_path)
    prompt, free_run, margin = pick_prompt(hf, 13)
    assert margin > MIN_MARGIN, "no prompt with a clear greedy path"
    # The end token: one the greedy run produces, first at a position past the first token.
    stop_at = next(i for i in range(1, len(free_run)) if free_run[i] not in free_run[:i])
    eos = free_run[stop_at]
    set_eos(tmp_path, eos)
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
            eos_token_id=eos, pad_token_id=0,
        )  # fmt: skip
    expected = out[0, len(prompt) :].tolist()
    assert expected == free_run[: stop_at + 1] and len(expected) < NEW_TOKENS
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt_token_ids": prompt}) + "\n")
    common = ("--model", str(tmp_path), "--prompts", str(prompts), "--verify",
              "--max-tokens", str(NEW_TOKENS))  # fmt: skip

    stopped = launch_json(*common)
    row = stopped["per_request"][0]
    assert row["output_token_ids"] == expected
    assert row["finish_reason"] == "stop"
    assert stopped["verified"] == 1  # the TP=1 reference is cut at the same end token

    fixed = launch_json(*common, "--ignore-eos")
    row = fixed["per_request"][0]
    assert row["output_token_ids"] == free_run and len(free_run) == NEW_TOKENS
    assert row["finish_reason"] == "length"
    assert fixed["verified"] == 1 and fixed["ignore_eos"] is True
