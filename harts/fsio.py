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
  check before anything is written: nothing the user did not hand us is deleted.

Hand-written because neither the standard library nor the project's dependencies offer an
atomic directory swap or stale-temporary recovery.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import secrets
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

__all__ = [
    "atomic_write_bytes",
    "atomic_write_with",
    "foreign_entries",
    "replace_directory",
    "remove_stale_temporaries",
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
