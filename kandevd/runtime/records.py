"""What an execution leaves in its attempt folder, read back after a daemon restart.

The runner writes ``record.json`` right after the shim started (the shim's
pid and start time, the deadline, the log, the input, the argv); the shim
writes ``exit`` once the agent ended (:mod:`kandevd.runtime.attempts` names
the files). The next daemon instance reads them back: a finished execution's
outcome comes from :func:`outcome_from_record`; a live one
(:func:`record_alive`) can be adopted with
:meth:`kandevd.runtime.pool.AgentRuntime.adopt`. Whoever learns that the
execution ended merges the agent's stdout into the log
(:func:`collect_output`), idempotently.
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

from kandevd.fsutil import write_json
from kandevd.keeper import journal
from kandevd.runtime import shim
from kandevd.runtime.attempts import (
    EXIT_FILE,
    RECORD_FILE,
    STDOUT_FILE,
    SUMMARY_FILE,
    spent_stdout_path,
)
from kandevd.runtime.execution import (
    FAILED,
    SUCCEEDED,
    ExecutionResult,
    describe_exit,
    termination_text,
)
from kandevd.runtime.output import AgentReport, collect_stdout
from kandevd.timeutil import parse_rfc3339, rfc3339

log = logging.getLogger("kandevd.runtime.records")

#: The error of an execution whose shim ended without writing its exit file.
NO_EXIT_STATUS = "agent supervisor ended without recording an exit status"


def read_exit_status(record_dir: Path) -> int | None:
    """The agent's exit code recorded by its shim, or None (none yet, or lost).

    Only a complete line ``<code>\\n`` counts: an empty or partial file (the
    shim is writing it, or the disk filled up) is no status at all.
    ``128+N`` is translated to ``-N``.
    """
    return shim.read_exit_file(Path(record_dir) / EXIT_FILE)


def exit_file_tells(directory: Path, result: ExecutionResult) -> bool:
    """Does the shim's exit file in ``directory`` already record ``result``?

    True for an agent that exited on its own (``succeeded``/``failed`` with
    its exit code) whose exit file and record exist: a restart derives the
    same outcome from it (with the summary its stdout left), so an outcome
    file would only repeat it at the price of a file creation and an fsync.
    """
    if result.outcome not in (SUCCEEDED, FAILED) or result.exit_code is None:
        return False
    if result.journaled:
        return True  # the runner read that exit file and wrote that record itself
    # A restart reads the exit file only through the execution's record: without a
    # readable one (its write failed), the outcome must be written out after all.
    return read_exit_status(directory) == result.exit_code and \
        read_record(directory) is not None


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
    #: The agent's stdout file; None stands for ``<record_dir>/stdout``.
    stdout_path: Path | None = None
    #: The keeper's name of the execution, when the keeper started it (else a shim did).
    keeper_id: str | None = None
    #: How it ended as the keeper tells it (``code``, ``by``, ...), None while it runs
    #: or not known yet (then :attr:`journal`, the keeper's journal, is read).
    ended: dict[str, Any] | None = None
    journal: Path | None = None

    def __post_init__(self) -> None:
        if self.stdout_path is None:
            object.__setattr__(self, "stdout_path", Path(self.record_dir) / STDOUT_FILE)

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
            "log_offset": self.log_offset, "stdout_path": str(self.stdout_path),
            **({"keeper_id": self.keeper_id, "journal": str(self.journal)}
               if self.keeper_id is not None else {}),
        }


def write_record(record: ExecutionRecord, *, in_place: bool = False) -> None:
    """Store ``record`` as ``<record_dir>/record.json`` (temporary file + rename).

    ``in_place``: overwrite the record that exists already with one write,
    creating no file (a file creation is the dearest step of an execution on
    some file systems). A daemon killed in the middle of that write leaves a
    record that does not parse, which the next start reads as no record: its
    shim is then an orphan, stopped, and the run rescued, as when the daemon
    dies just before the spawn.
    """
    path = record.record_dir / RECORD_FILE
    if in_place:
        data = json.dumps(record.to_json()).encode("utf-8")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)
        except OSError:
            pass  # (absent, or cannot be opened): the atomic write below says why
        else:
            try:
                written = os.write(fd, data)
            except OSError:
                written = -1  # truncated and not rewritten: the atomic write repairs it
            finally:
                os.close(fd)
            if written == len(data):
                return
    # No fsync: the record matters across a restart of the daemon, not of the machine,
    # which ends the agent it describes anyway.
    write_json(path, record.to_json(), durable=False)


def read_record(record_dir: Path) -> ExecutionRecord | None:
    """The record in ``record_dir``; None when it is missing, partial or corrupt."""
    record_dir = Path(record_dir)
    path = record_dir / RECORD_FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("execution record %s cannot be read (%s); ignored", path, exc)
        return None
    if not data:  # emptied for a recycled folder's next execution: no record yet
        return None
    try:
        document = json.loads(data)
    except ValueError as exc:
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
    keeper_id = document.get("keeper_id")  # a record of an execution the keeper started
    journal = document.get("journal")
    if keeper_id is not None and not (isinstance(keeper_id, str) and isinstance(journal, str)):
        raise TypeError("keeper_id and journal must be strings")
    stdout = document.get("stdout_path")  # absent from records of older versions
    if stdout is not None and not isinstance(stdout, str):
        raise TypeError("stdout_path must be a string")
    return ExecutionRecord(
        record_dir=record_dir, pid=integer("pid"), pid_start=integer("pid_start"),
        key=text("key"), run_id=text("run_id"), session_id=text("session_id"),
        started_at=parse_rfc3339(text("started_at")), deadline=parse_rfc3339(text("deadline")),
        timeout_s=float(timeout), log_path=Path(text("log_path")),
        input_path=Path(text("input_path")), argv=tuple(argv), log_offset=offset,
        stdout_path=Path(stdout) if stdout else None, keeper_id=keeper_id,
        journal=Path(journal) if journal else None,
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
    """True while the record's agent still runs: the keeper says so, or its shim still
    runs (same pid, same start time, ours).

    "Ours" means our uid and the command line of the shim writing this
    record's exit file (not one of another home or attempt); a pid the kernel
    handed to another process since has another start time.
    """
    if record.keeper_id is not None:
        return kept_end(record) is None and record.pid > 0 and \
            shim.process_running(record.pid, record.pid_start)
    return (record.pid > 0 and shim.process_running(record.pid, record.pid_start)
            and shim.is_our_shim(record.pid, record.exit_path))


def outcome_from_record(record: ExecutionRecord, record_dir: Path | None = None,
                        log_path: Path | None = None) -> ExecutionResult | None:
    """The result of a finished execution from its exit file; None when there is none.

    ``succeeded`` for exit 0, ``failed`` otherwise, with the summary and cost
    from the last line of the agent's stdout, which is then appended to the
    log (see :func:`collect_output`; calling this again is harmless). Its end
    is when the exit file was written.
    """
    if record.keeper_id is not None:
        return kept_outcome(record, log_path)
    directory = Path(record_dir) if record_dir is not None else record.record_dir
    exit_code = read_exit_status(directory)
    if exit_code is None:
        return None
    return result_for_exit(record, exit_code, directory, log_path)


def kept_end(record: ExecutionRecord) -> dict[str, Any] | None:
    """How the keeper says the execution ended: known to the daemon already, else from
    the keeper's journal on disk (read at a start, for a record found in a folder)."""
    if record.ended is not None or record.journal is None or record.keeper_id is None:
        return record.ended
    entry = journal.read(record.journal).get(record.keeper_id)
    return entry.exit if entry is not None else None


