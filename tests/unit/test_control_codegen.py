"""The committed generated code matches proto/pdxfer/v1, and the control plane keeps its layering."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from transfer.control import codegen

CONTROL = Path(codegen.__file__).parent
# the gRPC edge: servicers, clients and conversions (decode_many and decode_mux are the
# servicer and client halves of DecodeMany)
GEN_ALLOWED = {
    "convert.py",
    "service.py",
    "server.py",
    "aio_server.py",
    "client.py",
    "decode_many.py",
    "decode_mux.py",
}
FORBIDDEN = (
    "transfer.dataplane",
    "transfer.packer",
    "transfer.cache",
    "transfer.model",
    "transfer.cli",
    "torch",
)


def test_committed_code_matches_protos():
    result = subprocess.run(
        [sys.executable, "-m", "transfer.control.codegen", "--check"],
        cwd=codegen.ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr


@pytest.fixture
def gen_copy(tmp_path):
    """Code from this environment's protoc: the check compares it byte for byte (the
    committed code may come from another grpcio-tools, which the check compares by
    payload, `test_another_generator_is_compared_by_descriptor_and_methods`)."""
    copy = tmp_path / "gen"
    codegen.generate(copy)
    return copy


@pytest.fixture
def committed_copy(tmp_path):
    copy = tmp_path / "committed"
    shutil.copytree(codegen.GEN_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def test_check_reports_edited_missing_and_stale_files(gen_copy):
    assert codegen.check(gen_copy) == []
    path = gen_copy / "worker_pb2_grpc.py"
    path.write_text(
        path.read_text().replace(
            "/pdxfer.v1.DecodeService/Decode", "/pdxfer.v1.DecodeService/Decod"
        )
    )
    (gen_copy / "transfer_pb2.pyi").unlink()
    (gen_copy / "old_pb2.py").write_text("")
    assert codegen.check(gen_copy) == [
        "transfer_pb2.pyi: missing",
        "old_pb2.py: not generated from any .proto",
        "worker_pb2_grpc.py: differs from a fresh protoc run",
    ]


def test_check_across_generator_versions_compares_descriptors(gen_copy):
    path = gen_copy / "transfer_pb2.py"
    text = path.read_text()
    restamped = text.replace("# Protobuf Python Version: ", "# Protobuf Python Version: 0.")
    assert restamped != text
    path.write_text(restamped)
    assert codegen.check(gen_copy) == []  # another generator, same contract
    path.write_text(restamped.replace("lease_deadline", "lease_deadlinx"))
    assert codegen.check(gen_copy) == [
        "transfer_pb2.py: descriptor or service methods differ from the .proto files"
    ]


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("path", sorted(CONTROL.glob("*.py")), ids=lambda p: p.name)
def test_control_layering(path):
    imports = _imports(path)
    assert not [m for m in imports if m.startswith(FORBIDDEN)], (
        f"{path.name} imports a higher layer"
    )
    if path.name not in GEN_ALLOWED:
        assert not [m for m in imports if m.startswith("transfer.control.gen")], (
            f"{path.name} imports generated code"
        )


def test_another_generator_is_compared_by_descriptor_and_methods(committed_copy):
    """Code from another grpcio-tools release (its version stamps differ) passes while it
    says what the .proto files say, and fails once a method path differs."""
    path = committed_copy / "worker_pb2_grpc.py"
    text = path.read_text()
    stamped = text.replace("GRPC_GENERATED_VERSION = '", "GRPC_GENERATED_VERSION = '0.")
    assert stamped != text
    path.write_text(stamped)
    assert codegen.check(committed_copy) == []
    path.write_text(
        stamped.replace("/pdxfer.v1.DecodeService/Decode", "/pdxfer.v1.DecodeService/Decod")
    )
    assert codegen.check(committed_copy) == [
        "worker_pb2_grpc.py: descriptor or service methods differ from the .proto files"
    ]
