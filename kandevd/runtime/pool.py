"""AgentRuntime: the one bounded pool every agent execution goes through.

Queued runs, Kanban launches and scheduled turns all share
``runtime.max_concurrent`` slots, so the bound is global. A slot is taken in
two steps so a caller can hold one while it does other work (the queue claims
a run only once it knows a slot is free)::

    try_reserve() -> Reservation --start(spec, on_done)--> running --> on_done --> free
         |                                                                  |
         +------------------------- release() ------------------------> free

Executions run on a pool of non-daemon workers owned here (started on demand,
reused, joined by ``stop()``; see :mod:`kandevd.runtime.workers` and
:mod:`kandevd.runtime.stopping`), except those the runner can begin with no
thread waiting for them (:mod:`kandevd.runtime.threadless`). ``adopt()``
takes over an execution an earlier daemon instance started; it takes a slot
even beyond ``max_concurrent`` (the work exists already).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path

from kandevd.runtime.execution import (
    ExecutionControl,
    ExecutionResult,
    ExecutionSpec,
    Runner,
)
from kandevd.runtime.process import ProcessRunner
from kandevd.runtime.records import ExecutionRecord, read_record
from kandevd.runtime.stopping import SHUTDOWN_REASON, LiveExecution, Stopping
from kandevd.runtime.threadless import Threadless
from kandevd.runtime.workers import Workers

log = logging.getLogger("kandevd.runtime")


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


class RuntimeHeld(RuntimeStopped):
    """The runtime starts nothing for now (a fenced daemon); the work goes back."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason

    def __str__(self) -> str:
        return f"agent runtime is held: {self.reason}"


class Reservation:
    """An opaque token for one reserved slot; spend it with start() or release()."""

    __slots__ = ("_owner", "_state")

    def __init__(self, owner: AgentRuntime) -> None:
        self._owner = owner
        self._state = "held"  # held -> started | released

    def __repr__(self) -> str:
        return f"<Reservation {self._state}>"


