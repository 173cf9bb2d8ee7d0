"""The keeper's agents: spawned directly, watched, signalled, and their exits learnt.

An agent is spawned with ``posix_spawn`` (no shell, no fork of the keeper):
its stdin, stdout and stderr are the descriptors the daemon handed over, it
leads a session and process group of its own, and every signal is back to
its default disposition (the keeper ignores some). Its exit is learnt by
``waitid`` as its parent; an agent a keeper before this one started (the
keeper died, or was replaced) is watched through a pidfd and its exit read
from ``/proc/<pid>/stat`` while it is a zombie, else from the pidfd itself
(``PIDFD_GET_INFO``, Linux 6.15), which tells it to a process that is not the
parent. Before an agent is reaped, what is left of its process group is
killed: nothing it started outlives it unnoticed.
"""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import struct
import time
from dataclasses import dataclass
from typing import Any

from kandevd.keeper.journal import Entry

log = logging.getLogger("kandevd.keeper")

#: Every signal back to its default in the agent (SIGPIPE is ignored in Python, ...).
_DEFAULT_SIGNALS = frozenset(signal.valid_signals()) - {signal.SIGKILL, signal.SIGSTOP}
#: ``_IOWR(0xFF, 11, struct pidfd_info)`` with the 64-byte first version of the struct.
_PIDFD_GET_INFO = (3 << 30) | (64 << 16) | (0xFF << 8) | 11
_PIDFD_INFO_EXIT = 0x8
_EXIT_CODE_OFFSET = 60


