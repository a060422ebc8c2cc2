"""The package's layout: every module imports alone, and only modules below it."""

import ast
import sys
from pathlib import Path

import pytest

from .processes import run_all

PACKAGE = Path(__file__).resolve().parent.parent / "dsv41_mlx"
# a module may import from its own layer or any layer below it, never above
LAYERS = [
    {"config", "sampling", "chat", "tokenizer", "kernels"},
    {"quant", "cache"},
    {"models"},
    {"runtime"},
    {"io"},
    {"speculative"},
    {"generate"},
    {"server"},
]


def _modules() -> list[str]:
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def _layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    return next(i for i, layer in enumerate(LAYERS) if top in layer)


def _imports(module: str) -> set[str]:
    """The package's modules this one imports (relative imports resolved)."""
    path = PACKAGE.parent / (module.replace(".", "/") + ("/__init__.py" if (PACKAGE.parent / module.replace(".", "/")).is_dir() else ".py"))
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if name.startswith("dsv41_mlx."):
                found.add(name)
                found.update(f"{name}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("dsv41_mlx."))
    return {n for n in found if n in set(_modules())}


@pytest.mark.parametrize("module", [m for m in _modules() if m != "dsv41_mlx"])
def test_each_module_imports_only_layers_at_or_below_its_own(module):
    above = [m for m in _imports(module) if _layer(m) > _layer(module)]
    assert not above, f"{module} imports {above} from a layer above it"


# inside kernels/: build and tuning, then specs, then the kernel families; the package's
# __init__ only re-exports (for the model), and no module of it imports from there
KERNEL_RANKS = {"build": 0, "tuning": 0, "specs": 1}


def _kernel_rank(module: str) -> int:
    return KERNEL_RANKS.get(module.rsplit(".", 1)[1], 2)


@pytest.mark.parametrize("module", [m for m in _modules() if m.startswith("dsv41_mlx.kernels.")])
def test_kernel_modules_import_only_their_rank_or_below(module):
    inside = [m for m in _imports(module) if m.startswith("dsv41_mlx.kernels.")]
    above = [m for m in inside if _kernel_rank(m) > _kernel_rank(module)]
    assert not above, f"{module} imports {above} from a rank above it"
    path = PACKAGE / "kernels" / (module.rsplit(".", 1)[1] + ".py")
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module is None:
            names = [a.name for a in node.names if f"dsv41_mlx.kernels.{a.name}" not in _modules()]
            assert not names, f"{module} imports {names} from the kernels package's re-exports"


def test_every_module_imports_alone_in_a_fresh_interpreter():
    """No import cycle: each module, imported first in a fresh interpreter, loads."""
    script = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
    modules = _modules()
    for module, out in zip(modules, run_all([[sys.executable, "-c", script, m] for m in modules], timeout=120)):
        assert out.returncode == 0, f"{module}: {out.stderr[-2000:]}"
