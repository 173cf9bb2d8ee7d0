"""Agent processes left behind by a daemon instance that died without stopping them.

Every agent runs in its own session (see ``process.py``), so a ``kill -9`` of
the daemon alone does not reach its agents: they keep executing runs the
database still shows as claimed by the dead instance. The next instance
re-queues those claims and would start a second execution of the same run
while the first is still going. So, at start-up and before re-queuing, the
daemon stops what its predecessors left.

An execution is recognised by its environment, which the runner always sets
on the agent's shim (see ``shim.py``), and the agent inherits:
``KANDEVD_HOME=<home>`` plus ``KANDEVD_RUN_ID`` and ``KANDEVD_SESSION_ID``
(empty for a launch, which is an orphan all the same). Requiring all three
keeps a user's shell that merely exports ``KANDEVD_HOME`` out of it. Only
session leaders are taken: the shim leads its own session and process group,
and signalling that group reaches the agent and whatever it started inside it
(the shim survives SIGTERM long enough to record the agent's exit status).
Whoever holds the home lock is the only daemon of the home, so every agent of
the home still alive at that moment belongs to an earlier instance, except
the shims the new instance adopted: the caller passes their pids as ``keep``.

Waiting is done on pidfds with select (no sleep loop); only a kernel without
``pidfd_open`` falls back to polling. This is Linux only: elsewhere there is
no ``/proc`` to scan and nothing is found.
"""

from __future__ import annotations

import logging
import os
import selectors
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("kandevd.runtime.orphans")

_PROC = Path("/proc")
#: Upper bound on waiting for SIGKILLed processes to disappear: a process stuck
#: in the kernel (a dead NFS mount) must not hold the daemon's start forever.
_KILL_WAIT_S = 10.0
#: Poll interval of the fallback for kernels without pidfd_open.
_POLL_S = 0.02


@dataclass(frozen=True)
class Orphan:
    """One agent process found in ``/proc``: its pid (= its process group) and work."""

    pid: int
    run_id: str
    session_id: str

    @property
    def what(self) -> str:
        if self.run_id:
            return f"run {self.run_id}"
        return f"session {self.session_id}" if self.session_id else "launch"


def find_orphan_agents(home: Path, *, keep: frozenset[int] = frozenset()) -> list[int]:
    """Pids of live agent processes of ``home`` (session leaders, our uid), sorted.

    Pids in ``keep`` (adopted shims) are never reported.
    """
    return [orphan.pid for orphan in scan(home, keep=keep)]


def scan(home: Path, *, keep: frozenset[int] = frozenset()) -> list[Orphan]:
    """Like :func:`find_orphan_agents`, with each agent's run or session id."""
    if not sys.platform.startswith("linux"):
        return []
    markers = _markers(home)
    try:
        entries = list(os.scandir(_PROC))
    except OSError:
        return []
    skip = _ancestors() | set(keep)
    uid = os.getuid()
    found: list[Orphan] = []
    for entry in entries:
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        if pid in skip:
            continue
        try:
            if entry.stat().st_uid != uid:
                continue
        except OSError:  # vanished
            continue
        orphan = _inspect(pid, markers)
        if orphan is not None:
            found.append(orphan)
    return sorted(found, key=lambda orphan: orphan.pid)


def stop_orphan_agents(home: Path, grace_s: float, *,
                       keep: frozenset[int] = frozenset()) -> int:
    """SIGTERM the agents of ``home``, SIGKILL them after ``grace_s``; how many were stopped.

    ``keep``: pids of session leaders to leave alone (the shims of executions
    this instance adopted). Returns once every other one is gone (or, for a
    process the kernel will not let die, after a bounded wait that is logged
    as an error).
    """
    orphans = scan(home, keep=keep)
    if not orphans:
        return 0
    markers = _markers(home)
    targets: dict[int, int | None] = {}  # pid -> pidfd (None: this kernel has none)
    try:
        for orphan in orphans:
            pinned, pidfd = _pin(orphan, markers)
            if pinned:
                targets[orphan.pid] = pidfd
                log.warning("stopping agent process %d (%s) left by a previous instance",
                            orphan.pid, orphan.what)
        if not targets:
            return 0
        for pid in targets:
            _signal_group(pid, signal.SIGTERM)
            # A stopped process would keep SIGTERM pending for ever; let it act on it.
            _signal_group(pid, signal.SIGCONT)
        alive = _wait_gone(targets, time.monotonic() + max(grace_s, 0.0))
        if alive:
            log.warning("agent process(es) %s still running %.1fs after SIGTERM: SIGKILL",
                        ", ".join(map(str, sorted(alive))), grace_s)
        # Every group, not only the survivors: a leader that obeyed SIGTERM may
        # leave children in its group that did not.
        for pid in targets:
            _signal_group(pid, signal.SIGKILL)
        stuck = _wait_gone({pid: targets[pid] for pid in alive},
                           time.monotonic() + _KILL_WAIT_S)
    finally:
        for pidfd in targets.values():
            if pidfd is not None:
                os.close(pidfd)
    if stuck:
        log.error("agent process(es) %s did not exit after SIGKILL",
                  ", ".join(map(str, sorted(stuck))))
    stopped = len(targets) - len(stuck)
    log.info("stopped %d agent process(es) left by a previous instance", stopped)
    return stopped


