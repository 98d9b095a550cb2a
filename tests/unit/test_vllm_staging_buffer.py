"""Decode's read-side staging buffer (`transfer/vllm/staging_buffer.py`): first-fit holds."""

import numpy as np
import torch

from transfer.vllm.staging_buffer import StagingBuffer


def _buffer(nbytes: int = 100) -> StagingBuffer:
    return StagingBuffer(torch.zeros(nbytes, dtype=torch.uint8), start=4096)


def test_holds_are_first_fit_and_a_freed_gap_is_reused():
    staging = _buffer()
    assert [staging.hold(k, 30) for k in "abc"] == [0, 30, 60]
    assert staging.hold("d", 30) is None  # 10 bytes left: no room, the load reads directly
    staging.free("b")
    assert staging.hold("e", 40) is None  # the gap is 30 wide
    assert staging.hold("f", 20) == 30
    assert staging.hold("g", 10) == 50  # what is left of the gap comes first
    assert staging.hold("h", 10) == 90


def test_free_takes_several_keys_and_ignores_unknown_ones():
    staging = _buffer()
    assert staging.hold("r", 60) == 0
    assert staging.hold("r#digests", 40) == 60
    staging.free("r", "r#digests", "never-held")
    assert staging.hold("s", 100) == 0


def test_read_gives_the_landed_bytes_on_the_host():
    staging = _buffer()
    staging.tensor[10:14] = torch.arange(1, 5, dtype=torch.uint8)
    landed = staging.read(10, 4)
    assert isinstance(landed, np.ndarray) and landed.tolist() == [1, 2, 3, 4]
