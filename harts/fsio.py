"""Crash-safe writes of files and artifact directories.

Every file HARTS writes goes through here, so the guarantees hold everywhere:

* a write lands completely or not at all: data goes to a hidden temporary beside the
  target, is flushed to disk, then renamed over the target in one step;
* an artifact directory is replaced by an atomic exchange of two directories
  (``renameat2(RENAME_EXCHANGE)`` on Linux, ``renamex_np(RENAME_SWAP)`` on macOS), so at
  every instant the target holds the old or the new artifact, never neither;
* temporaries are named ``.<target>.harts-tmp-<pid>-<random>``; a save removes the ones
  that earlier, killed saves of the same target left behind (only when their process is
  gone, so two concurrent writers never remove each other's);
* permissions follow the umask, as a plain ``open``/``mkdir`` would;
* a directory target that is not ours to replace is refused by the caller's ``is_ours``
  check before anything is written: nothing the user did not hand us is deleted;
* appended records (``--metrics``) land whole or not at all (:class:`RecordAppender`).

The output-ownership rule, one for every file and directory HARTS writes (:func:`check_outputs`):
HARTS writes a path only when nothing is there yet or when what is there is recognisably its
own artifact of the same kind (each :class:`OutputKind` says how to recognise one: a marker in
safetensors or PNG metadata, at the start of every metrics record or of every IR stage file here;
a plan's manifest in :mod:`harts.plan`, a checkpoint's in :mod:`harts.models.checkpoint`, a node
table whose content hash matches its rows in :mod:`harts.rollouts.batch`); it never writes onto,
into or around an input of the same run, nor lets two outputs of one run share a path. Commands check all their outputs before any work starts,
and every writer checks its target again just before it writes.

Hand-written because neither the standard library nor the project's dependencies offer an
atomic directory swap, stale-temporary recovery or a notion of which files a program owns.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import json
import logging
import os
import re
import secrets
import shutil
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

import attrs

from harts._version import __version__
from harts.errors import OutputError

logger = logging.getLogger(__name__)

__all__ = [
    "ARTIFACT_KEY",
    "IR_DUMP",
    "IR_DUMP_STAGE",
    "METRICS",
    "METRICS_MARKER",
    "OutputKind",
    "PLOT_DIRECTORY",
    "PNG",
    "RECORD_LINE_LIMIT",
    "RecordAppender",
    "WEIGHTS",
    "atomic_write_bytes",
    "atomic_write_with",
    "check_output",
    "check_outputs",
    "dump_stage_header",
    "foreign_entries",
    "metrics_line",
    "png_metadata",
    "prepare_ir_dump",
    "remove_stale_temporaries",
    "replace_directory",
    "safetensors_metadata",
    "temporary_prefix",
]

_TEMPORARY_TAG = ".harts-tmp-"


def temporary_prefix(target: Path) -> str:
    """The name prefix of every temporary that a write of ``target`` creates beside it."""
    return f".{target.name}{_TEMPORARY_TAG}"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_directory(directory: Path) -> None:
    try:
        handle = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        pass
    finally:
        os.close(handle)


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists, owned by someone else; anything else: assume it runs
        return True
    return True


def remove_stale_temporaries(target: Path) -> list[Path]:
    """Remove temporaries of ``target`` left by writers that no longer run; returns what was removed."""
    prefix = temporary_prefix(target)
    removed = []
    try:
        entries = list(target.parent.iterdir())
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(prefix):
            continue
        pid_text = entry.name[len(prefix) :].split("-", 1)[0]
        if not pid_text.isdigit() or _process_alive(int(pid_text)):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry)
        logger.info("removed %s, left by an interrupted write of %s", entry, target)
    return removed


def _new_temporary(target: Path) -> Path:
    return target.parent / f"{temporary_prefix(target)}{os.getpid()}-{secrets.token_hex(4)}"


def atomic_write_with(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Call ``write(temporary)`` to produce the file, then move it over ``path`` in one step."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_dir():
        raise IsADirectoryError(errno.EISDIR, "a directory of that name exists", str(path))
    remove_stale_temporaries(path)
    temporary = _new_temporary(path)
    try:
        write(temporary)
        with open(temporary, "rb+") as written:
            os.fsync(written.fileno())
        os.chmod(temporary, 0o666 & ~_umask())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)
    return path


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (see the module docstring)."""
    return atomic_write_with(path, lambda temporary: temporary.write_bytes(data))


