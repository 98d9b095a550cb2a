"""Session-wide test setup."""

# Snapshot the UCX_* variables before any test imports ucxx (see tests/support/ucx_env.py).
import tests.support.ucx_env  # noqa: F401