@dataclass(eq=False)
class Agent:
    """One execution the keeper watches."""

    entry: Entry
    pidfd: int | None
    #: The keeper's own child (reaped with waitid), else adopted from an earlier keeper.
    child: bool
    deadline: float  # monotonic
    ended_by: str | None = None
    reason: str = ""
    kill_at: float | None = None  # monotonic: SIGKILL then
    killed: bool = False

    @property
    def pid(self) -> int:
        return self.entry.pid

    def next_timer(self) -> float | None:
        if self.ended_by is None:
            return self.deadline
        return None if self.killed else self.kill_at

    def terminate(self, outcome: str, reason: str, grace: float, now: float) -> None:
        """SIGTERM (and SIGCONT: a stopped agent would keep it pending) to the group;
        SIGKILL ``grace`` later. A second request only brings the SIGKILL nearer."""
        kill_at = now + max(grace, 0.0)
        if self.ended_by is not None:
            if self.kill_at is not None and kill_at < self.kill_at:
                self.kill_at = kill_at
            return
        self.ended_by, self.reason, self.kill_at = outcome, reason, kill_at
        self.signal_group(signal.SIGTERM)
        self.signal_group(signal.SIGCONT)

    def on_timer(self, now: float) -> None:
        if self.ended_by is None and now >= self.deadline:
            self.terminate("timed_out", "", self.entry.grace, now)
        elif self.kill_at is not None and not self.killed and now >= self.kill_at:
            self.killed = True
            self.signal_group(signal.SIGKILL)

    def signal_group(self, sig: int) -> None:
        """Signal the agent's process group, if it can still only be the agent's."""
        if not self.child and not _group_is_ours(self.entry.pid, self.entry.start):
            return
        try:
            os.killpg(self.entry.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def exit_line(self, code: int | None) -> dict[str, Any]:
        return {"code": code, "by": self.ended_by, "reason": self.reason,
                "killed": self.killed, "at": time.time()}

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


def spawn(path: str, argv: list[str], env: dict[str, str], cwd: str,
          stdio: tuple[int, int, int]) -> int:
    """Start an agent; its pid (OSError when it cannot start: the keeper lives on).

    The keeper is single-threaded, so changing its working folder for the
    spawn is safe (``posix_spawn`` has no chdir of its own in Python)."""
    os.chdir(cwd)
    try:
        return os.posix_spawn(
            path, argv, env,
            file_actions=[(os.POSIX_SPAWN_DUP2, stdio[0], 0),
                          (os.POSIX_SPAWN_DUP2, stdio[1], 1),
                          (os.POSIX_SPAWN_DUP2, stdio[2], 2)],
            setsid=True, setsigdef=_DEFAULT_SIGNALS, setsigmask=())
    finally:
        os.chdir("/")


def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """``(state, start time, exit status)`` from ``/proc/<pid>/stat``; None when gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            raw = handle.read()
        fields = raw[raw.rindex(b")") + 2:].split()
        # state is field 3, start time field 22, exit_code field 52 (from field 3 on).
        exit_status = int(fields[49]) if len(fields) > 49 else 0
        return fields[0].decode(), int(fields[19]), exit_status
    except (OSError, ValueError, IndexError):
        return None


def start_time(pid: int) -> int:
    stat = proc_stat(pid)
    return stat[1] if stat is not None else 0


#: The unit of ``/proc/<pid>/stat``'s start time (clock ticks), in nanoseconds.
_TICK_NS = 10**9 // os.sysconf("SC_CLK_TCK")


class StartClock:
    """An agent's start time as ``/proc/<pid>/stat`` gives it, mostly without reading it.

    The kernel stamps a new process with the boot-time clock while it is created
    and shows that stamp in clock ticks; read just before and just after the spawn,
    the same clock brackets it, and when both readings fall in one tick, that tick
    is the start time (a ``/proc`` read costs more than the rest of the spawn's
    bookkeeping on some machines). The first spawns are checked against ``/proc``;
    one that disagrees (a kernel that stamps differently) turns the shortcut off.
    """

    CHECKS = 3

    def __init__(self) -> None:
        self.checked = 0
        self.trusted: bool | None = None  # None: still checking

    @staticmethod
    def now() -> int:
        return time.clock_gettime_ns(time.CLOCK_BOOTTIME)

    def start_of(self, pid: int, before_ns: int, after_ns: int) -> int:
        """``pid``'s start time, spawned between the two boot-clock readings."""
        tick = before_ns // _TICK_NS
        bracketed = tick == after_ns // _TICK_NS
        if bracketed and self.trusted:
            return tick
        read = start_time(pid)
        if bracketed and self.trusted is None and read:
            if read != tick:
                self.trusted = False
                log.warning("agent start times cannot be told from the boot clock here "
                            "(%d against %d in /proc); /proc is read for every spawn",
                            tick, read)
            else:
                self.checked += 1
                self.trusted = True if self.checked >= self.CHECKS else None
        return read


def running(pid: int, start: int) -> bool:
    """Is ``pid`` still the process that started at ``start``, and not yet exited?"""
    stat = proc_stat(pid)
    return stat is not None and stat[1] == start and stat[0] not in ("Z", "X")


def _group_is_ours(pid: int, start: int) -> bool:
    """Once the leader is gone its pid (and so the group's id) may lead someone else's
    group: only while no other process holds that pid is the group the agent's."""
    stat = proc_stat(pid)
    return stat is None or stat[1] == start


def code_from_status(status: int) -> int:
    """A wait status as the runtime's exit code (``-N``: killed by signal N)."""
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else -1


def foreign_exit(agent: Agent) -> int | None:
    """The exit code of an agent that is not our child, once it ended; None if unknown."""
    return foreign_exit_of(agent.entry.pid, agent.entry.start, agent.pidfd)


def foreign_exit_of(pid: int, start: int, pidfd: int | None) -> int | None:
    """The exit code of the ended process ``pid`` (started at ``start``) that is not the
    caller's child: read from ``/proc`` while it is a zombie, else from ``pidfd`` once its
    parent reaped it (Linux 6.15 and later); None when neither tells."""
    stat = proc_stat(pid)
    if stat is not None and stat[1] == start and stat[0] == "Z":
        return code_from_status(stat[2])
    if pidfd is None:
        return None
    info = bytearray(64)
    struct.pack_into("Q", info, 0, _PIDFD_INFO_EXIT)
    try:
        fcntl.ioctl(pidfd, _PIDFD_GET_INFO, info)
    except OSError:
        return None
    if not struct.unpack_from("Q", info, 0)[0] & _PIDFD_INFO_EXIT:
        return None  # (not reaped yet by its parent, or a kernel older than 6.15)
    return code_from_status(struct.unpack_from("i", info, _EXIT_CODE_OFFSET)[0])


def open_pidfd(pid: int, start: int) -> int | None:
    """A pidfd of the process ``pid`` that started at ``start``; None when it is gone
    (checked after the pidfd is open, so the pidfd is that process's)."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return None
    stat = proc_stat(pid)
    if stat is None or stat[1] != start:
        os.close(pidfd)
        return None
    return pidfd
