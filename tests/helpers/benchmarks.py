"""Paths of the repository and its benchmark scripts, for tests that run them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

#: The repository root (tests run the CLI and the benchmark scripts from there).
REPO = Path(__file__).resolve().parents[2]


def load_benchmark(filename: str):
    """A script of ``benchmarks/`` imported as a module (the folder is not a package on the test path)."""
    path = REPO / "benchmarks" / filename
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
