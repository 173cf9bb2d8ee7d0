"""The shim: a tiny POSIX ``sh`` supervisor between the daemon and each agent.

Every agent execution runs as
``/bin/sh -c SCRIPT kandevd-shim EXIT INPUT LOG STDOUT argv...``
(no script file on disk, no Python per execution: one ``sh`` exec and one
fork are all it costs). The shim leads its own session and process group
(its stdin is /dev/null, its stdout and stderr the log); it runs the agent as
its child with stdin from ``INPUT``, stderr appended to ``LOG`` and stdout
appended to ``STDOUT`` (a file of its own, so the summary line is the last
line of stdout whatever the agent writes to stderr after it; the daemon
appends it to the log once the execution ended), then writes the agent's
status to ``EXIT`` as one line ``<code>\\n`` in a single write, and exits
with that same code. So the status of an agent is on disk even when no
daemon was alive to wait for it (live restore, like a containerd shim or
conmon).

The shim traps TERM, INT and HUP with a no-op handler: a signal sent to the
group ends the agent but the shim lives on to record the status. (A trap
with an action is reset to the default in the agent; ``trap '' TERM`` would
make the agent inherit SIG_IGN instead.) POSIX has the shell run a trap
caught while it waits for a foreground command only once that command has
ended, with ``$?`` still holding its status, which is ``128+N`` for an agent
killed by signal ``N`` (checked with dash, Debian's /bin/sh, and bash).
SIGKILL of the group kills the shim too: then there is no exit file, and the
daemon knows the outcome itself (it sent the SIGKILL) or falls back to the
shim's own wait status.

A status read back is translated to the convention of
:class:`~kandevd.runtime.execution.ExecutionResult`: ``128+N`` (N a signal
number) becomes ``-N``. An agent that itself exits with 143 is therefore
reported as killed by SIGTERM; ``sh`` cannot tell the two apart, and neither
can anyone reading its status.

This module also holds the small ``/proc`` helpers used to recognise a shim
again after a daemon restart (its pid plus its start time, which tells a
reused pid apart), and the readers of a file's last line, from which the
agent's summary is taken.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

#: ``$0`` of every shim: how a shim is recognised in ``/proc/<pid>/cmdline``.
SHIM_NAME = "kandevd-shim"
SHELL = "/bin/sh"

# $1 exit file, $2 input file, $3 log file, $4 stdout file, then the agent's
# argv. The shim's own stdout and stderr are the log (the runner opens it so);
# only builtins run in the shim itself. While the agent runs, the shim's
# stderr is /dev/null: dash reports an agent killed by a signal
# ("Terminated") on its stderr, noise in the log. The agent gets its
# redirections in a subshell that execs it (a simple command's redirections
# would be the shell's own while it waits); stderr is redirected first, so the
# errors of the other redirections and of exec ("not found") land in the log.
SCRIPT = """trap : TERM INT HUP
E=$1 I=$2 L=$3 O=$4
shift 4
exec 2>/dev/null
(exec "$@" 2>>"$L" >>"$O" <"$I")
s=$?
exec 2>&1
printf '%s\\n' "$s" >"$E"
exit "$s"
"""

#: Highest signal number a ``128+N`` status can stand for (SIGRTMAX on Linux).
_MAX_SIGNAL = 64
_STATUS = re.compile(rb"-?[0-9]+\n")
_PROC = Path("/proc")
#: Only this much of a log's end is read to find the summary line.
TAIL_LIMIT = 1024 * 1024
LINE_TOO_LONG = "<line too long>"
_LOG_PREFIX = b"[kandevd] "


def shim_argv(exit_path: Path, input_path: Path, log_path: Path,
              argv: tuple[str, ...] | list[str], stdout_path: Path | None = None) -> list[str]:
    """The command line that runs ``argv`` under the shim.

    The agent's stdout goes to ``stdout_path`` (default: the log too, both
    appending).
    """
    return [SHELL, "-c", SCRIPT, SHIM_NAME, str(exit_path), str(input_path), str(log_path),
            str(stdout_path if stdout_path is not None else log_path), *argv]


def exit_code_from_status(status: int) -> int:
    """A shell status as an exit code: ``128+N`` (killed by signal N) becomes ``-N``."""
    if 128 < status <= 128 + _MAX_SIGNAL:
        return -(status - 128)
    return status


def read_exit_file(path: Path) -> int | None:
    """The exit code in the exit file at ``path`` (``<code>\\n``), or None: a missing,
    empty or partial file (being written, or the disk filled up) is no status."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(32)
    except OSError:
        return None
    if not _STATUS.fullmatch(data):
        return None
    return exit_code_from_status(int(data))