def kept_outcome(record: ExecutionRecord, log_path: Path | None = None
                 ) -> ExecutionResult | None:
    """How an execution the keeper started ended, from the keeper's exit record; None while
    it runs or when its exit is unknown (it ended while no keeper watched it). Its stdout
    goes into the log (once: the file is removed after)."""
    ended = kept_end(record)
    if ended is None or (ended.get("code") is None and not ended.get("by")):
        return None
    log_file = Path(log_path) if log_path is not None else record.log_path
    assert record.stdout_path is not None
    report = collect_stdout(record.stdout_path, log_file)
    code = ended.get("code")
    by = ended.get("by")
    try:
        ended_at = datetime.fromtimestamp(float(ended.get("at") or 0), record.started_at.tzinfo)
    except (TypeError, ValueError, OverflowError):
        ended_at = record.started_at
    ended_at = max(ended_at, record.started_at)
    if by:
        outcome, error = str(by), termination_text(str(by), str(ended.get("reason") or ""),
                                                    record.timeout_s)
    else:
        outcome = SUCCEEDED if code == 0 else FAILED
        error = None if code == 0 else describe_exit(int(code))
    return ExecutionResult(
        key=record.key, outcome=outcome, exit_code=code, summary=report.summary,
        cost_cents=report.cost_cents, error=error, started_at=record.started_at,
        ended_at=ended_at, log_path=log_file, evaluation=report.evaluation, journaled=True,
        execution_id=record.keeper_id)


def result_for_exit(record: ExecutionRecord, exit_code: int, record_dir: Path | None = None,
                    log_path: Path | None = None) -> ExecutionResult:
    """An ExecutionResult for ``record`` that ended on its own with ``exit_code``.

    Collects its stdout like :func:`outcome_from_record`.
    """
    directory = Path(record_dir) if record_dir is not None else record.record_dir
    log_file = Path(log_path) if log_path is not None else record.log_path
    report = collect_output(record, directory, log_file)
    try:
        ended_at = datetime.fromtimestamp(os.stat(directory / EXIT_FILE).st_mtime,
                                          record.started_at.tzinfo)
    except OSError:
        ended_at = record.started_at
    ended_at = max(ended_at, record.started_at)
    outcome = SUCCEEDED if exit_code == 0 else FAILED
    return ExecutionResult(
        key=record.key, outcome=outcome, exit_code=exit_code, summary=report.summary,
        cost_cents=report.cost_cents, error=None if exit_code == 0 else describe_exit(exit_code),
        started_at=record.started_at, ended_at=ended_at, log_path=log_file,
        evaluation=report.evaluation,
    )



def collect_output(record: ExecutionRecord, record_dir: Path | None = None,
                   log_path: Path | None = None) -> AgentReport:
    """The agent's report (summary, cost, evaluation) of the ended execution of
    ``record``; its stdout goes into the log.

    The summary comes from the last line of the agent's stdout file, which is
    then appended to the log, emptied and moved out of the folder;
    ``<record_dir>/summary.json`` makes a repeated call (a daemon died
    half-way) return the same summary without appending twice. ``record_dir``
    and ``log_path`` override the record's.
    """
    directory = Path(record_dir) if record_dir is not None else record.record_dir
    log_file = Path(log_path) if log_path is not None else record.log_path
    stdout = record.stdout_path
    if stdout is None or directory != record.record_dir:
        stdout = directory / STDOUT_FILE
    return collect_stdout(stdout, log_file, directory / SUMMARY_FILE,
                          spent_stdout_path(directory))
