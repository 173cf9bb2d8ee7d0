"""File-system helpers every room shares, written once.

Replacing a file atomically (temp file, rename, optionally fsync), appending
one line to a log, and creating private folders. Run folders and logs can hold
prompts and secrets, so whatever kandevd creates is private (0700 folders,
0600 files).
"""

from __future__ import annotations

import fcntl
import json
import os
import stat
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def ensure_dir(path: Path) -> Path:
    """Create ``path`` and every missing parent with mode 0700; existing ones stay as they are.

    ``Path.mkdir(parents=True, mode=...)`` applies the mode to the leaf only.
    NotADirectoryError when ``path`` exists and is not a folder.
    """
    try:  # (the usual cases, once per execution: it exists; or only its leaf is missing)
        if stat.S_ISDIR(os.stat(path).st_mode):
            return path
    except FileNotFoundError:
        try:
            os.mkdir(path, 0o700)
            return path
        except OSError:
            pass
    except OSError:
        pass
    missing: list[Path] = []
    current = path
    while not current.exists():
        missing.append(current)
        if current.parent == current:
            break
        current = current.parent
    for folder in reversed(missing):
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            pass
    if not path.is_dir():
        raise NotADirectoryError(f"not a directory: {path}")
    return path


#: ``FS_IOC_GETFLAGS``, ``FS_IOC_SETFLAGS`` and ``FS_TOPDIR_FL`` (linux/fs.h).
_GET_FLAGS, _SET_FLAGS, _TOP_DIR = 0x80086601, 0x40086602, 0x00020000


def make_spread_dirs(parent: Path, names: Iterable[str]) -> bool:
    """Create the folders ``names`` missing in ``parent`` (0700), spread over the
    disk by the file system; whether ``parent`` carries the mark that spreads them.

    Why: ext4 without a journal gives out a new inode only after skipping, one
    by one, every inode of the block group freed in the last minute (six
    minutes while the group's inode table is dirty). Run folders and logs made
    in the group where a deleted home's files were (the same folder names land
    in the same place) paid 1 to 3 ms of system time a run (docs/benchmarks.md,
    "The run path, fourth round"). So ``parent`` is marked the top of a
    hierarchy (``chattr +T``: ext4 then places each new folder in it in a
    little-used group, searching from a hash of its name) and each folder is
    first made under a random name, then renamed into place. Where the mark is
    refused (tmpfs, other file systems) the folders are simply made. Errors are
    left to ``ensure_dir``, and no spare folder is left behind.
    """
    missing = [name for name in names if not os.path.lexists(parent / name)]
    if not missing:
        return _top_mark(parent, add=False)
    marked = _top_mark(parent, add=True)
    for name in missing:
        spare = parent / f".{name}.{os.urandom(6).hex()}"
        try:
            os.mkdir(spare, 0o700)
        except OSError:
            continue
        try:
            os.rename(spare, parent / name)  # (onto an empty folder made meanwhile: fine)
        except OSError:
            _remove_empty(spare)
        except BaseException:
            _remove_empty(spare)
            raise
    return marked


def _top_mark(folder: Path, *, add: bool) -> bool:
    """Does ``folder`` carry the top-of-hierarchy mark (after adding it, with ``add``)?
    False where the file system has no such mark or refuses it."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        flags = bytearray(8)  # (the kernel reads and writes an int of it)
        fcntl.ioctl(fd, _GET_FLAGS, flags, True)
        value = int.from_bytes(flags[:4], sys.byteorder)
        if value & _TOP_DIR or not add:
            return bool(value & _TOP_DIR)
        fcntl.ioctl(fd, _SET_FLAGS, (value | _TOP_DIR).to_bytes(4, sys.byteorder) + bytes(4))
        return True
    except OSError:
        return False  # not ext4 (or not allowed): the folders are made where they fall
    finally:
        os.close(fd)


def _remove_empty(folder: Path) -> None:
    try:
        os.rmdir(folder)
    except OSError:
        pass


def make_dir(path: Path) -> Path:
    """``ensure_dir`` for a folder that is usually new (a run's): one ``mkdir`` when
    its parent is there, no ``stat`` first."""
    try:
        os.mkdir(path, 0o700)
        return path
    except OSError:
        return ensure_dir(path)  # (there already, or a parent missing: the long way)


def fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable (best effort: not every file system can)."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def replace_atomically(path: Path, text: str, *, durable: bool, mode: int | None = 0o600,
                       unique_temp: bool = False) -> None:
    """Replace ``path`` with ``text`` so a reader (or a crash) sees the old or the new file.

    ``durable``: fsync the file before the rename and the folder after it (a
    file that must survive a power cut). ``mode`` None keeps an existing
    file's permission bits (a new one is 0600). ``unique_temp``: a temp name
    of its own per call, for files several processes may replace at once;
    else ``.<name>.tmp`` beside it (no random name per write).
    """
    folder = path.parent
    if mode is None:
        try:
            mode = os.stat(path).st_mode & 0o7777
        except OSError:
            mode = 0o600
    try:
        if unique_temp:
            fd, temp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
            temp = Path(temp_name)
            os.fchmod(fd, mode)
        else:
            temp = folder / f".{path.name}.tmp"
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    except OSError as exc:
        raise naming(exc, path) from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            if durable:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException as exc:
        try:
            os.unlink(temp)
        except OSError:
            pass
        if isinstance(exc, OSError):
            raise naming(exc, path) from None
        raise
    if durable:
        fsync_dir(folder)


def naming(exc: OSError, path: Path) -> OSError:
    """``exc`` as an OSError of the same errno that names ``path``, the file that could not
    be written (a write on a descriptor, or to a temp file, names none or the wrong one),
    so whoever reports it says which file (a full disk: "No space left on device")."""
    if exc.errno is None:
        return exc
    return OSError(exc.errno, exc.strerror or str(exc), str(path))


def write_json(path: Path, document: Any, *, durable: bool) -> None:
    """``document`` as JSON in ``path``, replaced atomically (see above)."""
    replace_atomically(path, json.dumps(document), durable=durable)


def append_line(path: Path, text: str) -> None:
    """Append ``text`` and a newline to ``path`` (0600 when created) in one write.

    One ``write`` on an ``O_APPEND`` descriptor, so lines of writers side by
    side never interleave. Raises OSError.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, (text + "\n").encode())
    finally:
        os.close(fd)


def append_note(path: Path, text: str) -> None:
    """``[kandevd] <text>`` in an execution's log; best effort (a note is never worth an
    error of its own)."""
    try:
        append_line(path, f"[kandevd] {text}")
    except OSError:
        pass