def _exchange(first: Path, second: Path) -> bool:
    """Atomically swap two existing paths; False when the platform or filesystem cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return False
    if sys.platform.startswith("linux") and hasattr(libc, "renameat2"):
        at_fdcwd, rename_exchange = -100, 2
        result = libc.renameat2(at_fdcwd, os.fsencode(first), at_fdcwd, os.fsencode(second), rename_exchange)
    elif sys.platform == "darwin" and hasattr(libc, "renamex_np"):
        rename_swap = 0x2
        result = libc.renamex_np(os.fsencode(first), os.fsencode(second), rename_swap)
    else:
        return False
    if result == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(second))


def foreign_entries(path: Path, allowed: frozenset[str] | set[str], what: str) -> tuple[str | None, list[str]]:
    """First check of an ``is_ours`` test: (reason ``path`` is not ours, or None; the names it holds).

    A symlink or a non-directory is not ours; a directory holding names outside ``allowed`` is
    not ``what`` (the reason lists them); an empty directory is ours. The caller inspects the
    allowed files it finds.
    """
    if path.is_symlink() or not path.is_dir():
        return "it is not a directory", []
    names = sorted(entry.name for entry in path.iterdir())
    foreign = [name for name in names if name not in allowed]
    if foreign:
        shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
        return f"it holds files that are not part of {what} ({shown})", names
    return None, names


def _swap_in(staging: Path, path: Path, is_ours: Callable[[Path], bool]) -> None:
    """Move the staged directory to ``path``: a rename when ``path`` is new, else an exchange with the old one.

    Another writer may create ``path`` between our look and our rename (two first saves of one
    plan at once): the rename then fails with ENOTEMPTY or EEXIST, and that writer's directory
    is replaced like any existing target, if it is ours.
    """
    if not path.exists():
        try:
            os.rename(staging, path)
            return
        except OSError as error:
            if error.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not path.is_dir():
                raise
        if not is_ours(path):
            raise FileExistsError(errno.EEXIST, "appeared while saving and is not ours to replace", str(path))
    if _exchange(staging, path):
        shutil.rmtree(staging, ignore_errors=True)  # now holds the old artifact
        return
    logger.warning("%s: this filesystem cannot swap directories atomically; replacing it in two renames", path)
    retired = _new_temporary(path)
    os.rename(path, retired)
    os.rename(staging, path)
    shutil.rmtree(retired, ignore_errors=True)


def replace_directory(path: str | os.PathLike, files: dict[str, bytes], is_ours: Callable[[Path], bool]) -> Path:
    """Write ``files`` as the directory ``path``; an existing ``path`` is replaced only if ``is_ours(path)``.

    The new directory is staged beside the target and swapped in atomically; the old one is
    removed after the swap. Raises ``FileExistsError`` when ``path`` exists and is not ours.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if (path.exists() or path.is_symlink()) and not is_ours(path):
        raise FileExistsError(errno.EEXIST, "exists and is not ours to replace", str(path))
    remove_stale_temporaries(path)
    staging = _new_temporary(path)
    staging.mkdir(mode=0o777)  # the umask applies, as for a plain mkdir
    try:
        file_mode = 0o666 & ~_umask()
        for name, data in files.items():
            target = staging / name
            with open(target, "wb") as stream:
                stream.write(data)
                stream.flush()
                os.fsync(stream.fileno())
            os.chmod(target, file_mode)
        _fsync_directory(staging)
        _swap_in(staging, path, is_ours)
    except BaseException:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
        raise
    _fsync_directory(path.parent)
    return path


