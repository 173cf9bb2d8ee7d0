"""An execution's output: its log as the daemon holds it, and the agent's stdout merged in.

The summary line (the contract's section 5) is the *last non-empty line of
the agent's stdout*, read from the stdout file, so nothing the agent writes
to stderr afterwards hides it. Only the last MiB of the file is read; a last
line longer than that counts as ``<line too long>`` (no summary). The log
holds both streams, but *stdout after stderr*: the stdout file is appended
once the execution ended, idempotently with a record folder (see
:func:`collect_stdout`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from datetime import datetime
from pathlib import Path
from typing import Any, NamedTuple

from kandevd.runtime import shim
from kandevd.timeutil import rfc3339

log = logging.getLogger("kandevd.runtime.process")

_LOG_PREFIX = "[kandevd] "
#: Chunk size when the stdout file is appended to the log.
_COPY_CHUNK = 1024 * 1024


#: The largest ``evaluation`` object kept (as JSON); a larger one is dropped with a note.
MAX_EVALUATION_BYTES = 64 * 1024
#: The largest cost an attempt may report (ten billion dollars): a larger one is not
#: recorded, so the attempts' sum and the budgets' spend stay finite numbers.
MAX_COST_CENTS = 1e12


class AgentReport(NamedTuple):
    """What the agent's last stdout line reports (contract 5): all optional."""

    summary: str | None = None
    cost_cents: float | None = None
    evaluation: dict[str, Any] | None = None


NO_REPORT = AgentReport()


def reported_cost(value: Any) -> float | None:
    """An attempt's reported cost in cents, or None when it is not a number from 0 to
    :data:`MAX_COST_CENTS` (a negative one would hide spend from budgets; a larger one
    would make the attempts' sum infinite, which no JSON answer can carry)."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return None
    try:
        cost = float(value)
    except OverflowError:  # (an integer too large for a float)
        cost = math.inf
    if not math.isfinite(cost) or cost < 0:
        return None
    if cost > MAX_COST_CENTS:
        log.warning("an agent reported a cost of %.4g cents, over %.4g; not recorded",
                    cost, MAX_COST_CENTS)
        return None
    return cost


def parse_report(line: str | None) -> AgentReport:
    """The report in the agent's last output line; fields that are not well-typed are
    left out (a cost too, unless :func:`reported_cost` takes it)."""
    if not line:
        return AgentReport()
    try:
        obj = json.loads(line)
    except ValueError:
        return AgentReport()
    if not isinstance(obj, dict):
        return AgentReport()
    summary = obj.get("summary")
    return AgentReport(summary if isinstance(summary, str) else None,
                       reported_cost(obj.get("cost_cents")),
                       _evaluation(obj.get("evaluation")))


def _evaluation(value: Any) -> dict[str, Any] | None:
    if not isinstance(value, dict):
        return None
    try:
        size = len(json.dumps(value, allow_nan=False).encode("utf-8"))
    except ValueError:
        return None
    if size > MAX_EVALUATION_BYTES:
        log.info("an agent's evaluation of %d bytes is over %d; not recorded", size,
                 MAX_EVALUATION_BYTES)
        return None
    return value


def parse_summary_line(line: str | None) -> tuple[str | None, float | None]:
    """``(summary, cost_cents)`` from the agent's last output line (contract 5)."""
    report = parse_report(line)
    return report.summary, report.cost_cents


def collect_stdout(stdout_path: Path, log_path: Path, state_path: Path | None = None,
                   keep_as: Path | None = None) -> AgentReport:
    """The agent's report of an ended execution; its stdout file goes into the log.

    The summary comes from the last non-empty line of ``stdout_path`` (the
    last MiB of it); then the file is appended to ``log_path`` and removed,
    or with ``keep_as`` emptied and renamed there (no inode freed; see
    :func:`kandevd.runtime.attempts.spent_stdout_path`).
    With ``state_path`` (``<record_dir>/summary.json``) this may run again
    after a crash at any point: the summary and the log's size are saved
    there before the log is touched, so a second run finds the summary
    even once the stdout file is gone, and appends only what was not
    appended yet (a partial copy is cut off first). Without it (a temporary
    stdout file nobody reads again) it simply runs once. Errors are logged,
    never raised: at worst the output stays in the stdout file.
    """
    state = _read_summary_state(state_path) if state_path is not None else None
    try:
        size = os.stat(stdout_path).st_size
    except OSError:  # merged already (or never written)
        if state is not None:
            return state[0]
        return AgentReport()
    if state is not None:
        report, merged_from = state
    else:
        report = parse_report(shim.last_line(stdout_path))
        merged_from = None
    if size:
        try:
            _append_stdout(stdout_path, log_path, size, report, merged_from, state_path)
        except OSError as exc:
            log.error("cannot append the agent's stdout %s to its log %s (%s); it is left "
                      "where it is", stdout_path, log_path, exc)
            return report
    if keep_as is not None:
        try:
            # Emptied first: a crash before the rename leaves an empty stdout file,
            # which a second call merges as nothing (the summary is in state_path).
            os.truncate(stdout_path, 0)
            os.rename(stdout_path, keep_as)
            return report
        except FileNotFoundError:
            return report
        except OSError as exc:
            log.debug("the agent's stdout file %s not kept as %s (%s); removed", stdout_path,
                      keep_as, exc)
    unlink_stdout(stdout_path)
    return report


