"""Worker configuration without processes: block sizes both sides agree on, serve flags,
router addresses, and the launch summary."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from transfer.cli import build_parser, main
from transfer.cli.launch_report import format_table, summarize
from transfer.cli.launch_run import Outcome
from transfer.presets import get_preset
from transfer.serving.addresses import join_address, resolve, split_address
from transfer.serving.engine.instance import InstanceConfig, plan_for
from transfer.serving.engine.serve_options import ANY_PORT, ServeOptions
from transfer.serving.openai.router import Router
from transfer.serving.services.instance_config import instance_config
from transfer.serving.services.interfaces import interface_of
from transfer.serving.services.serve_security import auth_token, check_exposure, tls_configs


@pytest.mark.parametrize("model", ["tiny-qwen3-next", "tiny-kimi-linear", "tiny-nemotron-h"])
def test_every_tp_plans_the_same_block_size(model):
    """A prefill and a decode instance of any TP can hand over: same block size."""
    geometry = get_preset(model)
    plans = [
        plan_for(
            InstanceConfig(
                role, geometry, tp, budget_bytes=64 << 20, max_seqs=4, prefix_cache=False
            )
        )
        for role in ("prefill", "decode")
        for tp in geometry.valid_tps()
    ]
    assert len({p.block_size for p in plans}) == 1
    assert all(p.num_kv_blocks > 0 and p.num_state_slots == 4 for p in plans)


def test_instance_config_rejects_bad_tp_and_multinode_without_rendezvous():
    geometry = get_preset("tiny-kimi-linear")
    with pytest.raises(ValueError, match="tp=3 does not divide"):
        InstanceConfig("decode", geometry, 3)
    with pytest.raises(ValueError, match="dist_addr"):
        InstanceConfig("decode", geometry, 2, nnodes=2)
    with pytest.raises(ValueError, match="nnodes: 4 must divide tp 2"):
        InstanceConfig("decode", geometry, 2, nnodes=4, dist_addr="10.0.0.1:29500")


def serve_args(*argv: str) -> ServeOptions:
    """The typed options the CLI hands to `serve` for these flags."""
    return ServeOptions.from_values(vars(build_parser().parse_args(["serve", *argv])))


def test_serve_flags_reach_the_instance(tmp_path):
    args = serve_args(
        "decode", "--model", "tiny-kimi-linear", "--tp", "2", "--gpu-mem", "32MiB",
        "--max-seqs", "3", "--block-size", "32", "--seed", "7", "--transport", "ucx",
        "--nnodes", "2", "--node-rank", "1", "--dist-addr", "10.1.2.3:29500",
        "--data-host", "127.0.0.1", "--dump-dir", str(tmp_path),
    )  # fmt: skip
    config = instance_config(args)
    assert (config.tp, config.budget_bytes, config.max_seqs, config.min_block_size) == (
        2,
        32 << 20,
        3,
        32,
    )
    assert (config.seed, config.transport, config.dump_dir) == (7, "ucx", str(tmp_path))
    assert (config.nnodes, config.node_rank, config.dist_addr) == (2, 1, "10.1.2.3:29500")
    assert config.net_device == "lo" and not config.is_leader


def test_auth_token_from_file_then_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("PDXFER_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("PDXFER_AUTH_TOKEN_FILE", raising=False)
    assert auth_token(serve_args("router")) is None
    monkeypatch.setenv("PDXFER_AUTH_TOKEN", "from-env")
    assert auth_token(serve_args("router")) == "from-env"
    (tmp_path / "t").write_text("from-file\n")
    assert auth_token(serve_args("router", "--auth-token-file", str(tmp_path / "t"))) == "from-file"
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        auth_token(serve_args("router", "--auth-token-file", str(tmp_path / "empty")))


def test_tls_flags_come_in_pairs():
    with pytest.raises(ValueError, match="--tls-cert and --tls-key"):
        tls_configs(serve_args("router", "--tls-cert", "c.pem"))
    assert tls_configs(serve_args("router")) == (None, None)


def test_interface_lookup():
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("0.0.0.0") is None
    with pytest.raises(ValueError, match="no local interface"):
        interface_of("192.0.2.77")  # TEST-NET-1, never configured


@pytest.mark.parametrize(
    ("flags", "named"),
    [(["--host", "192.0.2.77"], "--host"), (["--data-host", "192.0.2.77"], "--data-host")],
)
def test_an_address_no_interface_holds_names_the_flag_it_came_from(flags, named):
    with pytest.raises(ValueError, match=f"^{named}: no local interface"):
        instance_config(serve_args("prefill", "--model", "tiny-qwen3-next", *flags))


def test_router_addresses():
    assert split_address("[::1]:50051") == ("::1", 50051)
    assert join_address("::1", 5) == "[::1]:5" and join_address("10.0.0.1", 5) == "10.0.0.1:5"
    for bad in ("nohost", "host:", "host:0", "host:99999", ":80"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            split_address(bad)
    assert resolve("127.0.0.1:7") == ["127.0.0.1:7"]
    assert "127.0.0.1:7" in resolve("localhost:7")
    with pytest.raises(ValueError, match="--prefill"):
        Router([], ["127.0.0.1:1"])
    with pytest.raises(ValueError, match="--decode"):
        Router(["127.0.0.1:1"], [])


def test_summary_percentiles_and_table():
    args = argparse.Namespace(
        model="tiny-qwen3-next", hf_config=None, transport="nixl", prefill_tp=2, decode_tp=1,
        verify=True, prompt_len=8, max_tokens=2, transfer_mode="layerwise", ignore_eos=False,
    )  # fmt: skip
    outcomes = [
        Outcome(f"req-{i}", [1], tokens=[3, 4], ttft_ms=10.0 * (i + 1), transfer_ms=1.0 * (i + 1),
                exposed_transfer_ms=0.5 * (i + 1), kv_bytes=100, state_bytes=50, descriptors=3,
                wall_s=0.5)
        for i in range(3)
    ]  # fmt: skip
    outcomes.append(Outcome("req-bad", [1], error="UNAVAILABLE: boom", wall_s=1.0))
    outcomes[1].problems.append("tokens differ")
    summary = summarize(outcomes, args)
    assert summary["ttft_ms"] == {"p50": 20.0, "p99": 29.8}
    assert summary["transfer_ms"] == {"p50": 2.0, "p99": 2.98}
    assert summary["exposed_transfer_ms"] == {"p50": 1.0, "p99": 1.49}
    assert summary["per_request"][2]["exposed_transfer_ms"] == 1.5
    assert (summary["requests"], summary["verified"], summary["failed"]) == (4, 2, 2)
    assert (summary["kv_bytes"], summary["state_bytes"], summary["descriptors"]) == (300, 150, 9)
    table = format_table(outcomes, summary)
    assert "req-1" in table and "FAIL" in table and "ERROR" in table
    assert "exposed p50 1.00 ms (layerwise)" in table
    assert "req-bad: UNAVAILABLE: boom" in table and "req-1: tokens differ" in table


def test_the_data_plane_binds_the_host_unless_told_otherwise():
    """Without --data-host, UCX listened on every interface; now it is held to --host's."""
    config = instance_config(serve_args("prefill", "--host", "127.0.0.1", "--max-queue", "5"))
    assert config.net_device == "lo" and config.max_queue == 5
    assert instance_config(serve_args("prefill", "--host", "0.0.0.0")).net_device is None


