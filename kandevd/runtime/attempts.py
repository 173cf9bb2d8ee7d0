"""The attempt folder: where an execution that may outlive the daemon keeps its record.

This module is the folder's one owner: its name, its files, taking one for
a new attempt, the outcome the daemon writes there, and emptying, parking,
pruning and removing it. Each claim of a run (one attempt, fenced by its
claim token) gets ``<home>/attempts/<run_id>.<token>/``, outside the agent's
working folder::

    record.json   which process runs the agent, until when (records.py)
    exit          the agent's status, written by its shim (shim.py)
    stdout        the agent's stdout until it is merged into the log
    summary.json  the summary taken from stdout just before that merge
    outcome.json  an outcome the exit file cannot tell (a timeout, a stop, an
                  error of ours), written before the database hears of it

So neither a failed database write nor a daemon that dies a moment later
loses an outcome. Once the database has it, the folder is emptied and
parked (``.free-<random>``) for the next attempt, which renames it to its own
name: a drain creates and frees no inode here (on ext4 without a journal a
new inode is searched for past every one freed in the last minute). The
stdout file is never reused (a process the agent left may still write to
it): it is kept, empty, beside the folder as ``<folder>.stdout`` until
retention removes the run. Empty files are no record, no status and no
summary for every reader. See docs/reliability.md.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kandevd.fsutil import ensure_dir, write_json
from kandevd.paths import ATTEMPTS_FOLDER
from kandevd.runtime.execution import OUTCOMES, ExecutionResult
from kandevd.runtime.output import reported_cost
from kandevd.timeutil import parse_rfc3339, rfc3339

log = logging.getLogger("kandevd.queue.journal")

RECORD_FILE = "record.json"
EXIT_FILE = "exit"
#: The agent's stdout while it runs (appended to the log when it ended).
STDOUT_FILE = "stdout"
#: The summary taken from the stdout file before it is merged into the log.
SUMMARY_FILE = "summary.json"
OUTCOME_FILE = "outcome.json"
#: What an attempt's folder normally holds.
ATTEMPT_FILES = (OUTCOME_FILE, RECORD_FILE, EXIT_FILE, STDOUT_FILE, SUMMARY_FILE)

#: Name prefix of a parked folder (hidden, and never a run id: those hold no dot).
FREE_PREFIX = ".free-"
#: The files a parked folder keeps, empty (written again only by the daemon and the shim).
KEPT_FILES = (RECORD_FILE, EXIT_FILE, SUMMARY_FILE)
#: The files it loses: the agent's stdout (normally moved out already) and an outcome the
#: queue wrote before recording it (rare).
REMOVED_FILES = (STDOUT_FILE, OUTCOME_FILE)
#: Name suffix of an attempt's spent stdout file, kept beside the attempt folders.
SPENT_SUFFIX = ".stdout"
#: Free folders kept per parent folder at most.
LIMIT = 256


# -- names --------------------------------------------------------------------------------

def attempt_dir(attempts: Path, run_id: str, token: str) -> Path:
    """The folder of one attempt (claim ``token``) of run ``run_id``.

    One level (``<run_id>.<token>``), so an execution costs one mkdir, not two.
    (Run ids hold no dot, so the name splits back at its first one.)
    """
    return attempts / f"{run_id}.{token}"


def legacy_attempt_dir(attempts: Path, run_id: str, token: str) -> Path:
    """Where a daemon before the one-level layout kept the attempt (``<run_id>/<token>``)."""
    return attempts / run_id / token


def existing_attempt_dir(attempts: Path, run_id: str, token: str) -> Path:
    """The attempt's folder as it is on disk: the current layout, else the legacy one."""
    current = attempt_dir(attempts, run_id, token)
    if (current / RECORD_FILE).exists():
        return current
    legacy = legacy_attempt_dir(attempts, run_id, token)
    if (legacy / RECORD_FILE).exists() or (legacy.is_dir() and not current.is_dir()):
        return legacy
    return current


def spent_stdout_path(record_dir: Path) -> Path:
    """Where the stdout file of the attempt in ``record_dir`` is kept, emptied, once merged."""
    return record_dir.with_name(record_dir.name + SPENT_SUFFIX)


def is_free(name: str) -> bool:
    """Is ``name`` (an entry of the attempts folder) a parked free folder?"""
    return name.startswith(FREE_PREFIX)


# -- a new attempt --------------------------------------------------------------------------

def prepare(directory: Path) -> None:
    """The folder of a new attempt: a parked one renamed to it, else a new one; empty.

    Files found there are not this attempt's: a parked folder was emptied when
    it was parked, and is emptied again (a power cut may have lost that), as is
    any folder already there. No file is created. Raises OSError.
    """
    if not pool_for(directory.parent).take(directory):
        ensure_dir(directory)
    empty(directory)