# ----------------------------------------------------------------------------- output ownership


@attrs.frozen
class OutputKind:
    """One kind of artifact HARTS writes, and how to recognise one that HARTS wrote.

    ``why_not_ours(path)`` is called on an existing target of the right type (a regular file,
    or a directory when ``is_directory``) and returns None when HARTS wrote it, else the reason.
    """

    description: str  # what HARTS would have to find there: "a HARTS metrics file"
    noun: str  # what is being written, for messages without an option: "the metrics"
    is_directory: bool
    why_not_ours: Callable[[Path], str | None] = attrs.field(repr=False)


#: Key of the HARTS marker in the metadata of the safetensors and PNG files HARTS writes.
ARTIFACT_KEY = "harts_artifact"
#: Key every metrics record HARTS appends starts with (its value: the HARTS version).
METRICS_MARKER = "harts_metrics"
_METRICS_PREFIX = ('{"' + METRICS_MARKER + '":').encode()
#: The longest line a metrics record or a node table's schema record may plausibly be; a longer
#: first line (a binary file, a huge user record) is not ours, and is not read further.
RECORD_LINE_LIMIT = 1 << 20
_DUMP_HEADER = "// harts --dump-ir stage "
_DUMP_STAGE_NAME = re.compile(r"\d{3}_[A-Za-z0-9][A-Za-z0-9_.-]*\.txt")


def png_metadata(what: str) -> dict[str, str]:
    """PNG text chunks that mark a figure as drawn by HARTS (pass as ``savefig(metadata=...)``)."""
    return {ARTIFACT_KEY: f"{what}, harts {__version__}"}


def metrics_line(record: dict) -> bytes:
    """One metrics record as HARTS appends it: the marker first, then the record's keys in order, one line."""
    marked = {METRICS_MARKER: __version__, **{key: record[key] for key in sorted(record)}}
    return (json.dumps(marked) + "\n").encode()


def dump_stage_header(index: int, name: str) -> str:
    """First line of an IR dump stage file (an IR comment): what marks the file as one HARTS wrote."""
    return f"{_DUMP_HEADER}{index:03d} after {name}, harts {__version__}\n"


def safetensors_metadata(path: Path) -> dict[str, str] | None:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="numpy") as handle:
            return dict(handle.metadata() or {})
    except Exception:  # safetensors raises several types for files that are not its own
        return None


def _weights_reason(path: Path) -> str | None:
    metadata = safetensors_metadata(path)
    if metadata is None:
        return "it is not a safetensors file"
    if metadata.get(ARTIFACT_KEY) != "weights":
        return "its metadata carries no HARTS weights marker"
    return None


def _png_reason(path: Path) -> str | None:
    from PIL import Image

    try:
        with Image.open(path, formats=["PNG"]) as image:
            marker = image.info.get(ARTIFACT_KEY)
    except Exception:  # Pillow raises several types for files that are not PNG images
        return "it is not a PNG image"
    if not (isinstance(marker, str) and ", harts " in marker):
        return "it carries no HARTS marker in its metadata"
    return None


def _metrics_reason(path: Path) -> str | None:
    """None for an empty file or one whose every line starts with the HARTS marker.

    A line may be the fragment of a record that a killed run was writing (the appender starts the
    next record on a new line), so the marker at the start of the line is what is checked.
    """
    with open(path, "rb") as handle:
        for number in itertools.count(1):
            line = handle.readline(RECORD_LINE_LIMIT)
            if not line:
                return None
            if not line.startswith(_METRICS_PREFIX):
                return f"line {number} is not a metrics record HARTS wrote"
            if len(line) == RECORD_LINE_LIMIT and not line.endswith(b"\n"):
                return f"line {number} is longer than any metrics record HARTS writes"
    return None  # unreachable: itertools.count never ends


