"""AgentRuntime: the one bounded pool every agent execution goes through.

Queued runs, Kanban launches and scheduled workflow turns all share
``runtime.max_concurrent`` slots, so the bound is global. A slot is taken in
two steps so a caller can hold one while it does other work (the queue claims
a run in the database only once it knows a slot is free)::

    try_reserve() -> Reservation --start(spec, on_done)--> running --> on_done --> free
         |                                                                  |
         +------------------------- release() ------------------------> free
                                                                  (slot listeners fire)

Runtime states::

    accepting --stop()--> stopping: no new reservations or starts;
                          [keep_agents: detach every execution that can be
                           adopted later: it keeps running, outcome "detached"]
                          wait up to stop_grace_s for executions to end;
                          then interrupt the rest (SIGTERM, kill grace, SIGKILL);
                          join every worker --> stopped

Executions run on a pool of non-daemon worker threads owned here: started
on demand up to ``max_concurrent`` (plus one per adopted execution beyond
the bound), kept waiting for the next execution, and joined by ``stop()``.
No thread is created per execution. A worker takes an execution off the
pool's queue before it runs it, so a worker that dies (a BaseException out
of a runner) loses that one execution's bookkeeping, never runs it again;
the next submission finds no idle worker and starts a replacement.
``kill_all_now()`` is the forced-exit path: SIGKILL everything, join nothing.

``adopt()`` takes over an execution an earlier daemon instance started (its
shim is still running, see :mod:`kandevd.runtime.records`): it is waited for,
timed out, stopped and interrupted like any other. It takes a slot even
beyond ``max_concurrent`` (the work exists already); new reservations then
wait until the count is below the bound again.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kandevd.runtime.process import (
    ERROR,
    FAILED,
    INTERRUPTED,
    STOPPED,
    ExecutionControl,
    ExecutionResult,
    ExecutionSpec,
    ProcessRunner,
    Runner,
    describe_exit,
)
from kandevd.runtime.records import ExecutionRecord
from kandevd.timeutil import utc_now

log = logging.getLogger("kandevd.runtime")

SHUTDOWN_REASON = "daemon shutting down"
FORCED_REASON = "forced exit"


class RuntimeFull(Exception):
    """Every slot is taken; the caller should try again when a slot frees."""

    def __init__(self, max_concurrent: int) -> None:
        super().__init__(max_concurrent)
        self.max_concurrent = max_concurrent

    def __str__(self) -> str:
        return f"agent runtime is full: all {self.max_concurrent} slots are in use"


class RuntimeStopped(Exception):
    """The runtime is stopping or stopped and accepts no new executions."""

    def __str__(self) -> str:
        return "agent runtime is stopping: no new executions are accepted"


class Reservation:
    """An opaque token for one reserved slot; spend it with start() or release()."""

    __slots__ = ("_owner", "_state")

    def __init__(self, owner: AgentRuntime) -> None:
        self._owner = owner
        self._state = "held"  # held -> started | released

    def __repr__(self) -> str:
        return f"<Reservation {self._state}>"


@dataclass(eq=False)
class _Execution:
    spec: ExecutionSpec
    control: ExecutionControl
    on_done: Callable[[ExecutionResult], None]
    thread: threading.Thread | None = None
    finished: bool = False  # the runner returned: the child is reaped (or left running)
    record: ExecutionRecord | None = None  # set for an adopted execution


class AgentRuntime:
    """A bounded pool of agent executions; see the module docstring."""

    def __init__(self, max_concurrent: int, stop_grace_s: float, *,
                 runner: Runner | None = None, kill_grace_s: float = 5.0) -> None:
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, not {max_concurrent!r}")
        if stop_grace_s < 0:
            raise ValueError(f"stop_grace_s must be >= 0, not {stop_grace_s!r}")
        self._max = max_concurrent
        self._stop_grace_s = stop_grace_s
        self._runner: Runner = runner if runner is not None else ProcessRunner(kill_grace_s)
        lock = threading.RLock()
        self._cond = threading.Condition(lock)
        #: The pool's idle workers wait here, on the same lock but apart from ``_cond``:
        #: the runtime's many notify_all() calls (a slot freed, a reservation given
        #: back) must not wake every idle worker each time, only a new execution one.
        self._work_ready = threading.Condition(lock)
        self._held = 0  # reservations not yet started or released
        self._live: dict[str, _Execution] = {}
        self._threads: list[threading.Thread] = []  # the pool's workers
        self._jobs: deque[_Execution] = deque()  # registered, not yet taken by a worker
        self._idle_workers = 0
        self._workers_started = 0  # names each worker (a dead one's name is not reused)
        self._pool_closed = False  # stop(): workers exit once the queue is empty
        self._listeners: list[Callable[[], None]] = []
        self._stopping = False  # no new reservations or starts (stop or kill_all_now)
        self._stop_begun = False  # stop() has a first caller doing the work
        self._stopped = False  # that caller has finished
        self._waiting: list[int] = []  # launch_when_free callers, in arrival order
        self._next_ticket = 0
        self._waiter_slots = 0  # slots held by executions started by launch_when_free
        self._grace_deadline: float | None = None  # set by begin_grace()
        #: The daemon's "stop requested" (set from its signal handler), if any.
        self.shutdown_requested: Callable[[], bool] | None = None

    # -- introspection -----------------------------------------------------

    @property
    def max_concurrent(self) -> int:
        """The slot bound."""
        return self._max

    @property
    def active(self) -> int:
        """Slots in use: reserved plus running (including on_done still running)."""
        with self._cond:
            return self._held + len(self._live)

    @property
    def all_running(self) -> bool:
        """Every slot runs an execution (no reservation is held, so no claim is under way)."""
        with self._cond:
            return self._held == 0 and len(self._live) >= self._max

    @property
    def stopping(self) -> bool:
        """True once stop() or kill_all_now() began."""
        with self._cond:
            return self._stopping

    def is_live(self, key: str) -> bool:
        """True while ``key`` holds a slot (until its on_done has returned)."""
        with self._cond:
            return key in self._live

    def live_keys(self) -> frozenset[str]:
        """Keys of every execution that holds a slot."""
        with self._cond:
            return frozenset(self._live)

    def add_slot_listener(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` whenever a slot frees (the queue loop's wake-up)."""
        with self._cond:
            self._listeners.append(callback)

    # -- slots -------------------------------------------------------------

    def try_reserve(self) -> Reservation | None:
        """Take a slot if one is free; None when full or stopping. Never blocks."""
        with self._cond:
            if self._stopping or self._held + len(self._live) >= self._max:
                return None
            self._held += 1
            return Reservation(self)

    def release(self, reservation: Reservation) -> None:
        """Give back an unused reservation. Releasing a spent one is a no-op."""
        with self._cond:
            if reservation._owner is not self:
                raise ValueError("reservation belongs to another runtime")
            if reservation._state != "held":
                return
            reservation._state = "released"
            self._held -= 1
            self._cond.notify_all()
        # No slot listener here: the releaser is the one who just looked for work and
        # found none; waking it again would spin the queue loop.

    def start(self, reservation: Reservation, spec: ExecutionSpec,
              on_done: Callable[[ExecutionResult], None]) -> None:
        """Run ``spec`` on the reserved slot in a new worker thread.

        ``on_done(result)`` runs in that worker after the child is reaped; the
        slot frees when it returns. If start() raises (whatever the reason,
        also running out of file descriptors for the execution's wake pipe or
        of threads), the reservation has been released, so the caller never
        leaks a slot.
        """
        with self._cond:
            if reservation._owner is not self:
                raise ValueError("reservation belongs to another runtime")
            if reservation._state != "held":
                raise ValueError(f"reservation already {reservation._state}")
            problem: BaseException | None = None
            if self._stopping:
                problem = RuntimeStopped()
            elif spec.key in self._live:
                problem = ValueError(f"an execution with key {spec.key!r} is already live")
            if problem is None:
                try:
                    execution = self._register(spec, on_done, None)
                except BaseException as exc:  # e.g. os.pipe() failing with EMFILE
                    problem = exc
                else:
                    reservation._state = "started"
                    self._held -= 1
        if problem is not None:
            self.release(reservation)
            raise problem
        log.debug("starting %s execution %s", spec.kind, spec.key)
        self._start_worker(execution)

    def adopt(self, spec: ExecutionSpec, record: ExecutionRecord,
              on_done: Callable[[ExecutionResult], None]) -> None:
        """Take over the still-running execution of ``record`` (an earlier instance's).

        A worker waits for its shim like for any execution: the record's
        deadline applies (a past one ends it at once), :meth:`stop_execution`
        and :meth:`stop` act on it, and ``on_done(result)`` runs when it ended.
        It takes a slot even when all are in use. Raises RuntimeStopped when
        stopping, ValueError when ``spec.key`` is live already.
        """
        with self._cond:
            if self._stopping:
                raise RuntimeStopped()
            if spec.key in self._live:
                raise ValueError(f"an execution with key {spec.key!r} is already live")
            execution = self._register(spec, on_done, record)
        log.debug("adopting %s execution %s (shim pid %d)", spec.kind, spec.key, record.pid)
        self._start_worker(execution)

    def _register(self, spec: ExecutionSpec, on_done: Callable[[ExecutionResult], None],
                  record: ExecutionRecord | None) -> _Execution:
        """A live execution with its (unstarted) worker; the caller holds the lock.

        Raises (registering nothing) when the control's pipe cannot be made.
        """
        control = ExecutionControl()
        execution = _Execution(spec, control, on_done, record=record)
        self._live[spec.key] = execution
        return execution

    def _start_worker(self, execution: _Execution) -> None:
        """Queue ``execution`` for the pool, starting a worker if none is idle."""
        with self._cond:
            self._jobs.append(execution)
            if len(self._jobs) <= self._idle_workers:
                self._work_ready.notify()
                return
            self._threads = [t for t in self._threads if t.is_alive()]
            self._workers_started += 1
            thread = threading.Thread(target=self._worker, daemon=False,
                                      name=f"kandevd-exec-worker-{self._workers_started}")
            try:
                thread.start()
            except BaseException:  # e.g. "can't start new thread": give the slot back
                self._jobs.remove(execution)
                self._live.pop(execution.spec.key, None)
                self._cond.notify_all()
                failed = True
            else:
                self._threads.append(thread)
                failed = False
        if failed:
            execution.control.close()
            self._notify_slot_listeners()
            raise RuntimeError(f"cannot start a worker thread for execution "
                               f"{execution.spec.key}")

    def _worker(self) -> None:
        """A pool worker: run executions one after another until the pool closes."""
        me = threading.current_thread()
        while True:
            with self._cond:
                while not self._jobs and not self._pool_closed:
                    self._idle_workers += 1
                    try:
                        self._work_ready.wait()
                    finally:
                        self._idle_workers -= 1
                if not self._jobs:
                    return
                execution = self._jobs.popleft()
                execution.thread = me
            self._work(execution)

    def launch(self, spec: ExecutionSpec, on_done: Callable[[ExecutionResult], None]) -> None:
        """Reserve and start in one step; raises RuntimeFull or RuntimeStopped."""
        reservation = self.try_reserve()
        if reservation is None:
            if self.stopping:
                raise RuntimeStopped()
            raise RuntimeFull(self._max)
        self.start(reservation, spec, on_done)

    def launch_when_free(self, spec: ExecutionSpec, on_done: Callable[[ExecutionResult], None],
                         cancelled: Callable[[], bool]) -> bool:
        """Wait for a slot, then start ``spec`` on it; False when cancelled or stopping.

        The path of scheduled turns, which must never fail for lack of a slot.
        They wait here in arrival order while the queue claims with
        :meth:`try_reserve`; so that a burst of sessions cannot starve the run
        queue, waiting executions together hold at most ``max_concurrent - 1``
        slots (all of them when there is only one). ``cancelled`` is re-checked
        whenever a slot frees or :meth:`wake_waiters` is called.
        """
        cap = max(1, self._max - 1)
        with self._cond:
            ticket = self._next_ticket
            self._next_ticket += 1
            self._waiting.append(ticket)
            try:
                while True:
                    if self._stopping or cancelled():
                        return False
                    if self._waiting[0] == ticket and self._waiter_slots < cap \
                            and self._held + len(self._live) < self._max:
                        break
                    self._cond.wait()
                self._held += 1
                self._waiter_slots += 1
                reservation = Reservation(self)
            finally:
                self._waiting.remove(ticket)
                self._cond.notify_all()

        def done(result: ExecutionResult) -> None:
            with self._cond:
                self._waiter_slots -= 1
            on_done(result)

        try:
            self.start(reservation, spec, done)
        except BaseException:
            with self._cond:
                self._waiter_slots -= 1
                self._cond.notify_all()
            raise
        return True

    def wake_waiters(self) -> None:
        """Make every :meth:`launch_when_free` re-check its ``cancelled``."""
        with self._cond:
            self._cond.notify_all()

    # -- stopping ----------------------------------------------------------

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
                execution.control.request_termination(INTERRUPTED, SHUTDOWN_REASON)
        with self._cond:
            # No deadline here: each runner escalates to SIGKILL after its
            # kill grace, so every execution ends; on_done then frees the slot.
            while self._others_live(me):
                self._cond.wait()
            self._pool_closed = True
            self._work_ready.notify_all()
            threads = list(self._threads)
        self._join_all(threads, me)
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        log.info("runtime stopped")

    def kill_all_now(self, quiet: bool = False) -> None:
        """Forced exit: SIGKILL every live process group at once; join nothing.

        ``quiet``: no logging (called from a signal handler, see kandevd.shutdown).
        """
        with self._cond:
            self._stopping = True
            executions = list(self._live.values())
        for execution in executions:
            execution.control.request_termination(INTERRUPTED, FORCED_REASON)
            execution.control.kill_now()
        if executions and not quiet:
            log.warning("killed %d execution(s) on forced exit", len(executions))

    # -- internals ---------------------------------------------------------

    def _join_all(self, threads: list[threading.Thread], me: threading.Thread) -> None:
        for thread in threads:
            if thread is not me:
                thread.join()
        with self._cond:
            self._threads = [t for t in self._threads if t.is_alive()]

    def _others_live(self, me: threading.Thread) -> list[_Execution]:
        return [e for e in self._live.values() if e.thread is not me]

    def _work(self, execution: _Execution) -> None:
        spec = execution.spec
        record = execution.record
        fatal: BaseException | None = None
        try:
            try:
                if record is not None:
                    result = self._runner.adopt(spec, execution.control, record)
                else:
                    result = self._runner.run(spec, execution.control)
            except BaseException as exc:  # a runner bug must not kill the worker silently
                if not isinstance(exc, Exception):
                    # Not ours to swallow (SystemExit, KeyboardInterrupt): this worker
                    # dies after the execution is settled; the pool starts another.
                    fatal = exc
                log.exception("runner failed for execution %s", spec.key)
                now = utc_now()
                result = ExecutionResult(
                    key=spec.key, outcome=ERROR, exit_code=None, summary=None,
                    cost_cents=None, error=f"runner failed: {type(exc).__name__}: {exc}",
                    started_at=min(now, record.started_at) if record is not None else now,
                    ended_at=now, log_path=spec.log_path,
                )
            result = self._interrupted_if_stopping(execution, result)
            with self._cond:
                execution.finished = True
            execution.control.close()
            try:
                execution.on_done(result)
            except Exception:
                log.exception("on_done for execution %s raised; ignored", spec.key)
        finally:
            execution.control.close()
            with self._cond:
                if self._live.get(spec.key) is execution:
                    del self._live[spec.key]
                self._cond.notify_all()
            self._notify_slot_listeners()
        if fatal is not None:
            raise fatal

    def _stop_is_coming(self) -> bool:
        """The runtime stops, its grace began, or the daemon's stop was requested.

        The last one matters when a signal reaches the agents together with the
        daemon (systemd's control group, a terminal's process group): an agent
        may die before the shutdown has reached the runtime.
        """
        with self._cond:
            if self._stopping or self._grace_deadline is not None:
                return True
        requested = self.shutdown_requested
        return bool(requested is not None and requested())

    def _interrupted_if_stopping(self, execution: _Execution,
                                 result: ExecutionResult) -> ExecutionResult:
        """An agent a signal ended while the runtime stops, unasked by us, was interrupted.

        The signal most likely came with the stop itself (a terminal's Ctrl-C reaching
        the whole process group, systemd's final SIGKILL): the run stays queued for the
        next start and uses no retry, instead of counting as an ordinary failure.
        """
        if (result.outcome == FAILED and result.exit_code is not None and result.exit_code < 0
                and execution.control.requested is None and self._stop_is_coming()):
            log.info("execution %s: %s while the runtime was stopping: interrupted",
                     result.key, describe_exit(result.exit_code))
            return dataclasses.replace(
                result, outcome=INTERRUPTED,
                error=f"{INTERRUPTED}: {describe_exit(result.exit_code)} during shutdown")
        return result

    def _notify_slot_listeners(self) -> None:
        with self._cond:
            listeners = list(self._listeners)
        for callback in listeners:
            try:
                callback()
            except Exception:
                log.exception("slot listener %r raised; ignored", callback)
