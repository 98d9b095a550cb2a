"""`pdxfer launch --model DIR --prompts FILE --verify` on a Nemotron-H checkpoint with M, E,
*, - blocks that transformers saved: the tokens that cross P/D equal transformers' greedy
`generate` at every TP pair (experts and the shared expert split over the ranks)."""

from __future__ import annotations

import json

import pytest

from tests.integration.test_launch_checkpoints import NEW_TOKENS, checkpoints, launch  # noqa: F401

ARCH = "nemotron_h_moe"


@pytest.mark.slow
@pytest.mark.parametrize("prefill_tp, decode_tp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_moe_tokens_equal_transformers(checkpoints, prefill_tp, decode_tp):  # noqa: F811
    directory, prompts, expected = checkpoints(ARCH)
    result = launch(
        "--model", str(directory), "--prompts", str(prompts), "--json", "--verify",
        "--prefill-tp", str(prefill_tp), "--decode-tp", str(decode_tp),
        "--max-tokens", str(NEW_TOKENS),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    rows = report["per_request"]
    assert [row["output_token_ids"] for row in rows] == expected
    assert all(len(set(tokens)) > 1 for tokens in expected)  # a degenerate model hides bugs
    assert report["verified"] == 2  # caches bit-exact after the transfer, tokens vs TP=1
