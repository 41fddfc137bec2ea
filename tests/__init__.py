"""HARTS' test suite as a regular package.

Some frameworks' wheels (verl's among them) install a top-level ``tests`` package into
site-packages. A regular package wins over a namespace package wherever it sits on the path,
so without this file ``import tests.helpers`` found theirs and failed. The pytest config puts
the repository root first on ``sys.path`` (``pythonpath = ["."]``), so ``tests`` is this one.
"""
