"""The top-level ``kernels/`` folder never hides the Hugging Face ``kernels`` distribution.

From a source checkout the repository root is on ``sys.path`` (pytest's ``pythonpath``, the benchmarks,
scripts run from the root), so the folder that installs as ``harts.kernels`` is also importable as a
top-level ``kernels``; transformers imports the distribution of that name (a dependency from 5.25 on).
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT)!r})\n{code}"],
                            capture_output=True, text=True, cwd=ROOT, timeout=240)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def _distribution_installed() -> bool:
    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def test_a_top_level_import_gets_the_installed_distribution_and_harts_kernels_stays_ours():
    top_level, ours = _run("import kernels, harts.kernels; print(kernels.__file__); print(harts.kernels.__file__)").splitlines()
    assert Path(ours).resolve() == ROOT / "kernels" / "__init__.py"
    if _distribution_installed():
        assert Path(top_level).resolve() != ROOT / "kernels" / "__init__.py"
    else:
        assert Path(top_level).resolve() == ROOT / "kernels" / "__init__.py"


def test_transformers_models_import_from_the_checkout_root():
    pytest.importorskip("transformers")
    assert _run("import transformers.modeling_utils, harts.kernels; print(harts.kernels.Dispatch.__name__)") == "Dispatch"