def test_a_non_loopback_server_needs_a_token_or_mtls_unless_insecure():
    exposed = serve_args("prefill", "--host", "0.0.0.0")
    with pytest.raises(ValueError, match="--host 0.0.0.0: serving a non-loopback address"):
        check_exposure(exposed, None, None)
    check_exposure(exposed, "a-token", None)
    check_exposure(serve_args("prefill", "--host", "0.0.0.0", "--insecure"), None, None)
    check_exposure(serve_args("prefill", "--host", "127.0.0.1"), None, None)
    with pytest.raises(ValueError, match="non-loopback"):  # the data plane counts too
        check_exposure(serve_args("prefill", "--data-host", "0.0.0.0"), None, None)


def test_a_non_loopback_http_api_needs_an_api_key_unless_insecure(tmp_path, monkeypatch, capsys):
    """The HTTP API follows gRPC's rule. Each run below names a model that does not exist:
    the exposure check must refuse first, before anything is loaded or bound."""
    monkeypatch.delenv("PDXFER_API_KEY", raising=False)
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "PDXFER_AUTH_TOKEN": "t"}
    env.pop("PDXFER_API_KEY", None)
    router = [sys.executable, "-c", "import sys; from transfer.cli import main; sys.exit(main())",
              "serve", "router", "--host", "0.0.0.0",
              "--port", "0", "--metrics-port", "0", "--http-port", "0", "--model", "no-such",
              "--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2"]  # fmt: skip
    done = subprocess.run(router, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--host 0.0.0.0: serving the HTTP API on a non-loopback address" in done.stderr
    assert main(["up", "--host", "0.0.0.0", "--model", "no-such"]) == 2
    assert "needs --api-key-file" in capsys.readouterr().err
    key = tmp_path / "key"
    key.write_text("k")
    for extra in (["--insecure"], ["--api-key-file", str(key)]):
        assert main(["up", "--host", "0.0.0.0", "--model", "no-such", *extra]) == 2
        assert "HTTP API" not in capsys.readouterr().err  # past the check: the model is refused


def test_every_serve_flag_is_a_serve_option():
    """A flag added to `pdxfer serve` without its ServeOptions field would be dropped."""
    from dataclasses import fields

    parsed = vars(build_parser().parse_args(["serve", "router"]))
    flags = set(parsed) - {"command", "func"}
    assert flags == {f.name for f in fields(ServeOptions)}
    options = ServeOptions.from_values(parsed)
    assert options.prefill == () and options.role == "router"


def test_metrics_port_takes_a_port_off_or_any(capsys):
    """`--metrics-port any` leaves the choice to the OS (the process names it on its READY
    line); anything but a port or `any` is refused, naming the flag."""
    assert serve_args("decode", "--metrics-port", "any").metrics_port == ANY_PORT
    assert serve_args("decode", "--metrics-port", "0").metrics_port == 0
    assert serve_args("decode", "--metrics-port", "9500").metrics_port == 9500
    for bad in ("70000", "-1", "anywhere"):
        with pytest.raises(SystemExit):
            serve_args("decode", "--metrics-port", bad)
        assert "--metrics-port" in capsys.readouterr().err
