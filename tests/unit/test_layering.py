"""Lower layers never import higher ones (docs/architecture.md)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# package (a folder or module under the repo root) -> modules it must never import
# The layers from the ground up (docs/architecture.md); each may import only those before it.
LAYERS = [
    ("transfer/geometry.py", "transfer.geometry"),
    ("transfer/hf_geometry.py", "transfer.hf_geometry"),
    ("transfer/presets.py", "transfer.presets"),
    ("transfer/sizing.py", "transfer.sizing"),
    ("transfer/memplan.py", "transfer.memplan"),
    ("transfer/cache", "transfer.cache"),
    ("transfer/packer", "transfer.packer"),
    ("transfer/agent", "transfer.agent"),
    ("transfer/model", "transfer.model"),
    ("transfer/serving", "transfer.serving"),
    ("transfer/vllm", "transfer.vllm"),
    ("transfer/bench", "transfer.bench"),
    ("transfer/cli", "transfer.cli"),
]
ABOVE = {path: tuple(m for _, m in LAYERS[i + 1 :]) for i, (path, _) in enumerate(LAYERS)}

# package (a folder or module under the repo root) -> modules it must never import
FORBIDDEN = {
    **ABOVE,
    "kernels": ("transfer",),
    "transfer/trace.py": ("transfer",),  # any layer marks points: it stands on nothing
    # Dataplane and control know byte ranges and opaque metadata only: no geometry, no
    # cache, no packer, and neither imports the other.
    "transfer/dataplane": ("transfer.geometry", "transfer.hf_geometry", "transfer.presets", "transfer.cache",
                           "transfer.packer", "transfer.agent", "transfer.control", "transfer.model",
                           "transfer.serving", "transfer.bench", "transfer.cli"),
    "transfer/control": ("transfer.geometry", "transfer.hf_geometry", "transfer.presets", "transfer.cache",
                         "transfer.packer", "transfer.agent", "transfer.dataplane", "transfer.model",
                         "transfer.serving", "transfer.bench", "transfer.cli", "torch"),
    # The model computes; it never talks to peers.
    "transfer/model": ABOVE["transfer/model"] + ("transfer.control", "transfer.dataplane"),
    # The connector runs inside vLLM: it never pulls in pdxfer's own engine.
    "transfer/vllm": ABOVE["transfer/vllm"] + ("transfer.serving",),
}  # fmt: skip


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            # `from package import module` imports the module too
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
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


# transfer/serving/'s own layers, read from its docstring's "Layers, from the ground up:" line
SERVING = ROOT / "transfer" / "serving"


def serving_layers() -> list[str]:
    doc = ast.get_docstring(ast.parse((SERVING / "__init__.py").read_text())) or ""
    lines = [line for line in doc.splitlines() if line.startswith("Layers, from the ground up:")]
    assert len(lines) == 1, "transfer/serving/__init__.py must state its layers on one line"
    return [name.strip() for name in lines[0].split(":", 1)[1].split("<")]


def serving_layer_of(module: str) -> str:
    """The serving layer of a `transfer.serving...` module: its subpackage, else "root"."""
    parts = module.split(".")
    if len(parts) > 2 and (SERVING / parts[2]).is_dir():
        return parts[2]
    return "root"


def test_serving_layers_name_its_folders():
    layers = serving_layers()
    assert layers[0] == "root"
    folders = {p.name for p in SERVING.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert set(layers[1:]) == folders, "every serving subpackage has a place in the order"


@pytest.mark.parametrize("layer", serving_layers())
def test_serving_imports_only_its_layer_and_below(layer):
    layers = serving_layers()
    below = set(layers[: layers.index(layer) + 1])
    folder = SERVING if layer == "root" else SERVING / layer
    files = sorted(folder.glob("*.py") if layer == "root" else folder.rglob("*.py"))
    assert files, f"serving layer {layer} has no Python files"
    violations = [
        f"{path.relative_to(ROOT)} ({layer}) imports {name} ({serving_layer_of(name)})"
        for path in files
        for name in imported_modules(path)
        if name.startswith("transfer.serving.") and serving_layer_of(name) not in below
    ]
    assert not violations, "\n".join(violations)