def _is_dump_stage(entry: Path) -> bool:
    if not _DUMP_STAGE_NAME.fullmatch(entry.name) or entry.is_symlink() or not entry.is_file():
        return False
    try:
        with open(entry, "rb") as handle:
            return handle.readline(200).startswith(_DUMP_HEADER.encode())
    except OSError:
        return False


def _is_dump_temporary(entry: Path) -> bool:
    stage, tag, _ = entry.name[1:].partition(_TEMPORARY_TAG)
    return entry.name.startswith(".") and bool(tag) and _DUMP_STAGE_NAME.fullmatch(stage) is not None


def _ir_dump_reason(path: Path) -> str | None:
    foreign = sorted(e.name for e in path.iterdir() if not (_is_dump_stage(e) or _is_dump_temporary(e)))
    if foreign:
        shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
        return f"it also holds {shown}"
    return None


WEIGHTS = OutputKind("a weights file HARTS wrote", "the weights", False, _weights_reason)
METRICS = OutputKind("a HARTS metrics file", "the metrics", False, _metrics_reason)
PNG = OutputKind("a figure HARTS drew", "the figure", False, _png_reason)
IR_DUMP = OutputKind("an IR dump HARTS wrote", "the IR dump", True, _ir_dump_reason)
IR_DUMP_STAGE = OutputKind("a stage of an IR dump HARTS wrote", "the IR stage", False,
                           lambda path: None if _is_dump_stage(path) else "it does not start with the HARTS dump header")
#: A directory figures are written into: any directory will do; each figure in it is checked as a :data:`PNG`.
PLOT_DIRECTORY = OutputKind("a directory", "the figures", True, lambda path: None)


def _refusal(option: str | None, kind: OutputKind, path: Path, reason: str) -> OutputError:
    where = f"{option} {path}" if option else f"cannot write {kind.noun} to {path}"
    return OutputError(f"{where}: {reason}; it was left untouched: choose another path or remove it yourself")


def _blocking_ancestor(path: Path) -> Path | None:
    """The nearest existing ancestor of ``path`` when it is not a directory (nothing can be created below it)."""
    for ancestor in path.parents:
        if os.path.lexists(ancestor):
            return None if ancestor.is_dir() else ancestor
    return None


def check_output(path: str | os.PathLike, kind: OutputKind, *, option: str | None = None) -> Path:
    """Raise :class:`~harts.errors.OutputError` (naming ``option`` and ``path``) unless HARTS may write ``path``.

    HARTS may write a path that does not exist yet (below directories, or places where they can be
    created) or that holds ``kind`` as HARTS wrote it. A symbolic link is never ours: replacing it
    would change what the user's link is.
    """
    path = Path(path)
    blocker = _blocking_ancestor(path)
    if blocker is not None:
        raise _refusal(option, kind, path, f"{blocker} is not a directory")
    if path.is_symlink():
        raise _refusal(option, kind, path, "it is a symbolic link, which HARTS does not replace")
    if not path.exists():
        return path
    if kind.is_directory and not path.is_dir():
        raise _refusal(option, kind, path, "it exists and is not a directory")
    if not kind.is_directory and path.is_dir():
        raise _refusal(option, kind, path, "it is a directory; name a file")
    if not kind.is_directory and not path.is_file():
        raise _refusal(option, kind, path, "it is not a regular file")
    try:
        reason = kind.why_not_ours(path)
    except OSError as error:
        reason = f"it cannot be read ({error.strerror or error})"
    if reason is not None:
        raise _refusal(option, kind, path, f"it exists and is not {kind.description} ({reason})")
    return path


def _real(path: Path) -> str:
    return os.path.realpath(path)


def _same_file(first: Path, second: Path) -> bool:
    """One file or directory under two names: the same resolved path, or (hard links) the same inode."""
    if _real(first) == _real(second):
        return True
    try:
        return os.path.samefile(first, second)
    except OSError:  # one does not exist: only the resolved paths could have matched
        return False


