"""Package layout: the library ``harts`` and the top-level ``kernels/`` folder installed as ``harts.kernels``.

Metadata lives in pyproject.toml; this file only says where the packages are, because
setuptools' declarative config cannot map a found folder tree onto a subpackage name.
"""

from setuptools import find_packages, setup

kernel_packages = ["harts." + name for name in find_packages(include=["kernels", "kernels.*"])]

setup(
    packages=find_packages(include=["harts", "harts.*"]) + kernel_packages,
    package_dir={"harts.kernels": "kernels"},
    package_data={"harts.data": ["*.jsonl"], "harts.kernels.linear_attention": ["configs/*/*.json"]},
)
