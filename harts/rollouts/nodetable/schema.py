"""The node-table format: row kinds, reserved columns, the schema row and the dtype rules values are cast by."""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np

from harts.rollouts.fields import TOKEN_FIELD_KINDS, TRAJECTORY_FIELD_KINDS, token_id_array
from harts.errors import RolloutInputError

NODE_KIND = "node"
TRAJECTORY_KIND = "trajectory"
SCHEMA_KIND = "schema"
SCHEMA_VERSION = 1
SUFFIXES = (".jsonl", ".parquet")

NODE_COLUMNS = ("tree_id", "node_id", "parent_id", "token_ids")
TRAJECTORY_COLUMNS = ("tree_id", "leaf", "trajectory_id")
RESERVED_COLUMNS = frozenset({"kind", *NODE_COLUMNS, *TRAJECTORY_COLUMNS})
#: Node-table column name -> batch field name, where the two differ.
TOKEN_COLUMN_TO_FIELD = {"logprobs": "rollout_logprobs"}
TOKEN_FIELD_TO_COLUMN = {field: column for column, field in TOKEN_COLUMN_TO_FIELD.items()}
PARQUET_SCHEMA_KEY = b"harts.schema"


def _is_integer(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _is_list(value: Any) -> bool:
    return isinstance(value, (list, tuple, np.ndarray))


_ID_RANGE = (int(np.iinfo(np.int64).min), int(np.iinfo(np.int64).max))


def _integer(value: Any, where: str, column: str) -> int:
    if not _is_integer(value):
        raise RolloutInputError(f"{where}: column '{column}' must be an integer, got {_shown(value)}")
    if not _ID_RANGE[0] <= value <= _ID_RANGE[1]:
        raise RolloutInputError(f"{where}: column '{column}' is {_shown(value)}, outside the 64-bit integer range of ids")
    return int(value)


def _shown(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters, for messages about arbitrary input."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _token_array(values: Any, where: str) -> np.ndarray:
    if not _is_list(values):
        raise RolloutInputError(f"{where}: column 'token_ids' must be a list of token ids, got {_shown(values)}")
    return token_id_array(values, f"{where}: column 'token_ids'")




_SCHEMA_KEYS = frozenset({"kind", "version", "token_fields", "trajectory_fields", "content_hash"})


def _parse_schema(row: Any, where: str) -> tuple[dict[str, str], str | None]:
    """The dtypes a schema record names, and the content hash of the batch it was written from (if recorded)."""
    if not isinstance(row, Mapping):
        raise RolloutInputError(f"{where}: the schema must be an object, got {type(row).__name__}")
    unknown = sorted(str(key) for key in row if key not in _SCHEMA_KEYS)
    if unknown:
        raise RolloutInputError(f"{where}: unknown schema entries {', '.join(_shown(key) for key in unknown[:3])}")
    content_hash = row.get("content_hash")
    if content_hash is not None and not isinstance(content_hash, str):
        raise RolloutInputError(f"{where}: 'content_hash' must be a string")
    if row.get("version") != SCHEMA_VERSION:
        raise RolloutInputError(f"{where}: unsupported schema version {_shown(row.get('version'))}")
    dtypes: dict[str, str] = {}
    for section, kinds in (("token_fields", TOKEN_FIELD_KINDS), ("trajectory_fields", TRAJECTORY_FIELD_KINDS)):
        entries = row.get(section, {})
        if not isinstance(entries, Mapping):
            raise RolloutInputError(f"{where}: '{section}' must map field names to dtypes")
        for name, dtype in entries.items():
            dtypes[name] = _schema_dtype(dtype, kinds, f"{where}: field '{name}'").str
    return dtypes, content_hash


def _schema_dtype(text: Any, kinds: str, where: str) -> np.dtype:
    """A dtype named in a schema, limited to the kinds node tables hold (never object or structured types)."""
    try:
        dtype = np.dtype(text) if isinstance(text, str) else None
    except (TypeError, ValueError, SyntaxError):
        dtype = None
    if dtype is None or dtype.kind not in kinds or dtype.fields is not None or dtype.shape:
        raise RolloutInputError(f"{where} has an unknown or unsupported dtype {_shown(text)}")
    return dtype


_PYTHON_KINDS = {frozenset({bool}): "b", frozenset({int}): "i", frozenset({float}): "f", frozenset({int, float}): "f", frozenset({str}): "U"}


def _values_array(values: Any, where: str, name: str, kinds: str) -> np.ndarray:
    """A column's values (a list of Python values from JSON or Arrow, or a typed array from Parquet) as a flat array.

    Python values are typed by what they are, not by what NumPy would promote them to: booleans
    never mix with numbers, integers stay exact (int64, or uint64 above its range) and strings
    never mix with numbers.
    """
    if isinstance(values, np.ndarray):
        array = values
    else:
        values = list(values)
        kind = _PYTHON_KINDS.get(frozenset(map(type, values)), "?") if values else "f"
        if kind == "i":
            try:
                array = np.array(values, dtype=np.int64)
            except OverflowError:
                try:
                    array = np.array(values, dtype=np.uint64)
                except OverflowError:
                    bad = next(i for i, v in enumerate(values) if not _ID_RANGE[0] <= v < 2**64)
                    raise RolloutInputError(f"{where}: field '{name}' entry {bad} is {_shown(values[bad])}, too large for 64 bits") from None
        elif kind == "?":
            raise RolloutInputError(f"{where}: field '{name}' holds {_kinds_named(values)}; {_allowed(kinds)}")
        else:
            array = np.array(values, dtype={"b": bool, "f": np.float64, "U": str}[kind])
    if array.ndim != 1 or array.dtype.kind not in kinds:
        raise RolloutInputError(f"{where}: field '{name}' holds non-numeric values" if "U" not in kinds
                                else f"{where}: field '{name}' holds {array.dtype} values; {_allowed(kinds)}")
    return array


def _kinds_named(values: list) -> str:
    names = sorted({type(v).__name__ for v in values})
    return "values of several types (" + ", ".join(names) + ")" if len(names) > 1 else f"{names[0]} values"


def _allowed(kinds: str) -> str:
    return "values must be numbers, booleans or strings (one kind per field)" if "U" in kinds else "values must be numbers or booleans"


def _cast(array: np.ndarray, dtype: np.dtype, where: str, name: str) -> np.ndarray:
    """``array`` as ``dtype``, refusing every cast that would change a value: no wrap-around, no overflow to
    infinity, no integer that the float type cannot hold exactly, no truncated string."""
    source = array.dtype
    if source == dtype:
        return array
    target_kind = dtype.kind

    def refuse(bad: np.ndarray, why: str) -> RolloutInputError:
        index = int(np.flatnonzero(bad)[0])
        return RolloutInputError(f"{where}: field '{name}' entry {index} is {array[index].item()!r}, {why} its dtype {dtype}")

    if source.kind == "b" and target_kind in "biuf":
        return array.astype(dtype)
    if source.kind in "iu" and target_kind == "b":
        bad = (array != 0) & (array != 1)
        if bad.any():
            raise refuse(bad, "which is not a boolean (0 or 1) as required by")
        return array.astype(dtype)
    if source.kind in "iu" and target_kind in "iu":
        info = np.iinfo(dtype)
        bad = (array < info.min) | (array > info.max)
        if bad.any():
            raise refuse(bad, f"outside the range {info.min}..{info.max} of")
        return array.astype(dtype)
    if source.kind in "iu" and target_kind == "f":
        cast = array.astype(dtype)
        with np.errstate(invalid="ignore", over="ignore"):
            bad = ~np.isfinite(cast) | (cast.astype(source) != array)
        if bad.any():
            raise refuse(bad, "an integer that cannot be held exactly by")
        return cast
    if source.kind == "f" and target_kind == "f":
        with np.errstate(over="ignore"):
            cast = array.astype(dtype)
        bad = np.isfinite(array) & ~np.isfinite(cast)
        if bad.any():
            raise refuse(bad, "outside the range of")
        return cast
    if source.kind == "U" and target_kind == "U":
        if array.size and np.char.str_len(array).max() > dtype.itemsize // 4:
            raise refuse(np.char.str_len(array) > dtype.itemsize // 4, "a string longer than")
        return array.astype(dtype)
    raise RolloutInputError(f"{where}: field '{name}' holds {source} values that do not fit its dtype {dtype}")