def _inside(inner: Path, outer: Path) -> bool:
    return _real(inner).startswith(_real(outer).rstrip(os.sep) + os.sep)


def _overlap(first: Path, second: Path) -> str | None:
    """How writing ``first`` would touch ``second``: None, or how the two paths meet (for a message)."""
    if _same_file(first, second):
        return f"that is {second}"
    if _inside(second, first):
        return f"it holds {second}"
    if _inside(first, second):
        return f"it is inside {second}"
    return None


def check_outputs(outputs: Iterable[tuple[str, str | os.PathLike | None, OutputKind]],
                  inputs: Iterable[str | os.PathLike | None] = ()) -> None:
    """The ownership rule for one run: each ``(option, path, kind)`` output (path None: not asked for) must pass
    :func:`check_output`, must not be, hold or lie inside an input, and must not overlap another output."""
    named = [(option, Path(path), kind) for option, path, kind in outputs if path is not None]
    sources = [Path(source) for source in inputs if source is not None and os.path.lexists(source)]
    for option, path, kind in named:
        for source in sources:
            relation = _overlap(path, source)
            if relation is not None:
                raise OutputError(f"{option} {path}: {relation}, an input of this run; it was left untouched: "
                                  "choose another path")
        check_output(path, kind, option=option)
    for (first, first_path, _), (second, second_path, _) in itertools.combinations(named, 2):
        if _overlap(first_path, second_path) is not None:
            raise OutputError(f"{first} {first_path} and {second} {second_path} would write over each other; "
                              "give each output its own path")


def prepare_ir_dump(directory: str | os.PathLike, *, option: str | None = None) -> Path:
    """Make ``directory`` ready for a new IR dump: refuse it unless new, empty or an earlier HARTS dump, then
    remove the earlier dump's stages, so that none of them is left beside the new ones."""
    directory = check_output(directory, IR_DUMP, option=option)
    directory.mkdir(parents=True, exist_ok=True)
    for entry in directory.iterdir():
        if _is_dump_stage(entry):
            entry.unlink(missing_ok=True)
    return directory


class RecordAppender:
    """Appends newline-terminated records to a file, each whole or not at all.

    Each record goes out in one ``write`` on an ``O_APPEND`` descriptor. When the write falls short
    (a file-size limit, a full disk) or fails, the file is truncated back to its length before
    the record, so no half record is left for the next run's record to be glued onto; the error
    names ``option`` and the path. A file that does not end in a newline (a record cut by a killed
    run) gets one before the next record.
    """

    def __init__(self, path: str | os.PathLike, kind: OutputKind, *, option: str | None = None) -> None:
        self.path = check_output(path, kind, option=option)
        self.where = f"{option} {self.path}" if option else f"{kind.noun} file {self.path}"
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._handle: int | None = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC,
                                               0o666)
        except OSError as error:
            raise OutputError(f"{self.where}: {error.strerror or error}") from error

    def append(self, record: bytes) -> None:
        handle = self._handle
        if handle is None:
            raise ValueError(f"{self.path} is closed")
        before = os.fstat(handle).st_size
        data = record if record.endswith(b"\n") else record + b"\n"
        if before and os.pread(handle, 1, before - 1) != b"\n":
            data = b"\n" + data
        try:
            written = os.write(handle, data)
            if written != len(data):
                raise OSError(errno.EFBIG, f"only {written} of the record's {len(data)} bytes fit "
                                           "(a file-size limit or a full disk)")
            os.fsync(handle)
        except OSError as error:
            self._cut_back(before)
            raise OutputError(f"{self.where}: cannot append a record ({error.strerror or error}); "
                              "the file was cut back to its last whole record") from error

    def _cut_back(self, length: int) -> None:
        try:
            os.ftruncate(self._handle, length)
        except OSError as error:  # the append's own error is the one to report
            logger.error("%s: could not cut a partial record back off (%s)", self.path, error.strerror or error)

    def close(self) -> None:
        if self._handle is not None:
            os.close(self._handle)
            self._handle = None
