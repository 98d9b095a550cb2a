"""Two-node `pdxfer bench transfer` on one box: node 0 (rank host) and node 1 (driver) as
two processes on 127.0.0.1, as the bench Job runs them in two pods."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from transfer.bench.transfer_remote import RemotePeer
from transfer.net import free_port

ENTRY = "import sys; from transfer.cli import main; sys.exit(main())"
TINY = ("--model", "tiny-qwen3-next", "--tokens", "256", "--repeats", "1")
TINY += ("--prefill-tp", "1", "--decode-tp", "1", "--control-tickets", "0", "--json")


def _node(rank: int, port: int, token_file, *extra: str) -> subprocess.Popen:
    argv = [sys.executable, "-c", ENTRY, "bench", "transfer", *TINY, *extra]
    argv += [f"--node-rank={rank}", f"--peer=127.0.0.1:{port}", f"--auth-token-file={token_file}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDXFER_AUTH_TOKEN")}
    return subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def _token(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(text + "\n")
    return path


@pytest.mark.slow
def test_two_nodes_move_and_verify_the_bytes(tmp_path):
    port, token = free_port(), _token(tmp_path, "token", "s3cret")
    host = _node(0, port, token)
    try:
        driver = _node(1, port, token)
        out, err = driver.communicate(timeout=50)
        assert driver.returncode == 0, err
        host_out, host_err = host.communicate(timeout=20)
    finally:
        for proc in (host, driver):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert host.returncode == 0, host_err
    assert "rank host: done after 1 session(s)" in host_err
    report = json.loads(out)
    assert report["nodes"] == "two-node"
    [result] = report["results"]
    assert result["tokens"] == 256 and result["bytes"] > 0
    assert result["verified"] is True


@pytest.mark.slow
def test_wrong_token_is_refused(tmp_path):
    port = free_port()
    host = _node(0, port, _token(tmp_path, "token", "s3cret"))
    try:
        wrong = RemotePeer("127.0.0.1", port, b"guess", connect_timeout_s=20.0)
        with pytest.raises(ValueError, match="refused"):
            wrong.connect((), "prefill ranks")
        RemotePeer("127.0.0.1", port, b"s3cret").finish()
        _, err = host.communicate(timeout=20)
    finally:
        if host.poll() is None:
            host.kill()
            host.wait()
    assert host.returncode == 0, err
    assert "127.0.0.1 (wrong token)" in err
    assert "rank processes" not in err


def test_two_node_flags_are_checked(tmp_path, monkeypatch, capsys):
    from transfer.cli import main

    monkeypatch.delenv("PDXFER_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("PDXFER_AUTH_TOKEN_FILE", raising=False)
    base = ["bench", "transfer", "--model", "tiny-qwen3-next"]
    token = _token(tmp_path, "token", "x")
    for extra, flag in (
        (["--node-rank", "1"], "--peer"),
        (["--peer", "h:1"], "--node-rank"),
        (["--node-rank", "1", "--peer", "h:1"], "--auth-token-file"),
        (["--node-rank", "1", "--peer", "h", "--insecure-peer"], "--peer"),
        (
            ["--node-rank", "0", "--peer", "h:1", "--nodes", "netns", f"--auth-token-file={token}"],
            "--nodes",
        ),
    ):
        assert main([*base, *extra]) == 2, extra
        assert flag in capsys.readouterr().err, extra
