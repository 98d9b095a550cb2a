"""The code stays ruff-clean (format and lint), as `make lint` checks."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "argv",
    [["format", "--check", "transfer", "kernels", "tests"], ["check", "."]],
    ids=["format", "check"],
)
def test_ruff(argv):
    result = subprocess.run(
        [sys.executable, "-m", "ruff", *argv], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
