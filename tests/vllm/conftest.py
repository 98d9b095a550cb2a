"""Fixtures for the tests that run real vLLM (with the `.venv-vllm` interpreter: `make test`
runs `.venv-vllm/bin/python -m pytest tests/vllm`): tiny bf16 checkpoints, written once per
session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.vllm.checkpoints import write_vllm_checkpoint


@pytest.fixture(scope="session")
def vllm_checkpoint(tmp_path_factory):
    """`vllm_checkpoint(name)`: the directory of tiny checkpoint `name` (a key of
    `VLLM_TINY_CONFIGS`), written on first use in this session."""
    root = tmp_path_factory.mktemp("vllm-checkpoints")
    written: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in written:
            written[name] = write_vllm_checkpoint(name, root / name)
        return written[name]

    return get


@pytest.fixture(scope="session")
def qwen3_next_checkpoint(vllm_checkpoint) -> Path:
    return vllm_checkpoint("qwen3-next")
