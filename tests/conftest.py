"""Session-wide test setup."""

import atexit
import importlib.util
import os
import shutil
import tempfile

# Snapshot the UCX_* variables before any test imports ucxx (see tests/support/ucx_env.py).
import tests.support.ucx_env  # noqa: F401

# Before any test module imports grpc: `transfer` turns gRPC fork support off.
import transfer  # noqa: F401

# Tiny presets write their checkpoints once per cache directory: give the session its own
# (worker processes inherit it), so no test reads or leaves files in the home directory.
if "PDXFER_CACHE" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="pdxfer-test-cache-")
    os.environ["PDXFER_CACHE"] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)

# tests/vllm need vLLM, which lives in a second venv (`make test` runs them with its
# interpreter); any other interpreter does not collect them.
collect_ignore = [] if importlib.util.find_spec("vllm") else ["vllm"]