def unlink_stdout(path: str | os.PathLike[str]) -> None:
    """The agent's stdout file is merged and recorded: it goes (gone already is fine)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("cannot remove the agent's stdout file %s (%s)", path, exc)


def _append_stdout(stdout_path: Path, log_path: Path, size: int, report: AgentReport,
                   merged_from: int | None, state_path: Path | None) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    try:
        log_size = os.fstat(fd).st_size
        if merged_from is not None and merged_from <= log_size:
            if log_size >= merged_from + size:
                return  # appended completely by an earlier run: only the unlink is left
            os.ftruncate(fd, merged_from)  # a partial copy: cut it off, append again
        elif state_path is not None:
            document = {"summary": report.summary, "cost_cents": report.cost_cents,
                        "evaluation": report.evaluation, "log_size": log_size}
            fd_state = os.open(state_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC,
                               0o600)
            with os.fdopen(fd_state, "w", encoding="utf-8") as handle:
                json.dump(document, handle)
        last = b"\n"
        with open(stdout_path, "rb") as source:
            while chunk := source.read(_COPY_CHUNK):
                last = chunk[-1:]
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view):]
        if last != b"\n":  # (the attempt's end that follows starts a line of its own)
            os.write(fd, b"\n")
    finally:
        os.close(fd)


def _read_summary_state(path: Path) -> tuple[AgentReport, int] | None:
    """``(report, log size before the merge)`` from ``summary.json``, or None."""
    try:
        document = json.loads(Path(path).read_bytes())
        summary, cost, log_size = (document["summary"], document["cost_cents"],
                                   document["log_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if summary is not None and not isinstance(summary, str):
        return None
    if cost is not None and (not isinstance(cost, int | float) or isinstance(cost, bool)):
        return None
    if not isinstance(log_size, int) or isinstance(log_size, bool) or log_size < 0:
        return None
    report = AgentReport(summary, float(cost) if cost is not None else None,
                         _evaluation(document.get("evaluation")))
    return report, log_size


def attempt_started(attempt: int, at: datetime) -> str:
    """The note that opens a queued run's attempt in its log (``runs logs``)."""
    return f"==== attempt {attempt} started {rfc3339(at)} ===="


def attempt_ended(attempt: int, at: datetime, outcome: str, error: str | None) -> str:
    """The note that closes it: when, and how it ended."""
    ending = outcome + (f" ({error})" if error else "")
    return f"==== attempt {attempt} ended {rfc3339(at)}: {ending} ===="


_FRAME = re.compile(rb"^\[kandevd\] ==== attempt (\d+) (started|ended) ", re.MULTILINE)
#: How much of a log's end is looked at for its last attempt frame.
_FRAME_TAIL = 256 * 1024


def open_attempt(path: Path) -> int | None:
    """The attempt a run's log started last and did not end (its execution ended unseen:
    the daemon was killed), None when its last frame is an end, or there is none."""
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            handle.seek(max(size - _FRAME_TAIL, 0))
            tail = handle.read()
    except OSError:
        return None
    frames = _FRAME.findall(tail)
    if not frames or frames[-1][1] != b"started":
        return None
    return int(frames[-1][0])


class LogSink:
    """The execution's log file as the daemon holds it (the shim's output, our notes)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self.fd = fd
        self._broken = fd < 0

    @classmethod
    def open(cls, path: Path) -> LogSink:
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC
        return cls(path, os.open(path, flags, 0o600))

    @classmethod
    def open_or_disabled(cls, path: Path) -> LogSink:
        """The log, or a sink that drops notes when the log cannot be opened."""
        try:
            return cls.open(path)
        except OSError as exc:
            log.error("cannot open log %s (%s); notes about the execution are dropped",
                      path, exc)
            return cls(path, -1)

    def size(self) -> int:
        try:
            return os.fstat(self.fd).st_size
        except OSError:
            return 0

    def write(self, data: bytes) -> None:
        if self._broken:
            return
        view = memoryview(data)
        try:
            while view:
                written = os.write(self.fd, view)
                view = view[written:]
        except OSError as exc:  # disk full and friends: keep the child running
            self._broken = True
            log.error("cannot write log %s (%s); dropping further notes", self.path, exc)

    def note(self, text: str) -> None:
        self.write(f"{_LOG_PREFIX}{text}\n".encode())

    def close(self) -> None:
        if self.fd < 0:
            return
        try:
            os.close(self.fd)
        except OSError:
            pass
        self.fd = -1

