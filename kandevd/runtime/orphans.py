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
keeps a user's shell that merely exports ``KANDEVD_HOME`` out of it.

The sweep works per *session*: every process carrying the markers is
collected and grouped by its session id (``getsid``). The shim leads its own
session and process group, so an execution is one session; but a shim
SIGKILLed on its own leaves its agent running in that session without a
leader, and the agent must be stopped all the same (else its run executes
twice at once after the restart). A session is stopped by signalling the
process group of each of its marked processes (the shim's group holds the
agent and whatever it started; while the shim lives it survives SIGTERM long
enough to record the agent's exit status). The session a process of ours
belongs to is never touched. Whoever holds the home lock is the only daemon
of the home, so every agent of the home still alive at that moment belongs
to an earlier instance, except the sessions of the shims the new instance
adopted: the caller passes their pids (= their session ids) as ``keep``.

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

from kandevd.keeper.agents import open_pidfd, start_time

log = logging.getLogger("kandevd.runtime.orphans")

_PROC = Path("/proc")
#: Upper bound on waiting for SIGKILLed processes to disappear: a process stuck
#: in the kernel (a dead NFS mount) must not hold the daemon's start forever.
_KILL_WAIT_S = 10.0
#: Poll interval of the fallback for kernels without pidfd_open.
_POLL_S = 0.02


@dataclass(frozen=True)
class Orphan:
    """One execution's session found in ``/proc``, and its work.

    ``pid`` is the session id when its leader (the shim) still runs, else the
    lowest pid of the session's marked processes; ``members`` are all of
    those (pids), sorted.
    """

    pid: int
    run_id: str
    session_id: str
    members: tuple[int, ...] = ()

    @property
    def what(self) -> str:
        if self.run_id:
            return f"run {self.run_id}"
        return f"session {self.session_id}" if self.session_id else "launch"


def find_orphan_agents(home: Path, *, keep: frozenset[int] = frozenset()) -> list[int]:
    """One pid per live agent session of ``home`` (our uid), sorted; see :class:`Orphan`.

    Sessions whose id is in ``keep`` (adopted shims) are never reported.
    """
    return [orphan.pid for orphan in scan(home, keep=keep)]


def scan(home: Path, *, keep: frozenset[int] = frozenset()) -> list[Orphan]:
    """Like :func:`find_orphan_agents`, with each session's members and run or session id."""
    if not sys.platform.startswith("linux"):
        return []
    markers = _markers(home)
    try:
        entries = list(os.scandir(_PROC))
    except OSError:
        return []
    ancestors = _ancestors()
    skip_sessions = set(keep)
    for pid in ancestors:  # never the session of this process or of its parents
        try:
            skip_sessions.add(os.getsid(pid))
        except OSError:
            pass
    uid = os.getuid()
    sessions: dict[int, list[tuple[int, str, str]]] = {}
    for entry in entries:
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        if pid in ancestors:
            continue
        try:
            if entry.stat().st_uid != uid:
                continue
        except OSError:  # vanished
            continue
        found = _inspect(pid, markers)
        if found is None:
            continue
        sid, run_id, session_id = found
        if sid in skip_sessions:
            continue
        sessions.setdefault(sid, []).append((pid, run_id, session_id))
    orphans: list[Orphan] = []
    for sid, members in sessions.items():
        members.sort()
        # The leader's (the shim's) work names the session; else its lowest member's.
        pid, run_id, session_id = next((m for m in members if m[0] == sid), members[0])
        orphans.append(Orphan(pid, run_id, session_id, tuple(m[0] for m in members)))
    return sorted(orphans, key=lambda orphan: orphan.pid)


def find_sessions(home: Path, sessions: dict[str, float], *, settle_s: float = 0.1
                  ) -> dict[str, tuple[int, int, int | None]]:
    """The agents of these execution sessions that run, each started no earlier than
    its time (epoch seconds; a session's turns share its id, and what an earlier turn
    left behind is not this one's agent): ``{session id: (pid, start time, pidfd)}``.
    Looked for twice, ``settle_s`` apart, so an agent between its spawn and its
    ``exec`` (its environment not yet its own) is not missed."""
    wanted = {s: after for s, after in sessions.items() if s}
    found: dict[str, tuple[int, int, int | None]] = {}
    ticks, booted = os.sysconf("SC_CLK_TCK"), _boot_time()
    for attempt in range(2):
        if attempt:
            time.sleep(settle_s)
        for orphan in scan(home):
            if orphan.session_id in wanted and orphan.session_id not in found:
                start = start_time(orphan.pid)
                if booted + start / ticks < wanted[orphan.session_id]:
                    continue
                found[orphan.session_id] = (orphan.pid, start, open_pidfd(orphan.pid, start))
        if len(found) == len(wanted):
            break
    return found


def _boot_time() -> float:
    """When the machine booted (epoch seconds): ``/proc`` counts start times from it."""
    try:
        for line in Path(_PROC, "stat").read_text().splitlines():
            if line.startswith("btime "):
                return float(line.split()[1])
    except OSError:
        pass
    return 0.0


def stop_orphan_agents(home: Path, grace_s: float, *,
                       keep: frozenset[int] = frozenset()) -> int:
    """SIGTERM the agent sessions of ``home``, SIGKILL them after ``grace_s``; how many.

    ``keep``: session ids (= pids of the session leaders) to leave alone: the
    shims of executions this instance adopted. Each other session is stopped
    through the process groups of its marked processes, also when its leader
    is gone. Returns the number of sessions stopped, once every process of
    them is gone (or, for a process the kernel will not let die, after a
    bounded wait that is logged as an error).
    """
    orphans = scan(home, keep=keep)
    if not orphans:
        return 0
    markers = _markers(home)
    targets: dict[int, int | None] = {}  # member pid -> pidfd (None: this kernel has none)
    sessions: dict[int, tuple[int, ...]] = {}  # reported pid -> pinned members
    groups: set[int] = set()
    try:
        for orphan in orphans:
            pinned: list[int] = []
            for member in orphan.members:
                ok, pidfd, pgid = _pin(member, markers)
                if ok:
                    targets[member] = pidfd
                    pinned.append(member)
                    groups.add(pgid)
            if pinned:
                sessions[orphan.pid] = tuple(pinned)
                log.warning("stopping agent process %d (%s) left by a previous instance",
                            orphan.pid, orphan.what)
        if not sessions:
            return 0
        # Each group of a pinned member: it exists as long as that member lives.
        for pgid in sorted(groups):
            _signal_group(pgid, signal.SIGTERM)
            # A stopped process would keep SIGTERM pending for ever; let it act on it.
            _signal_group(pgid, signal.SIGCONT)
        alive = _wait_gone(targets, time.monotonic() + max(grace_s, 0.0))
        if alive:
            log.warning("agent process(es) %s still running %.1fs after SIGTERM: SIGKILL",
                        ", ".join(map(str, sorted(alive))), grace_s)
        # Every group, not only the survivors': a leader that obeyed SIGTERM may
        # leave children in its group that did not.
        for pgid in sorted(groups):
            _signal_group(pgid, signal.SIGKILL)
        stuck = _wait_gone({pid: targets[pid] for pid in alive},
                           time.monotonic() + _KILL_WAIT_S)
    finally:
        for pidfd in targets.values():
            if pidfd is not None:
                os.close(pidfd)
    if stuck:
        log.error("agent process(es) %s did not exit after SIGKILL",
                  ", ".join(map(str, sorted(stuck))))
    stopped = sum(1 for members in sessions.values() if not stuck.issuperset(members))
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


def _inspect(pid: int, markers: frozenset[bytes]) -> tuple[int, str, str] | None:
    """``(session id, run id, session id of the work)`` of a marked process ``pid``.

    None when it is not one of the home's (no markers), gone or unreadable.
    """
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
        sid = os.getsid(pid)
    except OSError:
        return None
    return (sid, values[b"KANDEVD_RUN_ID"].decode(errors="replace"),
            values[b"KANDEVD_SESSION_ID"].decode(errors="replace"))


def _pin(pid: int, markers: frozenset[bytes]) -> tuple[bool, int | None, int]:
    """Open a pidfd on a marked process, check it is still the one we found; its group.

    Checking after the pidfd is open means the pidfd refers to that process
    and not to one that got its pid in between. Returns ``(found, pidfd,
    process group id)``.
    """
    pidfd: int | None = None
    opener = getattr(os, "pidfd_open", None)
    if opener is not None:
        try:
            pidfd = opener(pid)
        except ProcessLookupError:
            return False, None, 0
        except OSError:  # no pidfds on this kernel: fall back to polling
            pidfd = None
    try:
        pgid = os.getpgid(pid) if _inspect(pid, markers) is not None else 0
    except OSError:
        pgid = 0
    if pgid <= 1:
        if pidfd is not None:
            os.close(pidfd)
        return False, None, 0
    return True, pidfd, pgid


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
