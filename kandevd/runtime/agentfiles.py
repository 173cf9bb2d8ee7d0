"""An execution's files on the daemon's side, for the keeper runner: the agent's input
(``$KANDEVD_INPUT``, also its stdin), its stdout until it is merged into the log (the
summary is its last line), and the program ``execvp`` would run."""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

from kandevd.agents.profiles import executable_problem
from kandevd.runtime import attempts
from kandevd.runtime.execution import ExecutionSpec
from kandevd.runtime.output import NO_REPORT, AgentReport, LogSink, parse_report

log = logging.getLogger("kandevd.runtime.agentfiles")

#: Only this much of the stdout file's end is read for the summary line.
_TAIL = 1024 * 1024
_COPY = 1024 * 1024


def execution_id(spec: ExecutionSpec) -> str:
    """The keeper's name of an execution: its record folder's (one per attempt or turn)."""
    if spec.record_dir is not None:
        return spec.record_dir.name
    return f"{spec.kind}-{spec.key}-{os.urandom(6).hex()}"


def stdout_path(spec: ExecutionSpec, execution: str) -> Path:
    """Where the agent's stdout is kept until it is merged into the log and recorded."""
    if spec.record_dir is not None:
        return attempts.spent_stdout_path(spec.record_dir)
    return spec.log_path.with_name(f"{spec.log_path.name}.{execution}.stdout")


def resolve(name: str, cwd: Path, path_env: str | None) -> str:
    """The file ``execvp`` would run for ``name`` (checked by ``executable_problem``)."""
    if "/" in name:
        return name if os.path.isabs(name) else str(cwd / name)
    found = shutil.which(name, path=path_env if path_env is not None else os.defpath)
    return found if found is not None else name


def open_empty(path: Path) -> int:
    """``path`` opened read-write, created (0600) or emptied: truncated only when it
    has something in it (an earlier attempt's), not on the usual path of a new file
    (created exclusively: nothing to look at)."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        pass
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        if os.fstat(fd).st_size:
            os.ftruncate(fd, 0)
    except OSError:
        os.close(fd)
        raise
    return fd


def write_input(path: Path, data: bytes) -> int:
    """The agent's stdin on disk (``$KANDEVD_INPUT``), open for the agent to read."""
    fd = open_empty(path)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.lseek(fd, 0, os.SEEK_SET)
    except OSError:
        os.close(fd)
        raise
    return fd


def merge_stdout(fd_out: int, sink: LogSink) -> AgentReport:
    """The agent's report from its stdout's last line; then its stdout goes into the log."""
    try:
        size = os.fstat(fd_out).st_size
    except OSError:
        return NO_REPORT
    if not size:
        return NO_REPORT
    start = max(size - _TAIL, 0)
    # (one byte more when clipped: does the window begin at a line's start?)
    tail = os.pread(fd_out, size - start + (start > 0), start - (start > 0))
    whole_first = start == 0 or tail[:1] == b"\n"
    lines = [line.strip() for line in tail[start > 0:].split(b"\n")]
    index = next((i for i in range(len(lines) - 1, -1, -1) if lines[i]), None)
    too_long = index == 0 and not whole_first  # (the last line began before the window)
    if too_long:
        log.warning("%s: the agent's last line of stdout is over %d bytes; no summary or "
                    "cost read from it", sink.path, _TAIL)
        report = NO_REPORT
    else:
        last = lines[index] if index is not None else b""
        report = parse_report(last.decode("utf-8", errors="replace") if last else None)
    offset = 0
    while offset < size:
        chunk = os.pread(fd_out, min(_COPY, size - offset), offset)
        if not chunk:
            break
        sink.write(chunk)
        offset += len(chunk)
    # What follows (a note, the attempt's end) starts a line of its own, found by
    # `grep '^\[kandevd\]'` also after a last line of stdout with no newline.
    if not tail.endswith(b"\n"):
        sink.write(b"\n")
    if too_long:  # (after the stdout, which the note is about)
        sink.note(f"the last line of stdout is over {_TAIL} bytes: no summary or cost "
                  "was read from it")
    return report


#: How long a program found on disk is taken to be there still (one check a second).
PROGRAM_KNOWN_S = 1.0


class Programs:
    """The files agents' commands name, as ``execvp`` would find them, found lately."""

    def __init__(self) -> None:
        #: (name, folder if relative, PATH) -> (when found, the file).
        self._found: dict[tuple[str, str, str | None], tuple[float, str]] = {}

    def find(self, name: str, cwd: Path, search_path: str | None) -> tuple[str | None, str]:
        """(Why ``name`` cannot run, the file to run.) A program found is remembered for
        :data:`PROGRAM_KNOWN_S`: one that goes away in that moment is refused by the
        keeper instead, with the system's word for it."""
        key = (name, str(cwd) if "/" in name and not os.path.isabs(name) else "",
               search_path)
        now = time.monotonic()
        known = self._found.get(key)
        if known is not None and now - known[0] < PROGRAM_KNOWN_S:
            return None, known[1]
        problem = executable_problem(name, cwd, search_path)
        if problem is not None:
            return problem, name
        path = resolve(name, cwd, search_path)
        if len(self._found) >= 64:
            self._found.clear()
        self._found[key] = (now, path)
        return None, path
