"""Load a script of the repository (``benchmarks/``, ``scripts/``) as a module, for its tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]


def load_script(relative: str, name: str) -> ModuleType:
    """``REPO/relative`` imported as module ``name`` (registered in ``sys.modules``: dataclasses
    look their module up)."""
    spec = importlib.util.spec_from_file_location(name, REPO / relative)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
