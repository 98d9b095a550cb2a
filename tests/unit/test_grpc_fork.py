"""Importing `transfer` turns gRPC fork support off before grpc reads it, unless the user set it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_PROBE = "import transfer, grpc, os; print(os.environ['GRPC_ENABLE_FORK_SUPPORT'])"


@pytest.mark.parametrize(("given", "expected"), [(None, "0"), ("1", "1")])
def test_fork_support_default_and_override(given, expected):
    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    if given is not None:
        env["GRPC_ENABLE_FORK_SUPPORT"] = given
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == expected


def test_grpc_not_imported_before_transfer_sets_it():
    # The variable only counts if it is set before the first `import grpc`.
    probe = "import sys, transfer; print('grpc' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr
