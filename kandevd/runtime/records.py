"""What an execution leaves in its record folder, read back after a daemon restart.

When an :class:`~kandevd.runtime.process.ExecutionSpec` names a
``record_dir`` (the queue gives each attempt of a run its own), the runner
writes ``record.json`` there right after the shim started (atomically: a
temporary file and a rename), and the shim (see :mod:`kandevd.runtime.shim`)
writes ``exit`` once the agent ended::

    record.json  {"pid", "pid_start", "key", "run_id", "session_id",
                  "started_at", "deadline", "timeout_s", "log_path",
                  "input_path", "argv", "log_offset"}
    exit         "<code>\\n"

``pid`` is the shim's (it leads the agent's process group), ``pid_start``
its start time from ``/proc`` (a reused pid has another), ``deadline`` the
wall-clock end of the execution's timeout and ``log_offset`` the size of the
log when the execution began (its summary is searched after it).

The next daemon instance reads these back: a finished execution's outcome
comes from :func:`outcome_from_record`; a live one (:func:`record_alive`) can
be adopted with :meth:`kandevd.runtime.AgentRuntime.adopt`. The runner never
deletes a record folder; its owner does.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from kandevd.runtime import shim
from kandevd.runtime.process import (
    FAILED,
    SUCCEEDED,
    ExecutionResult,
    describe_exit,
    parse_summary_line,
)
from kandevd.timeutil import parse_rfc3339, rfc3339

log = logging.getLogger("kandevd.runtime.records")

RECORD_FILE = shim.RECORD_FILE
EXIT_FILE = shim.EXIT_FILE
#: The error of an execution whose shim ended without writing its exit file.
NO_EXIT_STATUS = "agent supervisor ended without recording an exit status"

read_exit_status = shim.read_exit_status


@dataclass(frozen=True)
class ExecutionRecord:
    """One execution's ``record.json``: which shim runs it, for what, until when."""

    record_dir: Path
    pid: int
    pid_start: int
    key: str
    run_id: str
    session_id: str
    started_at: datetime
    deadline: datetime
    timeout_s: float
    log_path: Path
    input_path: Path
    argv: tuple[str, ...]
    log_offset: int = 0

    @property
    def exit_path(self) -> Path:
        """Where the shim writes the agent's exit status."""
        return self.record_dir / EXIT_FILE

    def to_json(self) -> dict[str, Any]:
        """The document stored as ``record.json``."""
        return {
            "pid": self.pid, "pid_start": self.pid_start, "key": self.key,
            "run_id": self.run_id, "session_id": self.session_id,
            "started_at": rfc3339(self.started_at), "deadline": rfc3339(self.deadline),
            "timeout_s": self.timeout_s, "log_path": str(self.log_path),
            "input_path": str(self.input_path), "argv": list(self.argv),
            "log_offset": self.log_offset,
        }


def write_record(record: ExecutionRecord) -> None:
    """Store ``record`` as ``<record_dir>/record.json`` (temporary file + rename)."""
    shim.write_json_atomic(record.record_dir / RECORD_FILE, record.to_json())


def read_record(record_dir: Path) -> ExecutionRecord | None:
    """The record in ``record_dir``; None when it is missing, partial or corrupt."""
    record_dir = Path(record_dir)
    path = record_dir / RECORD_FILE
    try:
        document = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("execution record %s cannot be read (%s); ignored", path, exc)
        return None
    try:
        return _parse(record_dir, document)
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        log.warning("execution record %s is malformed (%s); ignored", path, exc)
        return None


def _parse(record_dir: Path, document: Any) -> ExecutionRecord:
    if not isinstance(document, dict):
        raise TypeError("not a JSON object")

    def integer(name: str) -> int:
        # 0: written before the shim was spawned (see :func:`locate`)
        value = document[name]
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer")
        return value

    def text(name: str) -> str:
        value = document[name]
        if not isinstance(value, str):
            raise TypeError(f"{name} must be a string")
        return value

    timeout = document["timeout_s"]
    if not isinstance(timeout, int | float) or isinstance(timeout, bool) or not timeout > 0:
        raise ValueError("timeout_s must be a positive number")
    argv = document["argv"]
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise TypeError("argv must be a non-empty list of strings")
    offset = document.get("log_offset", 0)
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
        offset = 0
    return ExecutionRecord(
        record_dir=record_dir, pid=integer("pid"), pid_start=integer("pid_start"),
        key=text("key"), run_id=text("run_id"), session_id=text("session_id"),
        started_at=parse_rfc3339(text("started_at")), deadline=parse_rfc3339(text("deadline")),
        timeout_s=float(timeout), log_path=Path(text("log_path")),
        input_path=Path(text("input_path")), argv=tuple(argv), log_offset=offset,
    )


def locate(record: ExecutionRecord) -> ExecutionRecord:
    """``record`` with its shim's pid, also when it was written before the spawn.

    The record is first written with pid 0 just before the shim is spawned,
    then again with the shim's pid: a daemon killed in between leaves a
    record without a pid, and the shim (if it was spawned) is found by its
    exit path instead, so it is adopted rather than run a second time.
    """
    if record.pid:
        return record
    found = shim.find_shim(record.exit_path)
    if found is None:
        return record
    return dataclasses.replace(record, pid=found[0], pid_start=found[1])


def record_alive(record: ExecutionRecord) -> bool:
    """True while the record's shim still runs: same pid, same start time, ours.

    "Ours" means our uid and a shim's command line; a pid the kernel handed
    to another process since has another start time.
    """
    return (record.pid > 0 and shim.process_running(record.pid, record.pid_start)
            and shim.is_our_shim(record.pid))


def outcome_from_record(record: ExecutionRecord, record_dir: Path | None = None,
                        log_path: Path | None = None) -> ExecutionResult | None:
    """The result of a finished execution from its exit file; None when there is none.

    ``succeeded`` for exit 0, ``failed`` otherwise, with the summary and cost
    from the last line of the log. Its end is when the exit file was written.
    """
    directory = Path(record_dir) if record_dir is not None else record.record_dir
    exit_code = read_exit_status(directory)
    if exit_code is None:
        return None
    return result_for_exit(record, exit_code, directory, log_path)


def result_for_exit(record: ExecutionRecord, exit_code: int, record_dir: Path | None = None,
                    log_path: Path | None = None) -> ExecutionResult:
    """An ExecutionResult for ``record`` that ended on its own with ``exit_code``."""
    directory = Path(record_dir) if record_dir is not None else record.record_dir
    log_file = Path(log_path) if log_path is not None else record.log_path
    summary, cost = parse_summary_line(shim.last_log_line(log_file, record.log_offset))
    try:
        ended_at = datetime.fromtimestamp(os.stat(directory / EXIT_FILE).st_mtime,
                                          record.started_at.tzinfo)
    except OSError:
        ended_at = record.started_at
    ended_at = max(ended_at, record.started_at)
    outcome = SUCCEEDED if exit_code == 0 else FAILED
    return ExecutionResult(
        key=record.key, outcome=outcome, exit_code=exit_code, summary=summary,
        cost_cents=cost, error=None if exit_code == 0 else describe_exit(exit_code),
        started_at=record.started_at, ended_at=ended_at, log_path=log_file,
    )

