"""The connector's one fault-injection setting (for tests): off by default, a path when set,
and refused, naming the field, when it is not one."""

import pytest

from transfer.errors import InvalidInput
from transfer.vllm.config import PdxferConfig


def test_hold_loads_file_is_off_by_default_and_a_path_when_set(tmp_path):
    assert PdxferConfig.from_extra_config(None).test_hold_loads_file is None
    hold = str(tmp_path / "hold")
    config = PdxferConfig.from_extra_config({"test_hold_loads_file": hold})
    assert config.test_hold_loads_file == hold


@pytest.mark.parametrize("value", ["", 3, None, ["a"]])
def test_hold_loads_file_that_is_not_a_path_is_refused(value):
    with pytest.raises(InvalidInput, match=r"kv_connector_extra_config\.test_hold_loads_file"):
        PdxferConfig.from_extra_config({"test_hold_loads_file": value})