def proc_stat(pid: int) -> tuple[str, int] | None:
    """``(state, start time)`` of ``pid`` from ``/proc/<pid>/stat``; None when gone.

    The start time (field 22, clock ticks since boot) tells a process apart
    from a later one that got the same pid.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            raw = handle.read()
    except OSError:
        return None
    try:
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        fields = raw[raw.rindex(b")") + 2:].split()
        return fields[0].decode(), int(fields[19])
    except (ValueError, IndexError):
        return None


def proc_start_time(pid: int) -> int | None:
    """Field 22 of ``/proc/<pid>/stat``, or None when the process is gone."""
    stat = proc_stat(pid)
    return stat[1] if stat is not None else None


def process_running(pid: int, start_time: int) -> bool:
    """True while ``pid`` is the process that started at ``start_time`` and has not exited."""
    stat = proc_stat(pid)
    return stat is not None and stat[1] == start_time and stat[0] not in ("Z", "X")


def is_our_shim(pid: int, exit_path: Path | None = None) -> bool:
    """True when ``pid`` runs as our uid and its command line is a shim's.

    With ``exit_path``, the shim must also write that exit file (its first
    argument): a shim of another home, or of another attempt, is not ours.
    Paths are compared as given, then resolved (a home reached through a
    symbolic link).
    """
    try:
        if os.stat(f"/proc/{pid}").st_uid != os.getuid():
            return False
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            argv = handle.read().split(b"\0")
    except OSError:
        return False
    if len(argv) <= 4 or argv[3] != SHIM_NAME.encode():
        return False
    if exit_path is None:
        return True
    wanted = os.fsencode(exit_path)
    if argv[4] == wanted:
        return True
    try:
        return os.path.realpath(argv[4]) == os.path.realpath(wanted)
    except (OSError, ValueError):
        return False


def find_shim(exit_path: Path) -> tuple[int, int] | None:
    """``(pid, start time)`` of our live shim writing ``exit_path``, or None.

    For an execution whose daemon died between spawning the shim and recording
    its pid: the exit path (one per attempt) names the shim in its command line.
    """
    wanted = str(exit_path).encode()
    uid = os.getuid()
    try:
        entries = list(os.scandir(_PROC))
    except OSError:
        return None
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid != uid:
                continue
            with open(f"/proc/{entry.name}/cmdline", "rb") as handle:
                argv = handle.read().split(b"\0")
        except OSError:
            continue
        if len(argv) > 4 and argv[3] == SHIM_NAME.encode() and argv[4] == wanted:
            stat = proc_stat(int(entry.name))
            if stat is not None and stat[0] not in ("Z", "X"):
                return int(entry.name), stat[1]
    return None


def group_may_be_signalled(pid: int, start_time: int) -> bool:
    """Whether ``killpg(pid)`` can only reach the shim's own process group.

    The kernel does not hand out a pid again while a process group of that
    id exists. So once the shim is gone, a live process with its pid but
    another start time means the old group is empty, and the pid may lead
    someone else's group now: do not signal it.
    """
    stat = proc_stat(pid)
    return stat is None or stat[1] == start_time


def last_log_line(path: Path, offset: int = 0, limit: int = TAIL_LIMIT) -> str | None:
    """The last non-empty line written to ``path`` after ``offset``, skipping our notes.

    Lines starting with ``[kandevd] `` are the daemon's own notes, not the
    agent's. Only the last ``limit`` bytes are read; when the line found
    began before them, it is reported as ``<line too long>`` (a summary line
    is small, an agent writing a megabyte without a newline has none).
    """
    return _last_line(path, offset, limit, _LOG_PREFIX)


def last_line(path: Path, limit: int = TAIL_LIMIT) -> str | None:
    """The last non-empty line of ``path`` (the agent's stdout file), None when none.

    Like :func:`last_log_line` without skipping anything: every line of the
    stdout file is the agent's.
    """
    return _last_line(path, 0, limit, None)


def _last_line(path: Path, offset: int, limit: int, skip: bytes | None) -> str | None:
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            start = max(offset, size - limit, 0)
            clipped = start > offset
            if clipped:  # one byte more: does the window begin at a line start?
                handle.seek(start - 1)
                data = handle.read(size - start + 1)
                first_complete = data[:1] == b"\n"
                data = data[1:]
            else:
                handle.seek(start)
                data = handle.read(size - start)
                first_complete = True
    except OSError:
        return None
    lines = data.split(b"\n")
    for index in range(len(lines) - 1, -1, -1):
        line = lines[index].strip()
        if not line or (skip is not None and line.startswith(skip)):
            continue
        if index == 0 and not first_complete:
            return LINE_TOO_LONG
        return line.decode("utf-8", errors="replace")
    return None
