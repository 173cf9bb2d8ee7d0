"""Processes an ended agent left behind in a session or group of their own.

Ending an agent signals its process group, so what it started in that group
ends with it. A process it started in a session of its own (``setsid``, a
daemon's double fork) is not in that group: it would run on after the run was
recorded, holding memory, ports or a GPU nobody accounts for. The keeper is
a child subreaper, so such a process, once its parent is gone, becomes the
keeper's own child; the keeper then tells whose it is by the
``KANDEVD_SESSION_ID`` it inherited (docs/agents.md), and ends the process
group of one whose session no running agent has. A process that dropped the
variable from its environment cannot be told apart and is left alone.

The keeper is the only one that reaps its children, so a child listed here
cannot be reaped and its pid reused before the keeper is done with it.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Collection

log = logging.getLogger("kandevd.keeper")

#: After an agent ended, how long the keeper waits before it looks for what it left
#: (its group's SIGKILL has to land first, and the ends of a busy drain share a look).
CHECK_AFTER_S = 0.2
_SESSION = b"KANDEVD_SESSION_ID="


def children(pid: int) -> list[int]:
    """The live and zombie children of ``pid`` (``/proc/<pid>/task/*/children``)."""
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children", "rb") as handle:
                found.extend(int(word) for word in handle.read().split())
        except (OSError, ValueError):
            continue
    return found


def session_of(pid: int) -> str | None:
    """The ``KANDEVD_SESSION_ID`` in ``pid``'s environment; None when it has none (or
    the environment cannot be read)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            environ = handle.read()
    except OSError:
        return None
    for item in environ.split(b"\0"):
        if item.startswith(_SESSION):
            return item[len(_SESSION):].decode("utf-8", "replace")
    return None


def end_strays(agents: Collection[int], live_sessions: Collection[str]) -> list[int]:
    """SIGKILL the process group of each child of this process that is not one of
    ``agents`` and carries a session none of ``live_sessions`` is; the pids ended."""
    ended = []
    own_group = os.getpgrp()
    for pid in children(os.getpid()):
        if pid in agents:
            continue
        session = session_of(pid)
        if session is None or session in live_sessions:
            continue
        name = _name(pid)
        try:
            group = os.getpgid(pid)
            if group != own_group:
                os.killpg(group, signal.SIGKILL)
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:  # (a zombie already: nothing left to end)
            continue
        except OSError as exc:
            log.warning("keeper: process %d, left by an agent of session %s that ended, "
                        "could not be ended: %s", pid, session, exc)
            continue
        log.warning("keeper: process %d (%s), left running by an agent of session %s "
                    "that ended, in a process group of its own: its group was killed",
                    pid, name, session)
        ended.append(pid)
    return ended


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm", "rb") as handle:
            return handle.read().strip().decode("utf-8", "replace")
    except OSError:
        return "?"
