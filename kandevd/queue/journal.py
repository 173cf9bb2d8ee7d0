"""The attempt journal: what an execution of a run leaves on disk for its outcome.

Each claim of a run (one attempt, fenced by its claim token) gets a folder
``<home>/attempts/<run_id>.<token>/``, outside the agent's working folder (an
agent that cleans or commits its folder must not touch it). The agent's shim writes there
``record.json`` (which process runs it, until when) and ``exit`` (how it
ended); the queue writes ``outcome.json`` there *before* it tries to record
the outcome in the database. So neither a failed database write nor a
daemon that dies a moment later loses an outcome: the next attempt to record
it, or the next start of the daemon, finds it on disk instead of running the
agent again. Once the database has the outcome, the folder is emptied and
parked for the next execution (:mod:`kandevd.runtime.recycle`), or removed.
The agent's stdout file, merged into the run's log by then, stays beside it,
empty, as ``<run_id>.<token>.stdout`` until retention removes the run.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from kandevd.fsutil import ensure_dir, write_json
from kandevd.paths import ATTEMPTS_FOLDER, HomeLayout
from kandevd.runtime import FAILED, OUTCOMES, SUCCEEDED, ExecutionResult
from kandevd.runtime.records import read_exit_status, read_record
from kandevd.runtime.recycle import SPENT_SUFFIX, is_free, pool_for
from kandevd.runtime.shim import EXIT_FILE, OUTCOME_FILE, RECORD_FILE, STDOUT_FILE, SUMMARY_FILE
from kandevd.timeutil import parse_rfc3339, rfc3339

log = logging.getLogger("kandevd.queue.journal")


def attempt_dir(layout: HomeLayout, run_id: str, token: str) -> Path:
    """The folder of one attempt (claim ``token``) of run ``run_id``.

    One level (``<run_id>.<token>``), so an execution costs one mkdir, not two:
    on some file systems a mkdir is the dearest step of an execution. (Run ids
    hold no dot, so the name splits back at its first one.)
    """
    return layout.attempts / f"{run_id}.{token}"


def legacy_attempt_dir(layout: HomeLayout, run_id: str, token: str) -> Path:
    """Where a daemon before the one-level layout kept the attempt (``<run_id>/<token>``)."""
    return layout.attempts / run_id / token


def existing_attempt_dir(layout: HomeLayout, run_id: str, token: str) -> Path:
    """The attempt's folder as it is on disk: the current layout, else the legacy one.

    The one that holds the execution's record wins (a legacy execution's
    journal never moves).
    """
    current = attempt_dir(layout, run_id, token)
    if (current / RECORD_FILE).exists():
        return current
    legacy = legacy_attempt_dir(layout, run_id, token)
    if (legacy / RECORD_FILE).exists() or (legacy.is_dir() and not current.is_dir()):
        return legacy
    return current


def write_outcome(directory: Path, result: ExecutionResult) -> bool:
    """Persist ``result`` (temp file, fsync, rename); False when the disk refused."""
    document = {
        "outcome": result.outcome, "exit_code": result.exit_code, "summary": result.summary,
        "cost_cents": result.cost_cents, "error": result.error,
        "started_at": rfc3339(result.started_at), "ended_at": rfc3339(result.ended_at),
        "log_path": str(result.log_path),
    }
    try:
        ensure_dir(directory)
        write_json(directory / OUTCOME_FILE, document, durable=True)
    except OSError as exc:
        log.error("cannot write the outcome file in %s (%s); the outcome is kept in memory",
                  directory, exc)
        return False
    return True


def exit_file_tells(directory: Path, result: ExecutionResult) -> bool:
    """Does the shim's exit file in ``directory`` already record ``result``?

    True for an agent that exited on its own (``succeeded``/``failed`` with
    its exit code) whose exit file and record exist: a restart derives the same outcome
    from it (with the summary its stdout left), so ``outcome.json`` would
    only repeat it at the price of a file creation and an fsync per run.
    """
    if result.outcome not in (SUCCEEDED, FAILED) or result.exit_code is None:
        return False
    if result.journaled:
        return True  # the runner read that exit file and wrote that record itself
    # A restart reads the exit file only through the execution's record: without a
    # readable one (its write failed), the outcome must be written out after all.
    return read_exit_status(directory) == result.exit_code and \
        read_record(directory) is not None


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
            cost_cents=float(cost) if isinstance(cost, int | float) else None,
            error=document.get("error"), started_at=parse_rfc3339(document["started_at"]),
            ended_at=parse_rfc3339(document["ended_at"]), log_path=Path(document["log_path"]))
    except (KeyError, TypeError, ValueError) as exc:
        log.warning("outcome file %s is malformed (%s); ignored", path, exc)
        return None


#: What an attempt's folder normally holds (see kandevd.runtime.shim).
_ATTEMPT_FILES = (OUTCOME_FILE, RECORD_FILE, EXIT_FILE, STDOUT_FILE, SUMMARY_FILE)


def discard(directory: Path) -> None:
    """Recycle, else remove, an attempt's folder once the database holds its outcome.

    Recycled: emptied and parked for a later execution (no inode freed). Else
    the files it normally holds are unlinked by name (no directory walk);
    only a folder that still holds something else is removed recursively.
    """
    # Only a folder of the current layout: a legacy one's parent is its run's folder.
    if directory.parent.name == ATTEMPTS_FOLDER and pool_for(directory.parent).put(directory):
        return
    for name in _ATTEMPT_FILES:
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


def prune(layout: HomeLayout, current: dict[str, str]) -> int:
    """Remove attempt folders that are not a run's current claim; how many went.

    ``current`` maps each claimed run to its claim token. Folders of attempts
    that were rescued, superseded or settled while the daemon died between the
    database write and :func:`discard` are left over otherwise.
    """
    removed = 0
    try:
        entries = list(os.scandir(layout.attempts))
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
