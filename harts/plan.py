"""Compiled plans, their statistics, the inspect document and the on-disk artifact.

Artifact layout (a directory)::

    PLAN/manifest.json         schema version, harts version, input hash, options, pipeline,
                               stats, sha256 of the two files below, and its own digest
    PLAN/plan.ir               the IR in canonical text (the rounded module of a laid-out plan)
    PLAN/tensors.safetensors   the ``lay-out`` stage: each microbatch's layout arrays, as runs

or a single ``*.safetensors`` file holding the tensors, with manifest and IR in its
metadata (one key, ``harts``). The tensors are the source of truth for the layouts: loading
decodes them, verifies them against the IR (:func:`harts.ir.verify.verify`) and runs from
them; it never plans or lays out again. (The IR text of a laid-out module would carry the same
arrays as runs; the artifact keeps them once, as tensors.) Loading checks the schema version
and every digest: a truncated or edited artifact fails with
:class:`~harts.errors.PlanArtifactError`, never yields a wrong plan.
Saving is crash-safe (:mod:`harts.fsio`): the target always holds the old or the new plan, and
an existing path that is not a HARTS plan is refused, never replaced.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from safetensors import safe_open
from safetensors.numpy import load_file as load_tensor_file
from safetensors.numpy import save as save_tensors

from harts._version import __version__
from harts.binding import BoundPlan, bind
from harts.errors import HartsError, OutputError, PlanArtifactError
from harts.fsio import OutputKind, atomic_write_bytes, check_output, foreign_entries, replace_directory
from harts.ir.layout import LaidOutModule, MicrobatchLayout
from harts.ir.nodes import Module, Phase
from harts.ir.text import parse_ir, print_ir
from harts.ir.verify import verify

#: The manifest's schema (also the inspect document's). Unchanged since the tensors became the
#: layouts a loaded plan runs from: a version-1 artifact always held exactly those tensors.
SCHEMA_VERSION = 1
_MANIFEST = "manifest.json"
_IR = "plan.ir"
_TENSORS = "tensors.safetensors"


def _segment_depths(module: Module) -> tuple[int, int]:
    """(number of maximal fork-free segments, deepest root-to-leaf segment count) of the batch trie."""
    trie = module.trie
    starts = trie.segment_starts()
    depth = [0] * len(trie.nodes)
    for node in trie.nodes:
        parent_depth = depth[node.parent] if node.parent >= 0 else 0
        depth[node.id] = parent_depth + (1 if starts[node.id] else 0)
    return sum(starts), max(depth, default=0)


def compute_stats(module: Module, plan_seconds: float | None = None, *, laid_out: bool = False) -> dict[str, Any]:
    """The figures of a compiled module; keys follow the inspect document (:meth:`Plan.to_json`, ``harts inspect PLAN --json``).

    ``laid_out``: the module's microbatches have been laid out (the plan's phase is ``laid_out``).
    """
    lengths = [t.length for t in module.trajectories]
    semantic = int(sum(lengths))
    stats: dict[str, Any] = {
        "trajectories": len(lengths),
        "trees": len({t.tree for t in module.trajectories}),
        "semantic_tokens": semantic,
        "capacity": module.capacity,
        "dp_size": module.dp_size,
        "chunk_size": module.chunk_size,
        "phase": str(Phase.LAID_OUT if laid_out else module.phase),
        "compact_tokens": None,
        "lower_bound_work": None,
        "total_work": None,
        "compression": None,
        "slot_critical_work": None,
        "max_replica_work": None,
        "num_microbatches": None,
        "replay_tokens": None,
        "max_rounds": None,
        "segments": None,
        "max_depth": None,
        "plan_seconds": plan_seconds,
    }
    if module.trie is not None:
        compact = module.trie.compact_tokens
        segments, max_depth = _segment_depths(module)
        stats.update(compact_tokens=compact, lower_bound_work=compact, total_work=compact,
                     compression=semantic / compact, segments=segments, max_depth=max_depth)
    if module.microbatches is not None:
        total = sum(mb.work for mb in module.microbatches)
        stats.update(total_work=total, compression=semantic / total, num_microbatches=len(module.microbatches))
        if module.phase >= Phase.SCHEDULED:
            slots: dict[int, int] = {}
            replicas: dict[int, int] = {}
            for mb in module.microbatches:
                slots[mb.slot] = max(slots.get(mb.slot, 0), mb.work)
                replicas[mb.replica] = replicas.get(mb.replica, 0) + mb.work
            stats.update(slot_critical_work=sum(slots.values()), max_replica_work=max(replicas.values()))
        if module.phase >= Phase.SEGMENTED:
            stats["segments"] = sum(len(mb.segments) for mb in module.microbatches)
        if module.phase >= Phase.ROUNDED:
            stats.update(
                replay_tokens=sum(mb.replay_tokens for mb in module.microbatches),
                max_rounds=max(len(mb.rounds) for mb in module.microbatches),
            )
    return stats


def _sequence_json(sequence) -> dict[str, Any]:
    state = sequence.state_from
    return {
        "trajectory": sequence.trajectory,
        "start": sequence.start,
        "end": sequence.end,
        "replay_start": sequence.replay_start,
        "state_from": None if state is None else {"round": state.round, "trajectory": state.trajectory, "position": state.position},
        "exports": list(sequence.exports),
    }


@attrs.frozen(eq=False)
class Plan:
    """A compiled plan: the final IR, its layouts (the ``lay-out`` stage), the pipeline that
    produced it and its statistics.

    ``layouts`` is None for a plan whose pipeline stopped before code generation; only a
    laid-out plan runs (:meth:`bind`). Layout arrays are read-only.
    """

    module: Module
    pipeline: str
    stats: dict[str, Any]
    layouts: tuple[MicrobatchLayout, ...] | None = None
    #: compiled for the fast linear-attention kernels (``harts.compile(fast_kernels=True)``)
    fast_kernels: bool = False
    #: what the pipeline produced, built once (see :attr:`stage`)
    _stage: Module | LaidOutModule = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if self.layouts is None and self.module.phase >= Phase.ROUNDED:
            raise PlanArtifactError(
                "a rounded plan is laid out: give it its layouts (harts.codegen.layout.lay_out), or compile it with harts.compile"
            )
        if self.layouts is not None and len(self.layouts) != len(self.module.microbatches or ()):
            raise PlanArtifactError(
                f"the plan has {len(self.module.microbatches or ())} microbatches but {len(self.layouts)} layouts"
            )
        stage = self.module if self.layouts is None else LaidOutModule(module=self.module, layouts=self.layouts)
        object.__setattr__(self, "_stage", stage)

    @property
    def has_rounds(self) -> bool:
        return self.module.phase >= Phase.ROUNDED

    @property
    def is_laid_out(self) -> bool:
        return self.layouts is not None

    @property
    def microbatches(self):
        return self.module.microbatches or ()

    @property
    def input_hash(self) -> str:
        return self.module.input_hash

    @property
    def chunk_size(self) -> int:
        """B, the linear-attention chunk size the plan's rounds, replay and state hand-offs sit on: the
        one chunk size every kernel call on this plan uses."""
        return self.module.chunk_size

    @property
    def stage(self) -> Module | LaidOutModule:
        """What the pipeline produced: the laid-out module, or the module where the pipeline stopped."""
        return self._stage

    def bind(self, batch, model: Any = None) -> BoundPlan:
        """This plan bound to ``batch`` (and checked against ``model``), as the runtime runs it: see :mod:`harts.binding`."""
        return bind(self, batch, model)

    def to_json(self) -> dict[str, Any]:
        """The inspect document (``harts inspect PLAN --json``)."""
        microbatches = []
        for mb in self.microbatches:
            entry: dict[str, Any] = {
                "index": mb.index,
                "replica": mb.replica,
                "slot": mb.slot,
                "trajectories": list(mb.trajectories),
                "compact_work": mb.work,
                "replay_tokens": mb.replay_tokens,
                "rounds": None if mb.rounds is None else [[_sequence_json(s) for s in r.sequences] for r in mb.rounds],
            }
            microbatches.append(entry)
        return {
            "schema_version": SCHEMA_VERSION,
            "pipeline": self.pipeline,
            "input_hash": self.input_hash,
            "stats": dict(self.stats),
            "microbatches": microbatches,
        }

    def ir_text(self) -> str:
        return print_ir(self.module)

    # ------------------------------------------------------------- lay-out
    def layout(self, microbatch: int) -> MicrobatchLayout:
        """The compact physical layout of one microbatch (a laid-out plan's stored one)."""
        if self.layouts is None:
            raise PlanArtifactError(f"the plan is at phase {self.module.phase} and holds no layouts (compile with the full pipeline)")
        if not 0 <= microbatch < len(self.layouts):
            raise PlanArtifactError(f"the plan has no microbatch {microbatch} ({len(self.layouts)} microbatches)")
        return self.layouts[microbatch]

    def index_tensors(self) -> dict[str, np.ndarray]:
        """Every microbatch's layout tensors, keys prefixed ``mb<index>.`` (empty for a plan that was not laid out)."""
        tensors: dict[str, np.ndarray] = {}
        if self.layouts is None:
            return tensors
        for mb in self.microbatches:
            for key, value in self.layout(mb.index).to_tensors().items():
                tensors[f"mb{mb.index}.{key}"] = np.ascontiguousarray(value)
        return tensors

    # ------------------------------------------------------------- artifact
    def manifest(self, ir_text: str, tensor_bytes: bytes) -> dict[str, Any]:
        stats = {k: v for k, v in self.stats.items() if k != "plan_seconds"}
        manifest = {
            "schema_version": SCHEMA_VERSION,
            "harts_version": __version__,
            "input_hash": self.input_hash,
            "options": {"capacity": self.module.capacity, "dp_size": self.module.dp_size, "chunk_size": self.module.chunk_size,
                        "fast_kernels": self.fast_kernels},
            "pipeline": self.pipeline.split(",") if self.pipeline else [],
            "pipeline_text": self.pipeline,
            "stats": stats,
            "ir_sha256": hashlib.sha256(ir_text.encode()).hexdigest(),
            "tensors_sha256": hashlib.sha256(tensor_bytes).hexdigest(),
        }
        manifest["manifest_sha256"] = _manifest_digest(manifest)
        return manifest

    def save(self, path: str | os.PathLike) -> Path:
        """Write the artifact atomically: a directory, or one file if ``path`` ends in ``.safetensors``."""
        path = Path(path)
        try:  # the output-ownership rule (harts.fsio), before any work: new, or a plan HARTS wrote
            check_output(path, plan_output_kind(path))
        except OutputError as error:
            raise PlanArtifactError(str(error)) from None
        ir_text = self.ir_text()
        tensors = self.index_tensors()
        if path.suffix == ".safetensors":
            manifest = self.manifest(ir_text, _tensor_payload(tensors))
            # One metadata key: safetensors keeps metadata in a hash map, so several keys would
            # be written in a varying order and break byte-identical artifacts.
            payload = json.dumps({"manifest": manifest, "ir": ir_text}, sort_keys=True)
            data = save_tensors(tensors, metadata={"harts": payload})
            _atomic_write_file(path, data)
            return path
        tensor_bytes = save_tensors(tensors)
        manifest = self.manifest(ir_text, tensor_bytes)
        _atomic_write_directory(path, {_MANIFEST: _dumps(manifest).encode(), _IR: ir_text.encode(), _TENSORS: tensor_bytes})
        return path


def _dumps(document: dict[str, Any]) -> str:
    return json.dumps(document, sort_keys=True, indent=2) + "\n"


def _manifest_digest(manifest: dict[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _tensor_payload(tensors: dict[str, np.ndarray]) -> bytes:
    """Canonical bytes of a tensor dict (names, dtypes, shapes, data), for single-file digests."""
    digest_input = bytearray()
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name])
        digest_input += f"{name}:{array.dtype.str}:{array.shape};".encode() + array.tobytes()
    return bytes(digest_input)


_ARTIFACT_FILES = frozenset({_MANIFEST, _IR, _TENSORS})


def _why_not_a_plan_directory(path: Path) -> str | None:
    """None for a directory that holds a HARTS plan and nothing else (or is empty), else the reason."""
    why, names = foreign_entries(path, _ARTIFACT_FILES, "a plan")
    if why is not None or not names:
        return why
    try:
        manifest = json.loads((path / _MANIFEST).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return f"it has no {_MANIFEST}"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return f"its {_MANIFEST} is not a readable HARTS manifest"
    if not (isinstance(manifest, dict) and "harts_version" in manifest and "schema_version" in manifest):
        return f"its {_MANIFEST} is not a HARTS manifest"
    return None


def _is_plan_directory(path: Path) -> bool:
    return _why_not_a_plan_directory(path) is None


def _is_plan_file(path: Path) -> bool:
    """True for a single-file plan (a safetensors file with a HARTS manifest in its metadata)."""
    if not path.is_file() or path.is_symlink():
        return False
    try:
        with safe_open(str(path), framework="numpy") as handle:
            return "harts" in (handle.metadata() or {})
    except Exception:  # safetensors raises several types for files that are not its own
        return False


def _why_not_a_plan_file(path: Path) -> str | None:
    return None if _is_plan_file(path) else "it is not a safetensors file whose metadata holds a HARTS plan manifest"


#: Plan targets for the output-ownership rule (:func:`harts.fsio.check_outputs`): HARTS replaces only plans it wrote.
PLAN_DIRECTORY = OutputKind("a HARTS plan", "the plan", True, _why_not_a_plan_directory)
PLAN_FILE = OutputKind("a HARTS plan", "the plan", False, _why_not_a_plan_file)


def plan_output_kind(path: str | os.PathLike) -> OutputKind:
    """The kind of plan :meth:`Plan.save` writes at ``path``: one file for ``.safetensors``, else a directory."""
    return PLAN_FILE if Path(path).suffix == ".safetensors" else PLAN_DIRECTORY


def _refuse_foreign_target(path: Path, why: str) -> PlanArtifactError:
    return PlanArtifactError(
        f"cannot save the plan to {path}: it exists and is not a HARTS plan ({why}); "
        "it was left untouched: choose another path or remove it yourself"
    )


def _atomic_write_file(path: Path, data: bytes) -> None:
    if path.is_dir():
        raise _refuse_foreign_target(path, "it is a directory")
    if (path.exists() or path.is_symlink()) and not _is_plan_file(path):
        raise _refuse_foreign_target(path, "a file that is not a single-file plan")
    try:
        atomic_write_bytes(path, data)
    except OSError as error:
        raise PlanArtifactError(f"cannot save the plan to {path}: {error.strerror or error}") from None


def _atomic_write_directory(path: Path, files: dict[str, bytes]) -> None:
    try:
        replace_directory(path, files, is_ours=_is_plan_directory)
    except FileExistsError as error:
        if error.filename is not None and Path(error.filename) != path:  # an ancestor is a file, not a directory
            raise PlanArtifactError(f"cannot save the plan to {path}: {error.filename} is not a directory") from None
        raise _refuse_foreign_target(path, _why_not_a_plan_directory(path) or "it changed while saving") from None
    except OSError as error:
        raise PlanArtifactError(f"cannot save the plan to {path}: {error.strerror or error}") from None


def _check_manifest(manifest: Any, where: Path) -> dict[str, Any]:
    if not isinstance(manifest, dict):
        raise PlanArtifactError(f"{where}: the manifest is not a JSON object")
    version = manifest.get("schema_version")
    if version != SCHEMA_VERSION:
        raise PlanArtifactError(f"{where}: plan schema version {version!r} is not supported (this harts reads version {SCHEMA_VERSION})")
    if manifest.get("manifest_sha256") != _manifest_digest(manifest):
        raise PlanArtifactError(f"{where}: the manifest was edited or is corrupt (its digest does not match)")
    return manifest


def _layouts_from_tensors(tensors: dict[str, np.ndarray], module: Module, where: Path) -> tuple[MicrobatchLayout, ...] | None:
    """The stored layouts, one per microbatch in order (None for a plan stored before the rounded phase)."""
    if module.phase < Phase.ROUNDED:
        if tensors:
            raise PlanArtifactError(f"{where}: a {module.phase} plan stores no layout tensors, but this one holds {len(tensors)}")
        return None
    per_microbatch: dict[str, dict[str, np.ndarray]] = {}
    for name, value in tensors.items():
        prefix, _, key = name.partition(".")
        per_microbatch.setdefault(prefix, {})[key] = value
    expected = [f"mb{mb.index}" for mb in module.microbatches]
    foreign = sorted(set(per_microbatch) - set(expected))
    if foreign:
        raise PlanArtifactError(f"{where}: the layout tensors name microbatch {foreign[0]!r}, which the plan does not have")
    layouts = []
    for prefix in expected:
        if prefix not in per_microbatch:
            raise PlanArtifactError(f"{where}: the artifact holds no layout of microbatch {prefix[2:]}")
        layouts.append(MicrobatchLayout.from_tensors(per_microbatch[prefix]))
    return tuple(layouts)


#: The largest safetensors header a plan may have: its tensor names and offsets (a few per microbatch).
MAX_TENSOR_HEADER_BYTES = 64 << 20


def _check_tensor_sizes(path: Path, what: str) -> None:
    """Refuse a safetensors file whose size is not exactly what its header declares, before reading its tensors.

    A file of gigabytes (sparse, or padded) behind a small header would otherwise be read whole into memory
    only to fail its digest; the header alone (bounded) says how many bytes the tensors take.
    """
    size = path.stat().st_size
    with path.open("rb") as handle:
        prefix = handle.read(8)
        header_bytes = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
        if not 0 < header_bytes <= min(size - 8, MAX_TENSOR_HEADER_BYTES):
            raise PlanArtifactError(f"{path}: {what} (a safetensors header of {header_bytes:,} bytes in a {size:,}-byte file)")
        try:
            header = json.loads(handle.read(header_bytes).decode("utf-8"))
            ends = [int(entry["data_offsets"][1]) for key, entry in header.items() if key != "__metadata__"]
        except (ValueError, KeyError, TypeError, IndexError, AttributeError, RecursionError) as error:
            raise PlanArtifactError(f"{path}: {what} (a damaged safetensors header: {type(error).__name__})") from None
    declared = max(ends, default=0)
    held = size - 8 - header_bytes
    if declared != held:
        raise PlanArtifactError(
            f"{path}: {what} (its header declares {declared:,} bytes of tensors but the file holds {held:,} after it; "
            "it was not read)"
        )


def _file_digest(path: Path) -> str:
    """SHA-256 of a file, read a block at a time (never the whole file in memory)."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def load_plan(path: str | os.PathLike) -> Plan:
    """Load and check a plan artifact written by :meth:`Plan.save`.

    The layouts come from the stored tensors and are verified against the stored IR; nothing
    is planned or laid out again. Every way an artifact can be unreadable, damaged or foreign
    raises :class:`PlanArtifactError` naming the path (and the file inside a plan directory).
    """
    path = Path(path)
    if not path.exists():
        raise PlanArtifactError(f"no plan at {path}")
    try:
        return _load_plan(path)
    except PlanArtifactError:
        raise
    except OSError as error:
        where = error.filename or path
        raise PlanArtifactError(f"{where}: cannot read the plan ({error.strerror or error})") from None
    except UnicodeDecodeError:
        raise PlanArtifactError(f"{path}: damaged plan (a text part is not UTF-8)") from None
    except Exception as error:  # noqa: BLE001 - any other failure on these bytes means a damaged or foreign artifact
        raise PlanArtifactError(f"{path}: damaged plan ({type(error).__name__}: {str(error)[:200]})") from None


def _load_plan(path: Path) -> Plan:
    try:
        if path.is_dir():
            try:
                manifest = json.loads((path / _MANIFEST).read_bytes().decode("utf-8"))
            except FileNotFoundError:
                raise PlanArtifactError(f"{path}: missing {_MANIFEST}; not a HARTS plan directory") from None
            except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as error:
                raise PlanArtifactError(f"{path / _MANIFEST}: truncated or not JSON ({str(error)[:200]})") from None
            manifest = _check_manifest(manifest, path)
            try:
                ir_text = (path / _IR).read_bytes().decode("utf-8")
                _check_tensor_sizes(path / _TENSORS, "truncated or edited")
                digest = _file_digest(path / _TENSORS)
            except FileNotFoundError as error:
                raise PlanArtifactError(f"{path}: missing {Path(error.filename).name}") from None
            if digest != manifest.get("tensors_sha256"):
                raise PlanArtifactError(f"{path / _TENSORS}: truncated or edited (digest mismatch)")
            try:
                tensors = load_tensor_file(str(path / _TENSORS))
            except Exception as error:  # safetensors raises several types for damaged headers
                raise PlanArtifactError(f"{path / _TENSORS}: not readable tensors ({error})") from None
        else:
            _check_tensor_sizes(path, "not a readable plan file")
            try:
                with safe_open(str(path), framework="numpy") as handle:
                    metadata = handle.metadata() or {}
                tensors = load_tensor_file(str(path))
            except Exception as error:  # safetensors raises several types for damaged headers
                raise PlanArtifactError(f"{path}: not a readable plan file ({error})") from None
            if "harts" not in metadata:
                raise PlanArtifactError(f"{path}: no HARTS manifest in the file metadata")
            try:
                payload = json.loads(metadata["harts"])
            except (json.JSONDecodeError, RecursionError) as error:
                raise PlanArtifactError(f"{path}: manifest is not JSON ({error})") from None
            if not isinstance(payload, dict) or not isinstance(payload.get("ir"), str):
                raise PlanArtifactError(f"{path}: the file metadata does not hold a HARTS manifest and IR")
            manifest = _check_manifest(payload.get("manifest"), path)
            ir_text = payload["ir"]
            if hashlib.sha256(_tensor_payload(tensors)).hexdigest() != manifest.get("tensors_sha256"):
                raise PlanArtifactError(f"{path}: index tensors were edited (digest mismatch)")
        if hashlib.sha256(ir_text.encode()).hexdigest() != manifest.get("ir_sha256"):
            raise PlanArtifactError(f"{path}: the IR was truncated or edited (digest mismatch)")
        module = parse_ir(ir_text)
        if not isinstance(module, Module):
            raise PlanArtifactError(f"{path}: the stored IR is a {type(module).__name__}, not a Module")
        layouts = _layouts_from_tensors(tensors, module, path)
        verify(module if layouts is None else LaidOutModule(module=module, layouts=layouts))
    except PlanArtifactError:
        raise
    except HartsError as error:
        raise PlanArtifactError(f"{path}: the stored plan is invalid: {error}") from None
    if module.input_hash != manifest.get("input_hash"):
        raise PlanArtifactError(f"{path}: the IR's input hash differs from the manifest's")
    stats, pipeline = manifest.get("stats", {}), manifest.get("pipeline_text", "")
    if not isinstance(stats, dict) or not isinstance(pipeline, str):
        raise PlanArtifactError(f"{path}: the manifest's stats or pipeline_text has the wrong type")
    stats = dict(stats)
    stats["plan_seconds"] = None
    options = manifest.get("options")
    fast_kernels = options.get("fast_kernels", False) if isinstance(options, dict) else False
    if not isinstance(fast_kernels, bool):
        raise PlanArtifactError(f"{path}: the manifest's option fast_kernels is not a boolean")
    return Plan(module=module, pipeline=pipeline, stats=stats, layouts=layouts, fast_kernels=fast_kernels)
