"""Saved framework batches: a torch ``.pt`` of a dict of tensors, Parquet, or JSON Lines.

``.pt`` files are read with ``torch.load(weights_only=True)``: tensors, lists and numbers
only, never arbitrary pickled objects (save ``dict(data.batch)``, not a ``DataProto``).
Parquet and JSON Lines hold one row per trajectory (a JSON object per line); each column
becomes one batch key, stacked into ``[B, ...]`` when its rows have one shape and kept as a
list of rows otherwise (AReaL's unpadded rows).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from harts.rollouts.batch import RolloutBatch
from harts.errors import RolloutInputError
from harts.interop.importers import from_areal, from_trl, from_verl

__all__ = ["FRAMEWORKS", "read_framework_batch", "read_framework_file"]

#: Framework name -> importer.
FRAMEWORKS = {"verl": from_verl, "trl": from_trl, "areal": from_areal}
SUFFIXES = (".pt", ".pth", ".parquet", ".jsonl")


def _read_torch(path: Path) -> dict[str, Any]:
    import pickle

    import torch

    if path.stat().st_size == 0:
        raise RolloutInputError(f"{path}: the file is empty; expected a torch.save of a dict of tensors")
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    # torch.load's errors on damaged files: UnpicklingError, RuntimeError (zip), EOFError, and for
    # truncated or foreign bytes IndexError, KeyError, ValueError
    except (pickle.UnpicklingError, RuntimeError, EOFError, IndexError, KeyError, ValueError) as error:
        raise RolloutInputError(
            f"{path}: not a torch file of tensors that can be read safely ({str(error).splitlines()[0]}); save a plain "
            "dict of tensors, e.g. torch.save(dict(data.batch), path)"
        ) from None
    if not isinstance(loaded, dict):
        raise RolloutInputError(f"{path}: holds a {type(loaded).__name__}, expected a dict of tensors")
    return loaded


def _read_parquet(path: Path) -> dict[str, Any]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pydict()
    except (pa.ArrowInvalid, OSError) as error:
        raise RolloutInputError(f"{path}: not a readable Parquet file ({error})") from None


def _read_jsonl(path: Path) -> dict[str, Any]:
    columns: dict[str, list[Any]] = {}
    keys: list[str] | None = None
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise RolloutInputError(
                    f"{path}, line {number}: not UTF-8 text (byte {raw[error.start]:#04x} at column {error.start}); "
                    "JSON Lines are UTF-8: re-encode the file"
                ) from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise RolloutInputError(f"{path}, line {number}: not JSON ({error.msg})") from None
            except RecursionError:
                raise RolloutInputError(f"{path}, line {number}: nested too deeply to be a batch row") from None
            if not isinstance(row, dict):
                raise RolloutInputError(f"{path}, line {number}: expected an object (one trajectory), got {type(row).__name__}")
            if keys is None:
                keys = list(row)
                columns = {key: [] for key in keys}
            elif set(row) != set(keys):
                differ = sorted(set(row) ^ set(keys))
                raise RolloutInputError(f"{path}, line {number}: keys differ from line 1 ({', '.join(differ)})")
            for key in keys:
                columns[key].append(row[key])
    if keys is None:
        raise RolloutInputError(f"{path}: holds no rows")
    return columns


def read_framework_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The batch dict saved in ``path`` (format by suffix: ``.pt`` / ``.pth``, ``.parquet``, ``.jsonl``)."""
    path = Path(path)
    if not path.is_file():
        raise RolloutInputError(f"{path}: no such file")
    suffix = path.suffix.lower()
    if suffix in (".pt", ".pth"):
        return _read_torch(path)
    if suffix == ".parquet":
        return _read_parquet(path)
    if suffix == ".jsonl":
        return _read_jsonl(path)
    raise RolloutInputError(f"{path}: unknown format {suffix!r}; expected one of {', '.join(SUFFIXES)}")


def read_framework_batch(path: str | os.PathLike[str], framework: str, **options: Any) -> RolloutBatch:
    """Read a saved ``framework`` batch (``"verl"``, ``"trl"``, ``"areal"``) as a :class:`RolloutBatch`."""
    if framework not in FRAMEWORKS:
        raise RolloutInputError(f"unknown framework {framework!r}; expected one of {', '.join(FRAMEWORKS)}")
    columns = read_framework_file(path)
    try:
        return FRAMEWORKS[framework](columns, **options)
    except RolloutInputError as error:
        raise RolloutInputError(f"{path}: {error}") from None
