"""Lower layers never import higher ones (docs/architecture.md)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# package (a folder or module under the repo root) -> modules it must never import
FORBIDDEN = {
    "kernels": ("transfer",),
    "transfer/geometry.py": ("transfer.cache", "transfer.packer", "transfer.dataplane",
                             "transfer.control", "transfer.engine", "transfer.cli"),
    "transfer/sizing.py": ("transfer.cache", "transfer.packer", "transfer.dataplane",
                           "transfer.control", "transfer.engine", "transfer.cli"),
    "transfer/memplan.py": ("transfer.cache", "transfer.packer", "transfer.dataplane",
                            "transfer.control", "transfer.engine", "transfer.cli"),
    "transfer/cache": ("transfer.packer", "transfer.dataplane", "transfer.control",
                       "transfer.engine", "transfer.cli"),
    "transfer/packer": ("transfer.dataplane", "transfer.control", "transfer.engine", "transfer.cli"),
    "transfer/dataplane": ("transfer.geometry", "transfer.presets", "transfer.cache",
                           "transfer.packer", "transfer.control", "transfer.engine", "transfer.cli"),
    "transfer/control": ("transfer.geometry", "transfer.presets", "transfer.cache",
                         "transfer.packer", "transfer.dataplane", "transfer.engine", "transfer.cli"),
    "transfer/engine": ("transfer.cli",),
}  # fmt: skip


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_upward_imports(package):
    target = ROOT / package
    files = [target] if target.suffix == ".py" else sorted(target.rglob("*.py"))
    assert files, f"{package} has no Python files"
    violations = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in files
        for name in imported_modules(path)
        if any(name == bad or name.startswith(bad + ".") for bad in FORBIDDEN[package])
    ]
    assert not violations, "\n".join(violations)
