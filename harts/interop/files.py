"""Saved framework batches: a torch ``.pt`` of a dict of tensors, Parquet, or JSON Lines.

``.pt`` files are read with ``torch.load(weights_only=True)``: tensors, lists and numbers
only, never arbitrary pickled objects. verl's ``DataProto.save_to_disk`` files (``.pkl``, or any
of these suffixes) are read without running verl's unpickling: only the ``DataProto`` state is
taken (its ``TensorDict`` batch, ``non_tensor_batch`` numpy arrays and ``meta_info``), the batch
rebuilt by :func:`_tensordict_leaves` from its consolidated storage, and any other object refused.
Parquet and JSON Lines hold one row per trajectory (a JSON object per line); each column
becomes one batch key, stacked into ``[B, ...]`` when its rows have one shape and kept as a
list of rows otherwise (AReaL's unpadded rows).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from harts.rollouts.batch import RolloutBatch
from harts.errors import RolloutInputError
from harts.interop.importers import from_areal, from_trl, from_verl

__all__ = ["FRAMEWORKS", "read_framework_batch", "read_framework_file"]

#: Framework name -> importer.
FRAMEWORKS = {"verl": from_verl, "trl": from_trl, "areal": from_areal}
SUFFIXES = (".pt", ".pth", ".pkl", ".pickle", ".parquet", ".jsonl")
#: The pickle globals a DataProto.save_to_disk file may name besides DataProto: numpy arrays of its non-tensor batch.
_NUMPY_GLOBALS = {("numpy._core.multiarray", "_reconstruct"), ("numpy.core.multiarray", "_reconstruct"), ("numpy", "ndarray"),
                  ("numpy", "dtype"), ("numpy._core.multiarray", "scalar"), ("numpy.core.multiarray", "scalar"),
                  ("numpy._core.numeric", "_frombuffer"), ("numpy.core.numeric", "_frombuffer")}
#: How tensordict (>= 0.5, as verl's DataProto.__getstate__ requires) pickles a consolidated TensorDict.
_TENSORDICT_REBUILD = "tensordict._reductions._rebuild_tensordict_files_consolidated"


def _tensordict_leaves(metadata: dict, storage) -> dict[str, Any]:
    """The tensors of a consolidated TensorDict: views of its one byte storage, as tensordict lays them out.

    Written here so that a saved batch is read with ``torch.load(weights_only=True)`` and neither
    tensordict nor verl is imported: nested TensorDicts and non-tensor entries are left out.
    """
    import torch

    out: dict[str, Any] = {}
    jagged: dict[str, dict[str, Any]] = {}
    for key, (dtype, shape, start, stop, pad) in metadata.get("leaves", {}).items():
        value = storage[start:stop].view(getattr(torch, str(dtype).removeprefix("torch.")))
        count = int(np.prod(shape)) if len(shape) else 1
        value = value[:count].view(tuple(shape)) if pad else value.view(tuple(shape))
        for part in ("<NJT_VALUES>", "<NJT_LENGTHS>", "<NJT_OFFSETS>"):
            if key.startswith(part):
                jagged.setdefault(key.removeprefix(part), {})[part] = value
                break
        else:
            out[key] = value
    for key, parts in jagged.items():
        out[key] = torch.nested.nested_tensor_from_jagged(parts["<NJT_VALUES>"], offsets=parts["<NJT_OFFSETS>"],
                                                          lengths=parts.get("<NJT_LENGTHS>"))
    return out


class _DataProtoState:
    """Stands in for verl's DataProto while unpickling: keeps the state instead of running its __setstate__."""

    def __setstate__(self, state):
        self.state = state


def _read_dataproto(path: Path) -> dict[str, Any]:
    import io
    import pickle

    import torch

    class Unpickler(pickle.Unpickler):
        def find_class(self, module, name):
            if (module, name) == ("verl.protocol", "DataProto"):
                return _DataProtoState
            if (module, name) in _NUMPY_GLOBALS:
                return super().find_class(module, name)
            raise RolloutInputError(f"{path}: a DataProto file naming {module}.{name}, which HARTS does not unpickle")

    try:
        with path.open("rb") as handle:
            saved = Unpickler(handle).load()
        batch_bytes, non_tensor_batch, _meta_info = saved.state
        with torch.serialization.safe_globals([(_tensordict_leaves, _TENSORDICT_REBUILD)]):
            batch = {} if batch_bytes is None else torch.load(io.BytesIO(batch_bytes), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, AttributeError, ValueError, TypeError, EOFError, RuntimeError) as error:
        raise RolloutInputError(f"{path}: not a DataProto.save_to_disk file HARTS can read ({str(error).splitlines()[0]})") from None
    if not isinstance(batch, dict):
        raise RolloutInputError(f"{path}: the DataProto's batch is a {type(batch).__name__}, expected a TensorDict")
    return {**batch, **dict(non_tensor_batch or {})}


def _is_dataproto(path: Path) -> bool:
    with path.open("rb") as handle:
        return b"verl.protocol" in handle.read(64)


def _read_torch(path: Path) -> dict[str, Any]:
    import pickle

    import torch

    if path.stat().st_size == 0:
        raise RolloutInputError(f"{path}: the file is empty; expected a torch.save of a dict of tensors")
    if _is_dataproto(path):
        return _read_dataproto(path)
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
    if suffix in (".pt", ".pth", ".pkl", ".pickle"):
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
