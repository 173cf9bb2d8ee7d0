"""Loop: a periodic worker with an explicit, joinable lifecycle.

Every background activity of the daemon (the run queue, Office maintenance,
the cron scheduler) is a Loop. A Loop owns exactly one non-daemon thread and
moves through three states::

                 start()                      stop() / parent stop
    +---------+ --------> +---------+ ------------------------------> +----------+
    | STOPPED |           | RUNNING |                                 | STOPPING |
    +---------+ <-------- +---------+                                 +----------+
         ^       (thread exits after the active tick                       |
         |        and everything it fanned out have returned)              |
         +-----------------------------------------------------------------+

Rules (the habits of huey and APScheduler, without their gaps):

* The work is :meth:`Loop.tick`, a plain method ``tick(now) -> seconds until
  the next tick``. Tests call it directly, with any ``now``, no thread needed.
* ``start()`` while running is a no-op; ``stop()`` while stopped is a no-op.
  Any number of threads may call ``stop()`` at once: one transition happens and
  every caller returns only after the loop thread has exited.
* ``stop()`` cancels the wait, then waits for the active tick and for every
  handler the tick fanned out. It has no internal deadline: stopping means
  the work is finished, not abandoned.
* ``stop()`` from the loop's own thread, or from a handler its tick fanned
  out (a tick or a handler asking its own loop to stop), raises
  :class:`LoopSelfJoinError` instead of deadlocking.
* A parent :class:`StopSignal` (the daemon's) takes the same path as
  ``stop()``: the loop finishes its tick, exits and ends in STOPPED without
  anyone calling ``stop()``; a later ``stop()`` only joins the thread.
  Once the parent is set, ``start()`` refuses (the daemon is going down).
* ``wake()`` interrupts the wait so the next tick runs now. A wake during a
  tick (even from the tick itself) makes the next tick follow at once, so a
  tick must not wake its own loop on every pass or the loop spins.
"""

from __future__ import annotations

import abc
import enum
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from datetime import datetime, timedelta
from typing import Any

from kandevd.timeutil import utc_now

MIN_WAIT_S = 0.01
"""Floor for the wait between ticks, so a zero interval cannot spin a core."""

MAX_WAIT_S = 86_400.0
"""Cap for the wait (an infinite delay would overflow ``Event.wait``); wake() still works."""


class LoopState(enum.Enum):
    STOPPED = "stopped"
    RUNNING = "running"
    STOPPING = "stopping"


class LoopError(RuntimeError):
    """Base class for lifecycle misuse."""


class LoopSelfJoinError(LoopError):
    def __init__(self, name: str) -> None:
        super().__init__(
            f"loop {name!r}: stop() called from the loop's own thread (its tick or a "
            "handler it fanned out); "
            "a loop cannot wait for itself (request the stop from another thread)"
        )


class LoopStateError(LoopError):
    pass


class StopSignal:
    """A one-shot stop request that fans out to the loops listening to it.

    The daemon owns one; each Loop subscribes, so setting it makes every loop
    leave its wait at once (no polling).
    """

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._listeners: list[Callable[[], None]] = []

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)

    def subscribe(self, callback: Callable[[], None]) -> None:
        with self._lock:
            self._listeners.append(callback)
            fired = self._event.is_set()
        if fired:
            callback()

    def set(self) -> None:
        with self._lock:
            if self._event.is_set():
                return
            self._event.set()
            listeners = list(self._listeners)
        for callback in listeners:
            callback()


