"""UCX settings as the test session started, for worker processes started by tests.

Importing ucxx rewrites some UCX_* variables in os.environ, and processes started afterwards
inherit them; tests/conftest.py imports this module first, so the snapshot is pristine.
"""

from __future__ import annotations

import contextlib
import os

PRISTINE_UCX_ENV = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}


@contextlib.contextmanager
def pristine_ucx_env(**overrides: str):
    """os.environ's UCX_* variables as the session started (plus `overrides`) inside the block,
    so that worker processes started there see what a fresh `pdxfer serve` would."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
    for key in saved:
        del os.environ[key]
    os.environ.update(PRISTINE_UCX_ENV, **overrides)
    try:
        yield
    finally:
        for key in [k for k in os.environ if k.startswith("UCX_")]:
            del os.environ[key]
        os.environ.update(saved)
