"""One definition of each serve setting: every flag parser and config that carries a serve
setting starts from `ServeOptions`' default, and `up` passes on every instance flag."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from transfer.cli import build_parser
from transfer.cli.launch_config import LaunchConfig
from transfer.cli.serve import instance_option_names
from transfer.serving.engine.instance import InstanceConfig
from transfer.serving.engine.serve_options import ServeOptions, serve_default, serve_flags
from transfer.serving.launch.local import LocalPairConfig
from transfer.units import parse_size

# Another name for the same setting: the TP of each side, the lease in LocalPairConfig.
ALIASES = {"prefill_tp": "tp", "decode_tp": "tp", "lease_s": "lease_seconds"}
# Defaults that differ on purpose: the token file comes from the environment; `up` serves
# HTTP on a port by default where `serve` serves none.
OWN_DEFAULTS = {("serve", "auth_token_file"), ("up", "http_port")}
# The settings with a default (`role` has none: it is serve's positional argument).
SERVE_FIELDS = {
    f.name for f in dataclasses.fields(ServeOptions) if f.default is not dataclasses.MISSING
}


def subparser(*path: str) -> argparse.ArgumentParser:
    parser = build_parser()
    for name in path:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    return parser


def serve_setting(name: str) -> str | None:
    name = ALIASES.get(name, name)
    return name if name in SERVE_FIELDS else None


@pytest.mark.parametrize("command", [("serve",), ("up",), ("launch",), ("bench", "serve")])
def test_every_command_defaults_a_serve_flag_as_serve_does(command):
    checked = 0
    for action in subparser(*command)._actions:
        setting = serve_setting(action.dest)
        if setting is None or (command[0], action.dest) in OWN_DEFAULTS:
            continue
        expected = serve_default(setting)
        if isinstance(expected, tuple):  # repeated flags: argparse starts from a list
            expected = list(expected)
        assert action.default == expected, f"{' '.join(command)} --{action.dest}"
        checked += 1
    assert checked >= 5  # the parser still carries serve settings (a rename would skip all)


@pytest.mark.parametrize("config_class", [LaunchConfig, LocalPairConfig])
def test_launch_configs_default_as_serve_does(config_class):
    checked = [
        f
        for f in dataclasses.fields(config_class)
        if serve_setting(f.name) and f.default is not dataclasses.MISSING
    ]
    assert len(checked) >= 10
    for field in checked:
        assert field.default == serve_default(serve_setting(field.name)), field.name


def test_instance_config_defaults_as_serve_does():
    """InstanceConfig holds some settings in other units; those are compared converted."""
    converted = {
        "budget_bytes": parse_size(serve_default("gpu_mem"), "gpu_mem"),
        "staging_bytes": serve_default("staging_mib") << 20,
        "min_block_size": serve_default("block_size"),
    }
    fields = {f.name: f.default for f in dataclasses.fields(InstanceConfig)}
    del fields["model"]  # "": the geometry's name, for instances built from a geometry
    checked = 0
    for name, default in fields.items():
        if name in converted:
            expected = converted[name]
        elif serve_setting(name):
            expected = serve_default(name)
        else:
            continue
        assert default == expected, name
        checked += 1
    assert checked >= 15


def test_up_takes_and_passes_every_instance_flag():
    """Each of serve's instance flags is one `up` accepts, and `serve_flags` writes it so that
    serve parses back the same value (`up` forwards them this way)."""
    up_dests = {a.dest for a in subparser("up")._actions}
    names = instance_option_names()
    assert {"staging_mib", "transfer_mode", "max_num_batched_tokens"} <= set(names)
    assert set(names) <= up_dests
    changed = {}
    for name in names:
        default = serve_default(name)
        if isinstance(default, bool):
            changed[name] = not default
        elif name == "transfer_mode":
            changed[name] = "layerwise"
        elif name in ("transport", "device"):
            changed[name] = {"nixl": "ucx", "cpu": "cuda"}[default]
        elif name == "gpu_mem":
            changed[name] = "96MiB"
        else:
            changed[name] = type(default)(default + 3)
    argv = ["serve", "decode", *serve_flags(changed)]
    options = ServeOptions.from_values(vars(build_parser().parse_args(argv)))
    assert {name: getattr(options, name) for name in names} == changed


def test_serve_flags_rejects_a_name_serve_lacks():
    with pytest.raises(KeyError, match="lease_s"):
        serve_flags({"lease_s": 3.0})