class FanOut:
    """Runs handlers concurrently, isolating their failures, joinable by its owner.

    Each handler runs in its own non-daemon thread. :meth:`run` returns when
    all of them have returned; an exception in one is logged and returned as
    its result, never raised into the caller or the other handlers.
    :meth:`join` waits for every thread ever started here (used by
    ``Loop.stop`` as a second line of defence).
    """

    def __init__(self, name: str, logger: logging.Logger) -> None:
        self._name = name
        self._log = logger
        #: Failures that are the environment's, not a bug (a database outage): said in
        #: one line, without a traceback.
        self.quiet: Callable[[BaseException], bool] | None = None
        self._lock = threading.Lock()
        self._threads: set[threading.Thread] = set()

    def run(self, handlers: Sequence[tuple[str, Callable[[], Any]]]) -> dict[str, Any]:
        """Run ``(name, handler)`` pairs concurrently; return ``{name: result or exception}``."""
        futures: dict[str, Future[Any]] = {}
        threads = []
        for label, handler in handlers:
            future: Future[Any] = Future()
            futures[label] = future
            thread = threading.Thread(
                target=self._call, args=(label, handler, future),
                name=f"{self._name}:{label}", daemon=False,
            )
            try:
                self._start(thread)
            except BaseException:  # e.g. "can't start new thread": join what did start
                for started in threads:
                    started.join()
                raise
            threads.append(thread)
        for thread in threads:
            thread.join()
        return {label: (f.exception() or f.result()) for label, f in futures.items()}

    def spawn(self, label: str, handler: Callable[[], Any]) -> threading.Thread:
        """Start one handler without waiting for it; :meth:`join` (and so the owning
        loop's ``stop()``) waits for it. For work that outlives the tick that began it,
        such as a scheduled session."""
        future: Future[Any] = Future()
        thread = threading.Thread(target=self._call, args=(label, handler, future),
                                  name=f"{self._name}:{label}", daemon=False)
        self._start(thread)
        return thread

    def _start(self, thread: threading.Thread) -> None:
        """Known and started under one lock: :meth:`join` never meets a thread that is
        known but not started yet (joining one raises). (The thread's own end takes the
        lock after ``start`` returned, so this waits for nothing.)"""
        with self._lock:
            self._threads.add(thread)
            try:
                thread.start()
            except BaseException:
                self._threads.discard(thread)
                raise

    def _call(self, label: str, handler: Callable[[], Any], future: Future[Any]) -> None:
        try:
            future.set_result(handler())
        except BaseException as exc:  # isolate: one handler never kills the others
            if self.quiet is not None and self.quiet(exc):  # (no traceback at every tick)
                self._log.warning("%s: handler %s failed: %s", self._name, label, exc)
            else:
                self._log.exception("%s: handler %s failed", self._name, label)
            future.set_exception(exc)
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    def owns(self, thread: threading.Thread) -> bool:
        """True when ``thread`` is one of this fan-out's live handler threads."""
        with self._lock:
            return thread in self._threads

    def join(self) -> None:
        """Wait for every handler thread started here (except the caller's own)."""
        while True:
            with self._lock:
                pending = [t for t in self._threads if t is not threading.current_thread()]
            if not pending:
                return
            for thread in pending:
                thread.join()


