"""kv_connector_extra_config parses into PdxferConfig; every bad field is named."""

import dataclasses

import pytest

from transfer.errors import InvalidInput
from transfer.vllm.config import PdxferConfig, TransportKind


def test_bare_config_works_on_one_machine():
    config = PdxferConfig.from_extra_config(None)
    assert config == PdxferConfig.from_extra_config({})
    assert config.control_host == "127.0.0.1"
    assert config.control_port == 0  # a free port, advertised once bound
    assert config.transport is TransportKind.NIXL
    assert config.auth_token is None
    assert config.heartbeat_s == config.lease_s / 3
    assert config.control_timeout_s == 10.0


def test_every_setting_parses(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    config = PdxferConfig.from_extra_config(
        {
            "transport": "ucx",
            "auth_token_file": str(token_file),
            "control_host": "10.0.0.7",
            "control_port": 7100,
            "lease_s": 5,
            "control_timeout_s": 30,
            "verify": True,
        }
    )
    assert config == PdxferConfig(
        transport=TransportKind.UCX,
        auth_token="s3cret",
        control_host="10.0.0.7",
        control_port=7100,
        lease_s=5.0,
        control_timeout_s=30.0,
        verify=True,
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.lease_s = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("transport", "rdma"),
        ("control_host", ""),
        ("control_host", "a b"),
        ("control_port", 70000),
        ("control_port", True),
        ("control_port", "7100"),
        ("lease_s", 0),
        ("lease_s", float("nan")),
        ("lease_s", False),
        ("control_timeout_s", 0),
        ("control_timeout_s", -1.5),
        ("control_timeout_s", float("inf")),
        ("control_timeout_s", True),
        ("control_timeout_s", "30"),
        ("verify", "yes"),
        ("verify", 1),
        ("auth_token_file", 3),
        ("lease", 30),
    ],
)
def test_bad_field_is_named(field, value):
    with pytest.raises(InvalidInput, match=rf"kv_connector_extra_config\.{field}:"):
        PdxferConfig.from_extra_config({field: value})


def test_token_file_must_exist_and_hold_one_token(tmp_path):
    with pytest.raises(InvalidInput, match=r"auth_token_file: cannot read"):
        PdxferConfig.from_extra_config({"auth_token_file": str(tmp_path / "missing")})
    (tmp_path / "empty").write_text("  \n")
    with pytest.raises(InvalidInput, match=r"auth_token_file: .* one non-empty token"):
        PdxferConfig.from_extra_config({"auth_token_file": str(tmp_path / "empty")})


def test_not_an_object():
    with pytest.raises(InvalidInput, match=r"^kv_connector_extra_config: not an object"):
        PdxferConfig.from_extra_config(["transport"])  # type: ignore[arg-type]
