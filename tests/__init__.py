"""HARTS' test suite, a regular package so that `tests.helpers` is ours even where a framework's wheel installs a top-level `tests` package (verl 0.9.1 does)."""
