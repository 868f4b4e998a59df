"""Loads a script of ``benchmarks/`` as a module (with ``benchmarks/`` importable while it loads, for its own
imports of sibling scripts)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def load_bench(name: str):
    """``benchmarks/<name>.py`` as a fresh module object."""
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))
