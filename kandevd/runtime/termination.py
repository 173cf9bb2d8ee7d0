"""Waiting for a shim to end, and ending its process group on request.

One ``select()`` over a pidfd of the shim and the control's wake pipe, with
the next deadline as its timeout: nothing polls (except on kernels without
pidfd_open). A timeout or a termination request sends SIGTERM to the group,
and SIGKILL after the kill grace. A SIGTERM sent right after the spawn can be
lost: between ``sh`` forking the agent's subshell and that subshell resetting
the shim's no-op trap, the signal runs the inherited trap and the agent never
sees it; so a termination begun less than 200 ms after the spawn sends SIGTERM
to the group again 50 ms and 150 ms later.
"""

from __future__ import annotations

import logging
import os
import selectors
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from kandevd.runtime.execution import (
    TIMED_OUT,
    ExecutionControl,
    signal_group,
    termination_text,
)
from kandevd.runtime.output import LogSink

log = logging.getLogger("kandevd.runtime.process")

#: Poll interval of the fallback for kernels without pidfd_open.
_POLL_S = 0.05
#: Longest single select(): a deadline years away must not overflow the timeout.
_MAX_WAIT_S = 3600.0
#: A termination begun this soon after the spawn repeats its SIGTERM (see the docstring).
_EARLY_TERM_S = 0.2
#: When it repeats it, counted from the first SIGTERM.
_TERM_REPEATS_S = (0.05, 0.15)


@dataclass
class Waited:
    """How the wait for a shim ended."""

    ended_by: tuple[str, str] | None = None  # the termination we carried out
    detached: bool = False
    killed: bool = False  # we sent SIGKILL


def wait_for_shim(key: str, control: ExecutionControl, sink: LogSink, pid: int,
              pidfd: int | None, deadline: float, timeout_s: float,
              exited: Callable[[], bool], *, kill_grace_s: float, detachable: bool,
              spawned_at: float | None = None) -> Waited:
    """Wait until the shim ``pid`` exits or the wait is detached; enforce deadlines.

    ``pidfd`` (readable once the shim exited) is waited on with select;
    only without one is ``exited()`` polled. ``spawned_at`` (monotonic) is
    when we spawned the shim: a termination soon after repeats its SIGTERM.
    An exit seen together with a termination request wins: the execution
    ended on its own (except for a forced exit, whose SIGKILL ended it).
    """
    waited = Waited()
    kill_at: float | None = None
    repeat_at: list[float] = []  # when SIGTERM goes to the group again
    sel = selectors.DefaultSelector()
    try:
        sel.register(control.wake_fd, selectors.EVENT_READ, "wake")
        if pidfd is not None:
            sel.register(pidfd, selectors.EVENT_READ, "exit")

        grace = kill_grace_s

        def begin_termination(outcome: str, reason: str) -> None:
            nonlocal kill_at, grace
            waited.ended_by = (outcome, reason)
            if control.kill_grace_s is not None:  # (a fence asks for a shorter one)
                grace = control.kill_grace_s
            kill_at = time.monotonic() + grace
            text = termination_text(outcome, reason, timeout_s)
            log.warning("execution %s %s: SIGTERM to process group %d", key, text, pid)
            sink.note(f"{text}: sending SIGTERM to process group {pid}")
            signal_group(pid, signal.SIGTERM)
            # A stopped process would keep SIGTERM pending until the SIGKILL.
            signal_group(pid, signal.SIGCONT)
            now = time.monotonic()
            if spawned_at is not None and now - spawned_at < _EARLY_TERM_S:
                # The agent's subshell may have swallowed it (see the module docstring).
                repeat_at[:] = [now + delay for delay in _TERM_REPEATS_S]

        while True:
            now = time.monotonic()
            if repeat_at and now >= repeat_at[0] and not waited.killed:
                del repeat_at[0]
                signal_group(pid, signal.SIGTERM)
            if waited.ended_by is None and now >= deadline:
                begin_termination(TIMED_OUT, "")
            elif kill_at is not None and not waited.killed and now >= kill_at:
                waited.killed = True
                log.warning("execution %s ignored SIGTERM for %.1fs: SIGKILL", key, grace)
                sink.note(f"still running {grace:g}s after SIGTERM: sending SIGKILL")
                signal_group(pid, signal.SIGKILL)
            if pidfd is None and exited():
                return waited
            if waited.ended_by is None:
                wait: float | None = deadline - now
            elif not waited.killed:
                wait = (kill_at or now) - now
            else:
                wait = None
            if repeat_at and not waited.killed:
                wait = repeat_at[0] - now if wait is None else min(wait, repeat_at[0] - now)
            if pidfd is None:  # no pidfd: the only place we must poll for exit
                wait = _POLL_S if wait is None else min(wait, _POLL_S)
            if wait is not None:
                wait = min(max(wait, 0.0), _MAX_WAIT_S)
            events = {ready.data for ready, _mask in sel.select(wait)}
            if "wake" in events:
                control.drain_wake()
                if kill_at is not None and control.hasten_at is not None:
                    kill_at = min(kill_at, control.hasten_at)
                request = control.requested
                if waited.ended_by is None and request is not None and "exit" in events:
                    # Requested as the shim exited: it ended on its own and its
                    # status counts; unless a forced exit's SIGKILL ended it.
                    if control.kill_requested:
                        waited.ended_by = request
                        waited.killed = True
                elif waited.ended_by is None and request is not None:
                    begin_termination(*request)
                elif (waited.ended_by is None and detachable and "exit" not in events
                      and control.detach_requested):
                    waited.detached = True
                    return waited
            if "exit" in events:
                return waited
    finally:
        sel.close()


def open_pidfd(pid: int) -> int | None:
    """A pidfd (readable on exit) when the kernel has them, else None."""
    opener = getattr(os, "pidfd_open", None)
    if opener is None:
        return None
    try:
        return opener(pid)
    except OSError:
        return None


def has_exited(pid: int) -> bool:
    """True once the child has exited, without reaping it (WNOWAIT)."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return info is not None


