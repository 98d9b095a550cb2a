"""Backend dispatch: the env var forces a backend, CPU tensors default to torch."""

from __future__ import annotations

import pytest
import torch

import kernels.conv1d.triton
import kernels.pack.triton
from kernels.backend import ENV_VAR, use_triton
from kernels.conv1d import causal_conv1d, causal_conv1d_update
from kernels.pack import gather_blocks, gather_ranges


@pytest.fixture
def triton_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the Triton launchers the public ops call (each still runs for real)."""
    calls: list[str] = []
    for module, name in [
        (kernels.conv1d.triton, "causal_conv1d_triton"),
        (kernels.conv1d.triton, "causal_conv1d_update_triton"),
        (kernels.pack.triton, "copy_ranges_triton"),
        (kernels.pack.triton, "copy_blocks_triton"),
    ]:
        launcher = getattr(module, name)

        def record(*args, _launcher=launcher, _name=name, **kwargs):
            calls.append(_name)
            return _launcher(*args, **kwargs)

        monkeypatch.setattr(module, name, record)
    return calls


def _run_every_op() -> None:
    x, weight = torch.randn(1, 6, 8), torch.randn(8, 4)
    causal_conv1d(x, weight)
    causal_conv1d_update(x[:, 0], torch.randn(1, 8, 3), weight)
    gather_ranges(torch.arange(64, dtype=torch.uint8), torch.tensor([3]), torch.tensor([9]))
    gather_blocks(torch.randn(4, 2, 2, 8), torch.tensor([1, 3]))


def test_cpu_tensors_default_to_torch(backend, triton_calls):
    tensor = torch.randn(3)
    assert not use_triton(tensor, None)
    _run_every_op()
    assert triton_calls == []


@pytest.mark.kernels
def test_env_var_forces_triton_on_cpu(backend, triton_calls):
    backend("triton")
    assert use_triton(torch.randn(3))
    _run_every_op()
    assert triton_calls == [
        "causal_conv1d_triton",
        "causal_conv1d_update_triton",
        "copy_ranges_triton",
        "copy_blocks_triton",
    ]


def test_env_var_forces_torch(backend, triton_calls):
    backend(" Torch ")
    assert not use_triton(torch.randn(3))
    _run_every_op()
    assert triton_calls == []


def test_invalid_env_value_is_rejected(backend):
    backend("cuda")
    with pytest.raises(ValueError, match=ENV_VAR):
        use_triton(torch.randn(3))
    with pytest.raises(ValueError, match=ENV_VAR):
        causal_conv1d(torch.randn(1, 6, 8), torch.randn(8, 4))
    with pytest.raises(ValueError, match=ENV_VAR):
        gather_blocks(torch.randn(4, 2, 2, 8), torch.tensor([1]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_default_to_triton(backend):
    assert use_triton(None, torch.randn(3, device="cuda"))


def test_package_exports_the_public_ops():
    import kernels
    import kernels.backend
    import kernels.conv1d
    import kernels.pack

    assert kernels.causal_conv1d is kernels.conv1d.causal_conv1d
    assert kernels.causal_conv1d_update is kernels.conv1d.causal_conv1d_update
    for name in ("gather_ranges", "scatter_ranges", "gather_blocks", "scatter_blocks"):
        assert getattr(kernels, name) is getattr(kernels.pack, name)
    assert kernels.use_triton is kernels.backend.use_triton
    assert {"chunk_gdn", "recurrent_gdn", "chunk_kda", "recurrent_kda"} <= set(kernels.__all__)
    with pytest.raises(AttributeError, match="no_such_op"):
        _ = kernels.no_such_op