def _markers(home: Path) -> frozenset[bytes]:
    """The ``KANDEVD_HOME=`` entries naming ``home`` (as given and resolved)."""
    forms = {str(home), str(Path(home).resolve())}
    return frozenset(f"KANDEVD_HOME={form}".encode() for form in forms)


def _ancestors() -> set[int]:
    """Our pid and our ancestors': never ours to stop, whatever their environment."""
    pids = {os.getpid()}
    pid = os.getppid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        try:
            stat = (_PROC / str(pid) / "stat").read_bytes()
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
            pid = int(stat[stat.rindex(b")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return pids


def _inspect(pid: int, markers: frozenset[bytes]) -> Orphan | None:
    """The agent running as ``pid``, or None (not one, not ours, gone, unreadable)."""
    try:
        raw = (_PROC / str(pid) / "environ").read_bytes()  # b"" for a zombie
    except OSError:  # vanished, not permitted
        return None
    entries = raw.split(b"\0")
    if markers.isdisjoint(entries):
        return None
    values: dict[bytes, bytes] = {}
    for item in entries:
        name, sep, value = item.partition(b"=")
        if sep and name in (b"KANDEVD_RUN_ID", b"KANDEVD_SESSION_ID"):
            values[name] = value
    if len(values) != 2:
        return None
    try:
        if os.getsid(pid) != pid:  # not an agent itself, a process it started
            return None
    except OSError:
        return None
    return Orphan(pid, values[b"KANDEVD_RUN_ID"].decode(errors="replace"),
                  values[b"KANDEVD_SESSION_ID"].decode(errors="replace"))


def _pin(orphan: Orphan, markers: frozenset[bytes]) -> tuple[bool, int | None]:
    """Open a pidfd on the orphan and check it is still the process we found.

    Checking after the pidfd is open means the pidfd refers to the agent
    itself and not to a process that got its pid in between.
    """
    pidfd: int | None = None
    opener = getattr(os, "pidfd_open", None)
    if opener is not None:
        try:
            pidfd = opener(orphan.pid)
        except ProcessLookupError:
            return False, None
        except OSError:  # no pidfds on this kernel: fall back to polling
            pidfd = None
    if _inspect(orphan.pid, markers) is None:
        if pidfd is not None:
            os.close(pidfd)
        return False, None
    return True, pidfd


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
    except PermissionError:
        log.warning("not permitted to signal process group %d with %s", pgid, sig)


def _wait_gone(targets: dict[int, int | None], deadline: float) -> set[int]:
    """Wait until every target has exited or ``deadline``; the pids still running."""
    alive = set(targets)
    polled = {pid for pid, pidfd in targets.items() if pidfd is None}
    sel = selectors.DefaultSelector()
    try:
        for pid, pidfd in targets.items():
            if pidfd is not None:
                sel.register(pidfd, selectors.EVENT_READ, pid)  # readable once it exited
        while alive:
            alive -= {pid for pid in polled if _gone(pid)}
            polled &= alive
            remaining = deadline - time.monotonic()
            if not alive or remaining <= 0:
                break
            timeout = min(remaining, _POLL_S) if polled else remaining
            for key, _mask in sel.select(timeout):
                sel.unregister(key.fileobj)
                alive.discard(key.data)
    finally:
        sel.close()
    return alive


def _gone(pid: int) -> bool:
    """Exited (reaped or a zombie); only used without pidfds."""
    try:
        stat = (_PROC / str(pid) / "stat").read_bytes()
    except OSError:
        return True
    try:
        return stat[stat.rindex(b")") + 2:].split()[0] in (b"Z", b"X")
    except (ValueError, IndexError):
        return True
