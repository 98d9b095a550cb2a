"""Codes, roles and modes are enum members once they enter the program, whatever string
they arrived as; a string that names none is refused, naming its field."""

from __future__ import annotations

import grpc
import pytest

from transfer.cli import build_parser
from transfer.control.errors import ControlError, GrpcCode, status_code_name
from transfer.errors import CapacityError, InvalidInput
from transfer.presets import get_preset
from transfer.serving.engine.instance import InstanceConfig
from transfer.serving.engine.serve_options import ServeOptions
from transfer.serving.ranks.progress import TransferMode
from transfer.serving.role import ServeRole


def test_grpc_codes_are_grpcs_own_names():
    assert [code.value for code in GrpcCode] == [code.name for code in grpc.StatusCode]


def test_a_control_error_carries_its_code_as_a_member():
    error = ControlError("RESOURCE_EXHAUSTED", "full")
    assert error.code is GrpcCode.RESOURCE_EXHAUSTED and str(error) == "RESOURCE_EXHAUSTED: full"
    assert ControlError("NO_SUCH_CODE", "?").code is GrpcCode.UNKNOWN
    assert status_code_name(CapacityError("full")) is GrpcCode.RESOURCE_EXHAUSTED


def test_serve_flags_become_members():
    argv = ["serve", "decode", "--transfer-mode", "layerwise"]
    options = ServeOptions.from_values(vars(build_parser().parse_args(argv)))
    assert options.role is ServeRole.DECODE
    assert options.transfer_mode is TransferMode.LAYERWISE


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: ServeOptions(role="cache"), "role"),
        (lambda: ServeOptions(role="prefill", transfer_mode="streamed"), "transfer_mode"),
        (lambda: InstanceConfig("router", get_preset("tiny-qwen3-next")), "role"),
        (
            lambda: InstanceConfig("decode", get_preset("tiny-qwen3-next"), transfer_mode="x"),
            "transfer_mode",
        ),
    ],
)
def test_a_string_that_names_no_member_is_refused(make, field):
    with pytest.raises(InvalidInput, match=f"^{field}: must be"):
        make()


def test_instance_config_holds_members():
    config = InstanceConfig("prefill", get_preset("tiny-qwen3-next"), transfer_mode="layerwise")
    assert config.role is ServeRole.PREFILL and config.transfer_mode is TransferMode.LAYERWISE
