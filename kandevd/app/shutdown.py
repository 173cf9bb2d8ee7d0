"""ShutdownCoordinator and signal wiring.

The order is the whole point (see docs/architecture.md)::

    Graceful shutdown started
    1. intake off      control socket answers shutting_down, in-flight requests
                       finish, the listener closes
    2. loops           stopped in reverse start order, each joined (its tick and
                       every handler it fanned out)
    3. agent runtime   waits stop_grace_s, then SIGTERM/SIGKILL, joins workers
    4. connections     remaining control connections closed and joined
    5. event bus       closed
    6. store           closed: every user of it has joined by now
    Graceful shutdown complete          <- the very last line

A failing step is logged and recorded, and the next step still runs.

Signals: the handler only records the request (an Event) for the main
thread; a second SIGINT/SIGTERM while the stop is in progress writes
``Received second shutdown signal, forcing exit`` straight to fd 2 (no
logging module inside a handler), kills the agents and exits 1 at once.
SIGHUP only sets ``reload_requested``; it never stops the daemon. For
that to hold, the main thread must never sit in a wait a signal cannot end:
the kernel may hand a process-directed signal to any thread, and the Python
handler only runs when the main thread next executes bytecode. So the main
thread waits in :class:`MainThreadWaiter` (``select`` on a self-pipe that is
also the interpreter's ``signal.set_wakeup_fd``: every signal, whichever
thread receives it, makes the pipe readable), and the daemon runs
:meth:`ShutdownCoordinator.shutdown` in a joined worker thread.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import threading
from collections.abc import Callable, Sequence
from types import FrameType

log = logging.getLogger("kandevd.shutdown")

Step = tuple[str, Callable[[], None]]

#: Written raw to fd 2 (no logging module inside a signal handler) on a forced exit.
FORCED_LINE = b"kandevd: Received second shutdown signal, forcing exit\n"


class ShutdownCoordinator:
    def __init__(self, steps: Sequence[Step],
                 on_started: Callable[[], None] | None = None) -> None:
        self._steps = list(steps)
        self._on_started = on_started
        self._lock = threading.Lock()
        self._started = threading.Event()
        self._done = threading.Event()
        self.failures: list[tuple[str, BaseException]] = []

    @property
    def started(self) -> bool:
        return self._started.is_set()

    def shutdown(self) -> list[tuple[str, BaseException]]:
        """Run every step in order exactly once; later callers wait for the first."""
        with self._lock:
            first = not self._started.is_set()
            self._started.set()
        if not first:
            self._done.wait()
            return self.failures
        if self._on_started is not None:  # systemd's STOPPING=1, with the line below
            try:
                self._on_started()
            except Exception:
                log.exception("shutdown start notification failed; ignored")
        log.info("Graceful shutdown started")
        for name, step in self._steps:
            log.debug("shutdown: %s", name)
            try:
                step()
            except BaseException as exc:  # keep going: every later step must still run
                self.failures.append((name, exc))
                log.error("shutdown step %r failed: %s", name, exc, exc_info=exc)
        if self.failures:
            log.error("shutdown finished with %d failed step(s): %s", len(self.failures),
                      ", ".join(name for name, _ in self.failures))
        log.info("Graceful shutdown complete")
        self._done.set()
        return self.failures


class SignalWiring:
    """SIGINT/SIGTERM -> ``stop_requested``; a second one during the stop forces exit.

    SIGHUP -> ``reload_requested`` (when given): reload what can be reloaded, never stop.
    """

    def __init__(self, stop_requested: threading.Event,
                 is_stopping: Callable[[], bool],
                 on_force: Callable[[], None] | None = None,
                 reload_requested: threading.Event | None = None) -> None:
        self._stop_requested = stop_requested
        self._is_stopping = is_stopping
        self._on_force = on_force
        self._reload_requested = reload_requested
        self._previous: dict[int, object] = {}
        self.received: str | None = None  # the stop signal's name, logged by the stopper

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        if self._reload_requested is not None:
            self._previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, self._handle_hup)

    def _handle_hup(self, _signum: int, _frame: FrameType | None) -> None:
        # Only the flag: the main thread does the reload and says what it reloaded.
        assert self._reload_requested is not None
        self._reload_requested.set()

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if self._stop_requested.is_set() or self._is_stopping():
            # No logging-module work here: the interrupted code may hold a handler's
            # lock (a deadlock), and a half-written record is fine to lose. One raw
            # write to stderr, kill the agents, and out.
            try:
                # Never block here: stderr may be a pipe nobody reads any more (the
                # very reason the stop hangs); the line is then lost, the exit is not.
                os.set_blocking(2, False)
                os.write(2, FORCED_LINE)
            except OSError:
                pass
            if self._on_force is not None:
                try:
                    self._on_force()
                except BaseException:  # forcing exit must not be stopped by cleanup
                    pass
            os._exit(1)
        # Not logged here either: a blocked log handler (stderr nobody reads) would
        # keep the main thread in this handler, and the second signal's handler could
        # then never run. The shutdown worker logs it.
        self.received = signal.Signals(signum).name
        self._stop_requested.set()


class MainThreadWaiter:
    """Blocks the main thread until an Event is set, without polling, yet signal-safe.

    The write end of a self-pipe is registered with ``signal.set_wakeup_fd``:
    the C-level handler writes to it whichever thread the kernel chose, so the
    main thread's ``select`` returns and the Python signal handler runs. Other
    threads that set an awaited Event call :meth:`poke`.
    """

    def __init__(self) -> None:
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)
        self._previous_fd: int | None = None

    def install(self) -> None:
        """Register the pipe as the wakeup fd (main thread only)."""
        self._previous_fd = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)

    def poke(self) -> None:
        try:
            os.write(self._write_fd, b"\0")
        except (BlockingIOError, OSError):
            pass  # the pipe is full (a wake-up is pending anyway) or closed

    def wait(self, *events: threading.Event) -> None:
        """Return once any of ``events`` is set."""
        while not any(event.is_set() for event in events):
            select.select([self._read_fd], [], [])
            try:
                while os.read(self._read_fd, 512):
                    pass
            except BlockingIOError:
                pass

    def close(self) -> None:
        if self._previous_fd is not None:
            signal.set_wakeup_fd(self._previous_fd)
            self._previous_fd = None
        for fd in (self._read_fd, self._write_fd):
            try:
                os.close(fd)
            except OSError:
                pass
