"""Processes an ended agent left behind in a session or group of their own.

Ending an agent signals its process group, so what it started in that group
ends with it. A process it started in a session of its own (``setsid``, a
daemon's double fork) is not in that group: it would run on after the run was
recorded, holding memory, ports or a GPU nobody accounts for. The keeper is
a child subreaper, so such a process, once its parent is gone, becomes the
keeper's own child; the keeper then tells whose it is by the
``KANDEVD_SESSION_ID`` and ``KANDEVD_INPUT`` it inherited (docs/agents.md),
which together name one execution, and ends its process group when that
execution is one this keeper saw end (in the last hour). Anything else is left
alone: a process that dropped those variables, one of a running execution,
and one of another kandevd's (an agent may run kandevd itself: when its keeper
dies, its agents become this keeper's children, with executions of their own).

The keeper is the only one that reaps its children, so a child listed here
cannot be reaped and its pid reused before the keeper is done with it.
"""

from __future__ import annotations

import logging
import os
import signal
from collections import OrderedDict
from collections.abc import Collection

log = logging.getLogger("kandevd.keeper")

#: After an agent ended, how long the keeper waits before it looks for what it left
#: (its group's SIGKILL has to land first, and the ends of a busy drain share a look).
CHECK_AFTER_S = 0.2
#: How long, and for how many executions at most, an ended execution is remembered.
REMEMBER_S = 3600.0
REMEMBER_AT_MOST = 10_000
_SESSION, _INPUT = b"KANDEVD_SESSION_ID=", b"KANDEVD_INPUT="
Execution = tuple[str, str]  # (its KANDEVD_SESSION_ID, its KANDEVD_INPUT)


class Leftovers:
    """The executions this keeper saw end lately, and when to look for what they left."""

    def __init__(self) -> None:
        self._ended: OrderedDict[Execution, float] = OrderedDict()
        #: Monotonic time of the next look (None: none due).
        self.due: float | None = None

    def agent_ended(self, meta: dict[str, object], now: float) -> None:
        """One of this keeper's own agents ended (its spawn's ``meta``)."""
        key = (str(meta.get("session_id")), str(meta.get("input_path")))
        self._ended[key] = now
        self._ended.move_to_end(key)
        while self._ended and (len(self._ended) > REMEMBER_AT_MOST
                               or next(iter(self._ended.values())) < now - REMEMBER_S):
            self._ended.popitem(last=False)
        self.look_soon(now)

    def look_soon(self, now: float) -> None:
        """A child that is no agent was reaped: what it started may be this keeper's now."""
        if self.due is None:
            self.due = now + CHECK_AFTER_S

    def look(self, agents: Collection[int]) -> list[int]:
        """End what the ended executions left (``agents``: the live agents' pids)."""
        self.due = None
        return end_strays(agents, self._ended)


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


def execution_of(pid: int) -> Execution | None:
    """The execution ``pid``'s environment names; None when it names none (or the
    environment cannot be read: a zombie's is empty)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            environ = handle.read()
    except OSError:
        return None
    session = given = None
    for item in environ.split(b"\0"):
        if item.startswith(_SESSION):
            session = item[len(_SESSION):].decode("utf-8", "replace")
        elif item.startswith(_INPUT):
            given = item[len(_INPUT):].decode("utf-8", "replace")
    return (session, given) if session is not None and given is not None else None


def end_strays(agents: Collection[int], ended: Collection[Execution]) -> list[int]:
    """SIGKILL the process group of each child of this process that is not one of
    ``agents`` and names an execution among ``ended``; the pids ended."""
    done = []
    own_group = os.getpgrp()
    for pid in children(os.getpid()):
        if pid in agents:
            continue
        execution = execution_of(pid)
        if execution is None or execution not in ended:
            continue
        session = execution[0]
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
        done.append(pid)
    return done


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm", "rb") as handle:
            return handle.read().strip().decode("utf-8", "replace")
    except OSError:
        return "?"
