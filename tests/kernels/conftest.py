"""Kernel tests run the Triton kernels on the CPU through the Triton interpreter.

TRITON_INTERPRET must be set before any kernel module applies @triton.jit; the public
ops import their Triton launchers only when they dispatch to them, so setting it here,
at conftest import, is early enough even if other tests imported `kernels` first.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels.backend import ENV_VAR  # noqa: E402

SEED_VAR = "PDXFER_TEST_SEED"
DEFAULT_SEED = 20250101


def seed_from_env() -> int:
    """The seed every kernel test starts from: PDXFER_TEST_SEED, else DEFAULT_SEED."""
    value = os.environ.get(SEED_VAR, "").strip()
    if not value:
        return DEFAULT_SEED
    try:
        return int(value)
    except ValueError:
        raise pytest.UsageError(f"{SEED_VAR}={value!r}: expected an integer") from None


def pytest_report_header(config: pytest.Config) -> str:
    return f"kernel tests: {SEED_VAR}={seed_from_env()} (set it to draw other random inputs)"


@pytest.fixture(autouse=True)
def seeded() -> int:
    """Every test draws its random inputs from the same seed, so a run can be repeated; another
    PDXFER_TEST_SEED draws other inputs. The seed is printed with a failing test's output."""
    seed = seed_from_env()
    print(f"{SEED_VAR}={seed}")
    torch.manual_seed(seed)
    return seed


@pytest.fixture
def one_torch_thread():
    """Tiny shapes gain nothing from threads, and on a shared 2-core box they thrash (40x)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def backend(monkeypatch: pytest.MonkeyPatch):
    """backend("torch" | "triton") forces the dispatch until the test ends."""
    monkeypatch.delenv(ENV_VAR, raising=False)

    def force(name: str) -> None:
        monkeypatch.setenv(ENV_VAR, name)

    return force


@pytest.fixture
def rel_err():
    """‖out − ref‖ / ‖ref‖ in fp32; inf when out is not finite, so NaN never passes."""

    def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
        out, ref = out.float(), ref.float()
        assert out.shape == ref.shape, f"shape {tuple(out.shape)} != {tuple(ref.shape)}"
        assert ref.norm() > 0, "reference is all zeros: the comparison would prove nothing"
        if not torch.isfinite(out).all():
            return float("inf")
        return ((out - ref).norm() / ref.norm()).item()

    return rel_err


_COMPILE = """
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

ptx = []
for module, name, signature, constexprs, aligned in json.load(sys.stdin):
    kernel = getattr(importlib.import_module(module), name)
    names = list(signature)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    source = ASTSource(kernel, signature, constexprs, attrs)
    ptx.append(triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"])
json.dump(ptx, sys.stdout)
"""


@pytest.fixture
def compile_sm90():
    """compile(jobs) -> PTX per job, compiled for an H100/H200 (sm_90) without a GPU.

    The interpreter runs kernels as Python and never type-checks them as the compiler
    does, so they are compiled too, in a subprocess (this one is interpreting). A job is
    (module, kernel name, signature, constexprs, aligned): `aligned` names arguments a
    real launch sees 16-byte aligned (pointers) or divisible by 16 (ints).
    """

    def compile_(jobs: list[tuple]) -> list[str]:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        done = subprocess.run(
            [sys.executable, "-c", _COMPILE],
            input=json.dumps(jobs),
            capture_output=True,
            text=True,
            env=env,
            cwd=root,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-4000:]
        return json.loads(done.stdout)

    return compile_
