"""The verl and AReaL source files HARTS' docstrings cite exist in the pinned releases.

HARTS documents every framework layout by the framework code that produces or reads it; a
citation of a file a release no longer has (``verl/workers/actor/dp_actor.py`` and
``areal/engine/ppo/actor.py`` before verl 0.9 / AReaL 1.0) sends a reader to nothing.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from tests.helpers import REPO

CITED = re.compile(r"``((?:verl|areal)/[\w/]+\.py)``")
FILES = sorted((REPO / "harts" / "interop").glob("*.py")) + sorted((REPO / "harts" / "integrations").glob("*.py"))


def installed_root(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None:
        pytest.skip(f"{package} is not installed")
    return Path(next(iter(spec.submodule_search_locations))).parent


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_cited_framework_files_exist(path):
    cited = CITED.findall(path.read_text())
    for citation in cited:
        package = citation.split("/", 1)[0]
        assert (installed_root(package) / citation).is_file(), f"{path.name} cites {citation}, not in the installed {package}"


def test_the_interop_modules_cite_both_frameworks():
    cited = {c.split("/", 1)[0] for path in FILES for c in CITED.findall(path.read_text())}
    assert cited == {"verl", "areal"}