class Loop(abc.ABC):
    """Base class: subclasses implement :meth:`tick` and may override ``on_stopped``."""

    #: wait after a tick that raised, so a persistent fault does not spin
    error_backoff_s: float = 1.0
    #: None, or: look at the clock this often during a wait, and end the wait once the
    #: clock reaches its end. The wait itself runs on the monotonic clock, which stands
    #: still while a laptop sleeps (and may while a virtual machine is paused); a loop
    #: whose ticks are due at wall-clock times sets this so it is late by one such
    #: slice at most after the machine wakes, not by the rest of its wait.
    clock_check_s: float | None = None

    def __init__(
        self,
        name: str,
        *,
        clock: Callable[[], datetime] = utc_now,
        parent: StopSignal | None = None,
        logger: logging.Logger | None = None,
        wakeup: threading.Event | None = None,
        fanout: FanOut | None = None,
    ) -> None:
        """``wakeup``: set to run the next tick now; given, when something built before
        the loop must be able to wake it (else the loop makes its own). ``fanout``: the
        loop's handler threads, given when something built before it starts them."""
        self.name = name
        self.log = logger or logging.getLogger(f"kandevd.{name}")
        self._clock = clock
        self._lock = threading.Lock()
        self._state = LoopState.STOPPED
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._wakeup = wakeup if wakeup is not None else threading.Event()
        self.fanout = fanout if fanout is not None else FanOut(name, self.log)
        self.ticks = 0
        self._last_db_error: str | None = None  # the last database error a tick logged
        self._parent = parent
        if parent is not None:
            parent.subscribe(self._request_stop)

    # -- the work -------------------------------------------------------------
    @abc.abstractmethod
    def tick(self, now: datetime) -> float:
        """Do one iteration; return how many seconds to wait before the next."""

    # -- lifecycle ------------------------------------------------------------
    @property
    def state(self) -> LoopState:
        return self._state

    def start(self) -> None:
        """Start the loop thread; a no-op while running."""
        with self._lock:
            if self._state is LoopState.RUNNING:
                return
            if self._state is LoopState.STOPPING:
                raise LoopStateError(f"loop {self.name!r}: cannot start while stopping")
            if self._parent is not None and self._parent.is_set():
                raise LoopStateError(
                    f"loop {self.name!r}: cannot start after its parent stop signal was set")
            self._stopping.clear()
            self._wakeup.clear()
            thread = threading.Thread(target=self._run, name=f"kandevd-{self.name}")
            self._thread = thread
            self._state = LoopState.RUNNING
            try:
                thread.start()
            except BaseException:  # e.g. "can't start new thread": stay STOPPED, no thread
                self._thread = None
                self._state = LoopState.STOPPED
                raise
        self.log.debug("%s loop started", self.name)

    def stop(self) -> None:
        """Stop and join: returns when the active tick and its fan-out have returned."""
        with self._lock:
            thread = self._thread
            if thread is None:
                return
            me = threading.current_thread()
            if thread is me or self.fanout.owns(me):
                raise LoopSelfJoinError(self.name)
            if self._state is LoopState.RUNNING:
                self._state = LoopState.STOPPING
            self._stopping.set()
            self._wakeup.set()
        thread.join()
        self.fanout.join()
        with self._lock:
            if self._thread is thread:
                self._thread = None
                self._state = LoopState.STOPPED
        self.log.debug("%s loop stopped", self.name)

    def wake(self) -> None:
        """Interrupt the wait so the next tick runs now (cheap, never blocks)."""
        self._wakeup.set()

    def _request_stop(self) -> None:
        with self._lock:
            if self._state is LoopState.RUNNING:
                self._state = LoopState.STOPPING
            self._stopping.set()
            self._wakeup.set()

    # -- the thread -----------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._wakeup.clear()
                try:
                    delay = _wait_seconds(self.tick(self._clock()))
                except sqlite3.DatabaseError as exc:
                    # The database's state, not a bug in the tick: the store reports
                    # damage once; here one line per new reason, no traceback flood.
                    reason = str(exc)
                    level = logging.DEBUG if reason == self._last_db_error else logging.WARNING
                    self._last_db_error = reason
                    self.log.log(level, "%s: tick failed: database error: %s; retrying in "
                                 "%.1fs", self.name, reason, self.error_backoff_s)
                    delay = self.error_backoff_s
                except Exception:
                    self.log.exception("%s: tick failed; retrying in %.1fs",
                                       self.name, self.error_backoff_s)
                    delay = self.error_backoff_s
                else:
                    self._last_db_error = None
                self.ticks += 1
                if self._stopping.is_set():
                    break
                self._sleep(delay)
        finally:
            try:
                self.on_stopping()
            finally:
                self.fanout.join()
                self.on_stopped()
                # Ended by its parent's stop signal: ``stopped``, as stop() ends it, without
                # waiting for anyone to call stop() (which then only joins this thread).
                with self._lock:
                    if (self._parent is not None and self._parent.is_set()
                            and self._thread is threading.current_thread()):
                        self._state = LoopState.STOPPED

    def _sleep(self, delay: float) -> None:
        """Wait ``delay`` seconds or until woken; with :attr:`clock_check_s`, also until
        the loop's clock has moved ``delay`` on (whichever comes first)."""
        if self.clock_check_s is None:
            self._wakeup.wait(delay)
            return
        end = time.monotonic() + delay
        clock_end = self._clock() + timedelta(seconds=delay)
        while True:
            left = end - time.monotonic()
            if left <= 0 or self._wakeup.wait(min(left, self.clock_check_s)):
                return
            if self._clock() >= clock_end:
                return

    def on_stopping(self) -> None:  # noqa: B027 - an optional hook, empty by design
        """Hook run in the loop thread after its last tick, before the fan-out is joined:
        the place to tell long-running handlers (spawned work) to wind down."""

    def on_stopped(self) -> None:  # noqa: B027 - an optional hook, empty by design
        """Hook run in the loop thread after its last tick (e.g. release resources)."""


def _wait_seconds(value: object) -> float:
    """A tick's return value as a usable wait: floored at MIN_WAIT_S, capped for Event.wait."""
    delay = float(value)  # type: ignore[arg-type]  # None or junk raises: a tick bug
    if delay != delay:  # NaN
        raise ValueError("tick returned NaN")
    return min(max(delay, MIN_WAIT_S), MAX_WAIT_S)

