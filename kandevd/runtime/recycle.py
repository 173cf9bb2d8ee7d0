"""Attempt folders are recycled: emptied and parked, not deleted and created again.

Every execution of a queued run has a record folder (``attempts/<run>.<token>/``)
holding ``record.json`` and the shim's ``exit`` and ``stdout``. Creating those
inodes and deleting them again after the outcome is recorded was the
dearest part of an execution: on ext4 without a journal, a new inode is
searched for past every inode freed in the last minute
(``recently_deleted``), so at a few hundred executions a second each
``mkdir`` and ``open(O_CREAT)`` cost hundreds of microseconds of CPU. With
recycling, the folder, ``record.json`` and ``exit`` are neither created nor
freed by a drain.

How: once the database holds an outcome, :meth:`FolderPool.put` empties the
folder (``record.json``, ``exit`` and ``summary.json`` truncated, anything
else it holds removed) and renames it to ``.free-<random>``; a new execution's
:meth:`FolderPool.take` renames a free folder to its own name, and the
runner empties it once more before anything else (a parked folder whose
emptying a power cut lost must not speak for the new attempt). The
``stdout`` file is never reused: a process the agent left behind (outside
its process group) may still hold it open and write on, and must write into
a file nobody reads, not into the next attempt's output. Nor is it freed:
once merged into the log it is emptied and kept beside the folder as
``<run>.<token>.stdout`` (:func:`spent_stdout_path`), a few bytes of inode
until retention removes it with its run, so a drain frees no inode at all
(each new inode would otherwise be searched for past every one freed in the
last minute). An empty record is
no record and an empty exit file no status, for every reader; a restart also
checks that a record names the run it is read for. A crash at any point
leaves either a folder of a settled attempt (removed or recycled by the
journal's pruning later) or an empty free one (reused by the next daemon of
the home, which finds it at its first take).

The pool is per parent folder and process-wide; it keeps at most
:data:`LIMIT` free folders (a few empty files each) and beyond that the
caller removes the folder as before.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable
from pathlib import Path

from kandevd.runtime.shim import EXIT_FILE, OUTCOME_FILE, RECORD_FILE, STDOUT_FILE, SUMMARY_FILE

log = logging.getLogger("kandevd.runtime.recycle")

#: Name prefix of a parked folder (hidden, and never a run id: those hold no dot).
FREE_PREFIX = ".free-"
#: The files a parked folder keeps, empty (written again only by the daemon and the shim;
#: an empty one is no record, no status and no summary).
KEPT_FILES = (RECORD_FILE, EXIT_FILE, SUMMARY_FILE)
#: The files it loses: the agent's stdout (see above; normally moved out already) and an
#: outcome the queue wrote before recording it (rare: written when the exit file cannot tell).
REMOVED_FILES = (STDOUT_FILE, OUTCOME_FILE)
#: Name suffix of an attempt's spent stdout file, kept beside the attempt folders.
SPENT_SUFFIX = ".stdout"
#: Free folders kept per parent folder at most.
LIMIT = 256


def spent_stdout_path(record_dir: Path) -> Path:
    """Where the stdout file of the attempt in ``record_dir`` is kept, emptied, once merged.

    Beside the folder (``<folder>.stdout``), outside it: the folder is parked for
    another attempt, the spent file never is.
    """
    return record_dir.with_name(record_dir.name + SPENT_SUFFIX)


def is_free(name: str) -> bool:
    """Is ``name`` (an entry of the attempts folder) a parked free folder?"""
    return name.startswith(FREE_PREFIX)


def empty(directory: Path, remove: Iterable[str] = REMOVED_FILES) -> None:
    """Truncate the kept files of ``directory`` and unlink ``remove`` (absent ones skipped).

    No file is created. OSError (other than a missing file) goes to the caller.
    """
    base = os.fspath(directory)
    for name in remove:
        try:
            os.unlink(f"{base}/{name}")
        except FileNotFoundError:
            pass
    for name in KEPT_FILES:
        try:
            os.truncate(f"{base}/{name}", 0)
        except FileNotFoundError:
            pass


class FolderPool:
    """The free folders of one parent folder."""

    def __init__(self, parent: Path) -> None:
        self.parent = parent
        self._lock = threading.Lock()
        self._free: list[str] | None = None  # found on first use

    def _names(self) -> list[str]:
        if self._free is None:
            try:
                self._free = [entry.name for entry in os.scandir(self.parent)
                              if is_free(entry.name) and entry.is_dir(follow_symlinks=False)]
            except OSError:
                self._free = []
        return self._free

    def put(self, directory: Path) -> bool:
        """Empty ``directory`` and park it; False when the caller must remove it instead."""
        with self._lock:
            if len(self._names()) >= LIMIT:
                return False
        try:
            empty(directory)
            free = FREE_PREFIX + os.urandom(8).hex()
            os.rename(directory, self.parent / free)
        except OSError as exc:
            log.debug("attempt folder %s not recycled (%s)", directory, exc)
            return False
        with self._lock:
            self._names().append(free)
        return True

    def take(self, target: Path) -> bool:
        """Rename a free folder to ``target`` (absent); False when there is none to take."""
        while True:
            with self._lock:
                names = self._names()
                if not names:
                    return False
                free = names.pop()
            try:
                os.rename(self.parent / free, target)
            except FileNotFoundError:
                continue  # gone meanwhile: try the next one
            except OSError as exc:  # the target exists (and is not empty), ...
                log.debug("free folder %s not taken for %s (%s)", free, target, exc)
                with self._lock:
                    self._names().append(free)
                return False
            return True


_pools: dict[Path, FolderPool] = {}
_pools_lock = threading.Lock()


def pool_for(parent: Path) -> FolderPool:
    """The process-wide pool of ``parent``."""
    with _pools_lock:
        pool = _pools.get(parent)
        if pool is None:
            pool = _pools[parent] = FolderPool(parent)
        return pool
