"""The suite finds its own helpers when a framework has installed a top-level ``tests`` package.

verl's wheel ships one. A child pytest runs a module that imports ``tests.helpers`` with a
foreign regular ``tests`` package placed on ``PYTHONPATH`` (ahead of site-packages, where a
wheel would put it, so a stricter position), from a working directory outside the repository.
"""

from __future__ import annotations

import os
import subprocess
import sys

from tests.helpers import REPO


def test_a_foreign_top_level_tests_package_does_not_shadow_the_suite(tmp_path):
    foreign = tmp_path / "site" / "tests"
    foreign.mkdir(parents=True)
    (foreign / "__init__.py").write_text('"""the top-level tests package a framework wheel installs"""\nFOREIGN = True\n')
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "site"))
    env.pop("PYTEST_ADDOPTS", None)
    # the control: outside pytest, plain Python resolves `tests` to the foreign package
    control = subprocess.run([sys.executable, "-c", "import tests; print(tests.FOREIGN)"], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=60)
    assert control.stdout.strip() == "True", control.stderr
    # a module that imports tests.helpers at collection time (tests/package/test_imports.py does)
    target = REPO / "tests" / "package" / "test_imports.py"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(REPO),
         "-c", str(REPO / "pyproject.toml"), str(target), "-k", "sees_imports_inside_functions"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    output = result.stdout + result.stderr
    assert "No module named 'tests.helpers'" not in output, output
    assert result.returncode == 0, output
    assert "1 passed" in output, output
