"""Flags of the commands that start vLLM servers on this machine (`up --engine vllm`,
`bench vllm`): which interpreter has vLLM, which KV connector, how big each server is."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

from transfer.errors import InvalidInput
from transfer.serving.launch.vllm_servers import (
    DEFAULT_KV_CACHE_BYTES,
    DEFAULT_MAX_MODEL_LEN,
    Connector,
)
from transfer.units import parse_size

# `make setup-vllm` builds it: vLLM pins transformers and fastapi below pdxfer's main venv.
VLLM_VENV_PYTHON = Path(".venv-vllm/bin/python")


def add_vllm_server_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("vLLM servers")
    group.add_argument(
        "--vllm-python",
        metavar="PATH",
        default=None,
        help="the Python interpreter that has vLLM (default: this one if it imports vllm, "
        f"else {VLLM_VENV_PYTHON} under the current directory)",
    )
    group.add_argument(
        "--vllm-kv-cache",
        default=f"{DEFAULT_KV_CACHE_BYTES >> 20}MiB",
        metavar="SIZE",
        help="KV cache bytes of each vLLM server (vLLM's --kv-cache-memory-bytes; default "
        f"{DEFAULT_KV_CACHE_BYTES >> 20}MiB)",
    )
    group.add_argument(
        "--vllm-max-model-len",
        type=int,
        default=DEFAULT_MAX_MODEL_LEN,
        metavar="N",
        help=f"longest prompt + output each vLLM server accepts (default {DEFAULT_MAX_MODEL_LEN})",
    )


def add_connector_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--connector",
        choices=[c.value for c in Connector],
        default=Connector.PDXFER.value,
        help="the KV connector both vLLM servers load: pdxfer (PdxferConnector, default) or "
        "nixl (vLLM's NixlConnector, the baseline)",
    )


def vllm_python(value: str | None) -> str:
    """The interpreter that runs vLLM; InvalidInput naming --vllm-python when there is none."""
    if value is not None:
        if not (os.path.isfile(value) and os.access(value, os.X_OK)):
            raise InvalidInput(f"--vllm-python: {value!r} is not an executable file")
        return value
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    if VLLM_VENV_PYTHON.is_file():
        return str(VLLM_VENV_PYTHON.absolute())
    raise InvalidInput(
        f"--vllm-python: this interpreter has no vllm and {VLLM_VENV_PYTHON} does not exist "
        "(make setup-vllm builds it); name an interpreter that has vLLM"
    )


def vllm_model_dir(model: str) -> Path:
    """vLLM serves checkpoint directories only (pdxfer's presets have no files)."""
    path = Path(model)
    if not (path / "config.json").is_file():
        raise InvalidInput(
            f"--model: vLLM serves a checkpoint directory with config.json; {model!r} is not one"
        )
    return path.absolute()


def kv_cache_bytes(text: str) -> int:
    return parse_size(text, "--vllm-kv-cache")
