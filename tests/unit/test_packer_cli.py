"""`pdxfer plan --transfer`: the JSON interface, the descriptor target, bad input."""

from __future__ import annotations

import json
import re

import pytest

from transfer.cli import main


def _plan(capsys, *args: str) -> dict:
    assert main(["plan", "--transfer", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_qwen3_next_4096_tokens_at_p_equals_d_json(capsys):
    report = _plan(capsys, "--model", "qwen3-next-80b-a3b", "--tokens", "4096")
    assert report["total_descriptors"] <= 4
    assert report["naive_descriptors"] == 12 * 2 * 3 + 36 * 2  # 3 blocks of 1616 tokens
    assert report["total_wire_bytes"] == report["total_useful_bytes"]
    (rank,) = report["decode_ranks"]
    assert {"rank", "kv_bytes", "state_bytes", "sources"} <= set(rank)
    (source,) = rank["sources"]
    assert {"prefill_rank", "bytes", "descriptors"} <= set(source)
    assert source["bytes"] == rank["kv_bytes"] + rank["state_bytes"] == report["total_wire_bytes"]
    assert (
        rank["kv_bytes"] == 4096 * 12 * 2 * 2 * 256 * 2
    )  # tokens x layers x K,V x heads x dim x 2 B


def test_hetero_tp_reads_each_decode_ranks_share_once(capsys):
    report = _plan(
        capsys, "--model", "kimi-linear-48b-a3b", "--prefill-tp", "4", "--decode-tp", "2"
    )
    assert len(report["decode_ranks"]) == 2
    for rank in report["decode_ranks"]:
        assert sum(s["bytes"] for s in rank["sources"]) == rank["kv_bytes"] + rank["state_bytes"]
        assert rank["kv_bytes"] == 4096 * 7 * (512 + 64) * 2  # MLA latent read once, all 7 layers
    assert report["total_descriptors"] < report["naive_descriptors"] / 10


def test_text_report_lists_sources_per_decode_rank(capsys):
    assert (
        main(
            [
                "plan",
                "--transfer",
                "--model",
                "tiny-nemotron-h",
                "--prefill-tp",
                "2",
                "--decode-tp",
                "4",
                "--tokens",
                "300",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.count("decode rank") == 4 and "<- prefill rank 1" in out and "naive" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prefill-tp", "3"], "tp=3 does not divide"),
        (["--decode-tp", "0"], "--decode-tp must be >= 1"),
        (["--tokens", "0"], "--tokens must be >= 1"),
        (["--tokens", "100000000"], "cannot|need"),
        (["--model", "nope"], "unknown model"),
    ],
)
def test_bad_input_exits_2_naming_the_problem(capsys, args, message):
    model = [] if "--model" in args else ["--model", "tiny-qwen3-next"]
    assert main(["plan", "--transfer", *model, *args]) == 2
    assert re.search(message, capsys.readouterr().err)
