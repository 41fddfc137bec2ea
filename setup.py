"""Package layout: the library ``harts``, the top-level ``kernels/`` folder installed as ``harts.kernels``,
and the benchmarks' package ``harts_bench`` (``benchmarks/harts_bench/``: the runtime benchmark behind the
``harts-bench`` console script and its ablations), which the library never imports.

Metadata lives in pyproject.toml; this file only says where the packages are, because
setuptools' declarative config cannot map a found folder tree onto a subpackage name.
"""

from setuptools import find_packages, setup

kernel_packages = ["harts." + name for name in find_packages(include=["kernels", "kernels.*"])]
bench_packages = find_packages("benchmarks", include=["harts_bench", "harts_bench.*"])

setup(
    packages=find_packages(include=["harts", "harts.*"]) + kernel_packages + bench_packages,
    package_dir={"harts.kernels": "kernels", "harts_bench": "benchmarks/harts_bench"},
    package_data={"harts.data": ["*.jsonl"], "harts.kernels": ["fla_configs/*/*.json"]},
)