def empty(directory: Path, remove: Iterable[str] = REMOVED_FILES) -> None:
    """Truncate the kept files of ``directory`` and unlink ``remove`` (absent ones skipped)."""
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


# -- the daemon's outcome -----------------------------------------------------------------

def write_outcome(directory: Path, result: ExecutionResult) -> bool:
    """Persist ``result`` durably in the folder; False when the disk refused."""
    document = {
        "outcome": result.outcome, "exit_code": result.exit_code, "summary": result.summary,
        "cost_cents": result.cost_cents, "error": result.error,
        "started_at": rfc3339(result.started_at), "ended_at": rfc3339(result.ended_at),
        "log_path": str(result.log_path), "evaluation": result.evaluation,
    }
    try:
        ensure_dir(directory)
        write_json(directory / OUTCOME_FILE, document, durable=True)
    except OSError as exc:
        log.error("cannot write the outcome file in %s (%s); the outcome is kept in memory",
                  directory, exc)
        return False
    return True


def has_outcome(directory: Path) -> bool:
    return (directory / OUTCOME_FILE).exists()


def read_outcome(directory: Path, key: str) -> ExecutionResult | None:
    """The outcome written by :func:`write_outcome`, or None (absent or unreadable)."""
    path = directory / OUTCOME_FILE
    try:
        document: Any = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("outcome file %s cannot be read (%s); ignored", path, exc)
        return None
    try:
        if document["outcome"] not in OUTCOMES:
            raise ValueError(f"unknown outcome {document['outcome']!r}")
        cost = document.get("cost_cents")
        return ExecutionResult(
            key=key, outcome=document["outcome"], exit_code=document.get("exit_code"),
            summary=document.get("summary"),
            cost_cents=reported_cost(cost),
            error=document.get("error"), started_at=parse_rfc3339(document["started_at"]),
            ended_at=parse_rfc3339(document["ended_at"]), log_path=Path(document["log_path"]),
            evaluation=evaluation if isinstance(evaluation := document.get("evaluation"), dict)
            else None)
    except (KeyError, TypeError, ValueError) as exc:
        log.warning("outcome file %s is malformed (%s); ignored", path, exc)
        return None


# -- after the outcome is recorded ----------------------------------------------------------

def discard(directory: Path) -> None:
    """Recycle, else remove, an attempt's folder once the database holds its outcome.

    Recycled: emptied and parked for a later execution (no inode freed). Else
    the files it normally holds are unlinked by name (no directory walk);
    only a folder that still holds something else is removed recursively.
    """
    # Only a folder of the current layout: a legacy one's parent is its run's folder.
    if directory.parent.name == ATTEMPTS_FOLDER and pool_for(directory.parent).put(directory):
        return
    for name in ATTEMPT_FILES:
        try:
            os.unlink(directory / name)
        except FileNotFoundError:
            pass
        except OSError:
            break
    try:
        directory.rmdir()
    except FileNotFoundError:
        pass
    except OSError:
        shutil.rmtree(directory, ignore_errors=True)


def prune(attempts: Path, current: dict[str, str]) -> int:
    """Remove attempt folders that are not a run's current claim; how many went.

    ``current`` maps each claimed run to its claim token. Folders of attempts
    that were rescued, superseded or settled while the daemon died between the
    database write and :func:`discard` are left over otherwise.
    """
    removed = 0
    try:
        entries = list(os.scandir(attempts))
    except OSError:
        return 0
    for entry in entries:
        if is_free(entry.name):
            continue  # a parked folder, empty: the next execution's
        run_id, dot, token = entry.name.partition(".")
        if dot:
            # (A file here is an attempt's spent stdout, removed with its run by retention.)
            if current.get(run_id) != token and entry.is_dir(follow_symlinks=False):
                discard(Path(entry.path))
                removed += 1
            continue
        # A run's folder of the legacy two-level layout: its attempts inside.
        try:
            tokens = list(os.scandir(entry.path))
        except OSError:
            continue
        for legacy in tokens:
            if legacy.name.endswith(SPENT_SUFFIX):
                continue  # an attempt's spent stdout: removed with the run (retention)
            if current.get(entry.name) != legacy.name:
                discard(Path(legacy.path))
                removed += 1
        try:
            os.rmdir(entry.path)
        except OSError:
            pass
    return removed


def of_run(attempts: Path, run_id: str) -> list[Path]:
    """Every attempt folder and spent stdout file of ``run_id`` (retention removes them)."""
    return [attempts / run_id, *attempts.glob(f"{run_id}.*")]


# -- the pool of parked folders -------------------------------------------------------------

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