class AgentRuntime(Stopping, Threadless, Workers):
    """A bounded pool of agent executions; see the module docstring."""

    def __init__(self, max_concurrent: int, stop_grace_s: float, *,
                 runner: Runner | None = None, kill_grace_s: float = 5.0,
                 shutdown_requested: Callable[[float], bool] | None = None,
                 on_slot_free: Callable[[], None] | None = None,
                 shutdown_reason: str = SHUTDOWN_REASON) -> None:
        """``shutdown_requested(timeout)``: waits up to ``timeout`` for the daemon's
        "stop requested" (set from its signal handler): an agent that a signal ends
        then counts as interrupted. ``on_slot_free()``: called whenever a slot frees
        (the queue loop's wake-up). ``shutdown_reason``: what the stop tells each agent
        it interrupts (a runner's is its own, not the daemon's)."""
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, not {max_concurrent!r}")
        if stop_grace_s < 0:
            raise ValueError(f"stop_grace_s must be >= 0, not {stop_grace_s!r}")
        self._max = max_concurrent
        self._stop_grace_s = stop_grace_s
        self.shutdown_reason = shutdown_reason
        self._runner: Runner = runner if runner is not None else ProcessRunner(kill_grace_s)
        #: The runner opens and closes a run's attempt in its log (``ExecutionSpec.attempt``).
        self.frames_logs: bool = getattr(self._runner, "frames_logs", False)
        lock = threading.RLock()
        self._cond = threading.Condition(lock)
        #: Idle workers wait here, apart from ``_cond``: its many notify_all() calls (a
        #: slot freed, a reservation given back) must wake only ``_cond``'s waiters.
        self._work_ready = threading.Condition(lock)
        self._held = 0  # reservations not yet started or released
        self._live: dict[str, LiveExecution] = {}
        self._threads: list[threading.Thread] = []  # the pool's workers
        self._jobs: deque[LiveExecution] = deque()  # registered, not yet taken by a worker
        self._idle_workers = 0
        self._workers_started = 0  # names each worker (a dead one's name is not reused)
        self._pool_closed = False  # stop(): workers exit once the queue is empty
        self._listeners: list[Callable[[], None]] = [on_slot_free] if on_slot_free else []
        self._stopping = False  # no new reservations or starts (stop or kill_all_now)
        self._stop_begun = False  # stop() has a first caller doing the work
        self._stopped = False  # that caller has finished
        self._waiting: list[int] = []  # launch_when_free callers, in arrival order
        self._next_ticket = 0
        self._waiter_slots = 0  # slots held by executions started by launch_when_free
        self._grace_deadline: float | None = None  # set by begin_grace()
        self._shutdown_requested = shutdown_requested
        #: Why no execution starts now (a fenced daemon), else None.
        self.held_reason: str | None = None
        self._init_threadless()

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
    def running(self) -> int:
        """Executions started and not yet settled: what ``daemon.status`` reports as
        ``active`` (a slot merely reserved by a pass still looking for work is not)."""
        with self._cond:
            return len(self._live)

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

    def settle(self, results: list[ExecutionResult]) -> None:
        """These outcomes are recorded for good: what kept them for a restart may go."""
        self.settle_ids([r.execution_id for r in results if r.execution_id])

    def settle_ids(self, ids: list[str]) -> None:
        """Like :meth:`settle`, by the executions' keeper names (a turn's record folder's)."""
        settle = getattr(self._runner, "settle_ids", None)
        if settle is not None and ids:
            settle(ids)

    def release_unclaimed(self) -> None:
        """After the restart's restore: what the keeper still reports that nobody took up
        (its run was re-queued, its turn settled) is forgotten, its agent stopped."""
        release = getattr(self._runner, "release_unclaimed", None)
        if release is not None:
            release()

    def record_for(self, record_dir: Path) -> ExecutionRecord | None:
        """What is known of the execution whose record folder is ``record_dir``: the
        keeper's record, else the ``record.json`` an older version's shim left there."""
        find = getattr(self._runner, "record_for", None)
        found = find(record_dir) if find is not None else None
        return found if found is not None else read_record(record_dir)

    # -- slots -------------------------------------------------------------

    def hold_and_interrupt(self, reason: str, kill_grace_s: float) -> frozenset[str]:
        """A fenced daemon: start no execution until :meth:`release_hold` (no slot is
        reserved, a reserved one starts nothing, a waiting scheduled turn gives up), then
        end every live one as ``interrupted`` (SIGKILL after ``kill_grace_s``); the keys
        it ended."""
        with self._cond:
            self.held_reason = reason
            self._cond.notify_all()
            keys = frozenset(self._live)
        for key in keys:
            self.interrupt_execution(key, reason, kill_grace_s)
        return keys

    def release_hold(self) -> None:
        with self._cond:
            self.held_reason = None
            self._cond.notify_all()
        self._notify_slot_listeners()

    def try_reserve(self) -> Reservation | None:
        """Take a slot if one is free; None when full, stopping or held. Never blocks."""
        with self._cond:
            if self._stopping or self.held_reason is not None \
                    or self._held + len(self._live) >= self._max:
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
            elif self.held_reason is not None:  # (reserved before a fence: start nothing)
                problem = RuntimeHeld(self.held_reason)
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
        if self._threadless(execution):
            self._begin(execution)
        else:
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
                  record: ExecutionRecord | None) -> LiveExecution:
        """A live execution with its (unstarted) worker; the caller holds the lock.

        Raises (registering nothing) when the pipe a worker waits on cannot be made.
        """
        control = ExecutionControl()
        execution = LiveExecution(spec, control, on_done, record=record)
        if not self._threadless(execution):
            control.wake_fd  # noqa: B018 (made now: a worker waits on it)
        self._live[spec.key] = execution
        return execution

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
                    if self._stopping or self.held_reason is not None or cancelled():
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
