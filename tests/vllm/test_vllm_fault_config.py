"""The connector's one fault-injection setting (for tests): off by default, a path when set,
and refused, naming the field, when it is not one; the hold it makes in decode's worker."""

import threading
import time

import pytest

from transfer.errors import InvalidInput
from transfer.vllm.config import PdxferConfig
from transfer.vllm.fault import hold_loads

WAIT_S = 20.0


def test_hold_loads_file_is_off_by_default_and_a_path_when_set(tmp_path):
    assert PdxferConfig.from_extra_config(None).test_hold_loads_file is None
    hold = str(tmp_path / "hold")
    config = PdxferConfig.from_extra_config({"test_hold_loads_file": hold})
    assert config.test_hold_loads_file == hold


@pytest.mark.parametrize("value", ["", 3, None, ["a"]])
def test_hold_loads_file_that_is_not_a_path_is_refused(value):
    with pytest.raises(InvalidInput, match=r"kv_connector_extra_config\.test_hold_loads_file"):
        PdxferConfig.from_extra_config({"test_hold_loads_file": value})


def test_no_hold_file_holds_nothing(tmp_path):
    hold = tmp_path / "hold"
    hold_loads(hold, ["r1"])  # returns at once
    assert not hold.with_name("hold.held").exists()


def test_a_hold_file_holds_the_loads_until_it_is_removed(tmp_path):
    hold, held = tmp_path / "hold", tmp_path / "hold.held"
    hold.touch()
    worker = threading.Thread(target=hold_loads, args=(hold, ["r1", "r2"]), daemon=True)
    worker.start()
    deadline = time.monotonic() + WAIT_S
    while not held.exists():
        assert time.monotonic() < deadline, "the hold never says it holds"
        time.sleep(0.01)
    assert worker.is_alive()  # held: the file is still there
    assert held.read_text().split() == ["r1", "r2"]
    hold.unlink()
    worker.join(WAIT_S)
    assert not worker.is_alive()
