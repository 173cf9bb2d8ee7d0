"""How the pool of agent executions stops (the stopping half of :class:`AgentRuntime`).

``stop()``: no new reservations or starts; with ``keep_agents`` every
execution a later instance can adopt is detached (it keeps running, outcome
``detached``); the others get ``stop_grace_s`` to end, then are interrupted
(SIGTERM, kill grace, SIGKILL); every worker is joined. ``kill_all_now()`` is
the forced exit: SIGKILL everything, join nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kandevd.runtime.execution import (
    FAILED,
    INTERRUPTED,
    STOPPED,
    ExecutionControl,
    ExecutionResult,
    ExecutionSpec,
    describe_exit,
    ended_by_stop_signal,
)
from kandevd.runtime.records import ExecutionRecord

#: How long a foreign signal death waits for the daemon's own stop request before it
#: counts as an ordinary failed attempt (see ``_stop_is_coming``).
SIGNAL_STOP_WINDOW_S = 2.0

log = logging.getLogger("kandevd.runtime")

SHUTDOWN_REASON = "daemon shutting down"
FORCED_REASON = "forced exit"


@dataclass(eq=False)
class LiveExecution:
    """An execution holding a slot, until its on_done has returned."""

    spec: ExecutionSpec
    control: ExecutionControl
    on_done: Callable[[ExecutionResult], None]
    thread: threading.Thread | None = None
    finished: bool = False  # the runner returned: the child is reaped (or left running)
    record: ExecutionRecord | None = None  # set for an adopted execution
    #: What the runner began with no thread waiting (see kandevd.runtime.threadless).
    begun: Any = None
    #: The result already known when a worker takes it up (it could not even start).
    preset: ExecutionResult | None = None


class Stopping:
    """The stop of the pool; the state is :class:`~kandevd.runtime.pool.AgentRuntime`'s."""

    _cond: threading.Condition
    _work_ready: threading.Condition
    _live: dict[str, LiveExecution]
    _threads: list[threading.Thread]
    _jobs: deque[LiveExecution]
    _stop_grace_s: float
    shutdown_reason: str
    _stopping: bool
    _stop_begun: bool
    _stopped: bool
    _pool_closed: bool
    _grace_deadline: float | None
    _shutdown_requested: Callable[[float], bool] | None
    _close_watch: Callable[[], None]

    def stop_execution(self, key: str, reason: str = "cancelled") -> bool:
        """Terminate a live execution (outcome ``stopped``).

        False when no such execution is running (unknown, or its child has
        already ended and only on_done is left).
        """
        with self._cond:
            execution = self._live.get(key)
            if execution is None or execution.finished:
                return False
        execution.control.request_termination(STOPPED, reason)
        log.info("stopping execution %s: %s", key, reason)
        return True

    def interrupt_execution(self, key: str, reason: str, kill_grace_s: float) -> bool:
        """End a live execution as ``interrupted`` (it counts no attempt): SIGTERM, then
        SIGKILL ``kill_grace_s`` later. A fenced daemon stops its agents so."""
        with self._cond:
            execution = self._live.get(key)
            if execution is None or execution.finished:
                return False
        if execution.control.request_termination(INTERRUPTED, reason, kill_grace_s):
            return True
        execution.control.hasten_kill(kill_grace_s)  # (being stopped already: sooner)
        return False

    def detach_execution(self, key: str) -> bool:
        """Leave a live execution's agent running (outcome ``detached``) for a later
        instance to adopt; False when it has no record to be adopted by, or is over."""
        with self._cond:
            execution = self._live.get(key)
            if execution is None or execution.finished or (
                    execution.record is None and execution.spec.record_dir is None):
                return False
        return execution.control.request_detach()

    def begin_grace(self) -> None:
        """Start the ``stop_grace_s`` clock now (the daemon's shutdown began).

        :meth:`stop` then waits only for what is left of it, so the loops stopped
        before the runtime (a scheduled session ends its turn after the same grace)
        and the runtime share one grace instead of adding theirs up.
        """
        with self._cond:
            if self._grace_deadline is None:
                self._grace_deadline = time.monotonic() + self._stop_grace_s

    def stop(self, keep_agents: bool = False) -> None:
        """Stop accepting work, let executions finish within the grace, then end them.

        With ``keep_agents`` the agents are neither waited for nor signalled:
        every execution that a later instance can adopt (a process execution
        with a record folder) is detached at once, outcome ``detached``
        (on_done still runs), and keeps running. The others (in-process ones,
        and process ones without a record folder, which nobody could adopt)
        are waited for and interrupted as without it.

        Idempotent and safe from several threads: the first caller does the
        work (its ``keep_agents`` decides), the others wait for it to complete.
        A caller inside a worker (an on_done calling stop()) is never waited
        for and never joins itself, so it cannot deadlock; it returns once
        the stop has begun.
        """
        me = threading.current_thread()
        with self._cond:
            # A worker thread (on_done or a slot listener calling stop()) must
            # never wait for the stop, which joins that very thread.
            in_worker = me in self._threads
            first = not self._stop_begun
            self._stop_begun = True
            self._stopping = True
            self._cond.notify_all()  # launch_when_free waiters give up
            if not first:
                if in_worker:
                    return
                while not self._stopped:
                    self._cond.wait()
                # The first caller may have been a worker, which cannot wait
                # for itself: make sure that one is gone too.
                while self._others_live(me):
                    self._cond.wait()
                threads = list(self._threads)
        if not first:
            self._join_all(threads, me)
            return
        self._stop_first(me, keep_agents)

    def _stop_first(self, me: threading.Thread, keep_agents: bool) -> None:
        """The work of stop(), done by its first caller only."""
        if keep_agents:
            with self._cond:
                # Only what a later instance can adopt: it needs a record folder.
                candidates = [e for e in self._others_live(me) if not e.finished
                              and (e.record is not None or e.spec.record_dir is not None)]
            asked = [e for e in candidates if e.control.request_detach()]
            if asked:
                log.info("runtime stopping: leaving the agents of %d execution(s) running "
                         "where they can be adopted", len(asked))
        with self._cond:
            others = self._others_live(me)
            if others:
                log.info("runtime stopping: waiting up to %ss for %d execution(s)",
                         self._stop_grace_s, len(others))
            deadline = self._grace_deadline or time.monotonic() + self._stop_grace_s
            while self._others_live(me):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            leftover = [e for e in self._others_live(me) if not e.finished]
        if leftover:
            log.warning("runtime stopping: interrupting %d execution(s) still running: %s",
                        len(leftover), ", ".join(sorted(e.spec.key for e in leftover)))
            for execution in leftover:
                execution.control.request_termination(INTERRUPTED, self.shutdown_reason)
        with self._cond:
            # No deadline here: each runner escalates to SIGKILL after its
            # kill grace, so every execution ends; on_done then frees the slot.
            while self._others_live(me):
                self._cond.wait()
            self._pool_closed = True
            self._work_ready.notify_all()
        self._close_watch()
        with self._cond:
            threads = list(self._threads)
        self._join_all(threads, me)
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        log.info("runtime stopped")

    def kill_all_now(self, quiet: bool = False) -> None:
        """Forced exit: SIGKILL every live process group at once; join nothing.

        ``quiet``: no logging (called from a signal handler, see kandevd.app.shutdown).
        """
        with self._cond:
            self._stopping = True
            executions = list(self._live.values())
        for execution in executions:
            execution.control.request_termination(INTERRUPTED, FORCED_REASON)
            execution.control.kill_now()
        if executions and not quiet:
            log.warning("killed %d execution(s) on forced exit", len(executions))

    def _join_all(self, threads: list[threading.Thread], me: threading.Thread) -> None:
        for thread in threads:
            if thread is not me:
                thread.join()
        with self._cond:
            self._threads = [t for t in self._threads if t.is_alive()]

    def _others_live(self, me: threading.Thread) -> list[LiveExecution]:
        return [e for e in self._live.values() if e.thread is not me]


    def _stop_is_coming(self) -> bool:
        """The runtime stops, its grace began, or the daemon's stop is requested soon.

        The last one matters when a signal reaches the agents together with the
        daemon (systemd's control group, a terminal's process group): an agent
        may die before the shutdown has reached the runtime, and even before the
        daemon's main thread has run its signal handler (a busy machine can hold
        it off while the keeper already reports the death). So the request is
        awaited for up to :data:`SIGNAL_STOP_WINDOW_S`; only a death by a signal
        nobody here sent pays that delay.
        """
        with self._cond:
            if self._stopping or self._grace_deadline is not None:
                return True
        requested = self._shutdown_requested
        return bool(requested is not None and requested(SIGNAL_STOP_WINDOW_S))

    def _interrupted_if_stopping(self, execution: LiveExecution,
                                 result: ExecutionResult) -> ExecutionResult:
        """An agent a stop signal ended while the runtime stops, unasked by us, was
        interrupted (killed by it, or exiting ``128 + N`` after handling it).

        The signal most likely came with the stop itself (a terminal's Ctrl-C reaching
        the whole process group, systemd's final SIGKILL): the run stays queued for the
        next start and uses no retry, instead of counting as an ordinary failure.
        """
        if (result.outcome == FAILED and ended_by_stop_signal(result.exit_code)
                and execution.control.requested is None and self._stop_is_coming()):
            log.info("execution %s: %s while the runtime was stopping: interrupted",
                     result.key, describe_exit(result.exit_code))
            return dataclasses.replace(
                result, outcome=INTERRUPTED,
                error=f"{INTERRUPTED}: {describe_exit(result.exit_code)} during shutdown")
        return result
