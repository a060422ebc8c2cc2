"""The repository's scripts/ as modules, for the tests that call into them. The scripts'
packages (scripts/benchmarks/, scripts/kernel_checks/) import as any package does, as
scripts.benchmarks.<module>: the scripts import them so too, and a test patches a name on
the module that looks it up."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def load_script(name: str):
    """scripts/<name>.py as a fresh module, registered under its name in sys.modules (dataclasses
    look their module up there, and worker processes find their functions by module name)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
