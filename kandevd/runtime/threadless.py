"""Executions no thread waits for (the threadless half of :class:`AgentRuntime`).

With the keeper, an agent's end arrives as the keeper's word on the daemon's
one reader thread, so most executions need no thread of their own: the
runner's ``begin`` writes the files and asks for the agent in the starting
thread, and its ``on_ready`` says when the execution can be finished where
the word arrived (it ended: the outcome is handed on there) or when a thread
must wait for it after all (a stop or detach was asked, the keeper is lost,
or its end takes a while). One watcher hands every execution that has waited
:data:`THREADLESS_WAIT_S` to a thread, which also watches the agent's pidfd
in case the keeper is alive but wedged. See docs/architecture.md.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from kandevd.runtime.execution import ExecutionResult
from kandevd.runtime.stopping import LiveExecution

log = logging.getLogger("kandevd.runtime")

#: How long an execution waits without a thread of its own before one takes it.
THREADLESS_WAIT_S = 5.0
_WATCH_TICK_S = 1.0


class Threadless:
    """Threadless executions; the pool's state is :class:`~kandevd.runtime.pool.AgentRuntime`'s."""

    _runner: Any
    _cond: threading.Condition
    _threads: list[threading.Thread]
    # (the pool's own, see there)
    _start_worker: Callable[[LiveExecution], None]
    _outcome_of: Callable[[LiveExecution], tuple[ExecutionResult, BaseException | None]]
    _conclude: Callable[[LiveExecution, ExecutionResult], None]
    _runner_failed: Callable[[LiveExecution, BaseException], ExecutionResult]

    def _init_threadless(self) -> None:
        self._watch_cond = threading.Condition(threading.Lock())
        self._watched: deque[tuple[float, LiveExecution]] = deque()
        self._watcher: threading.Thread | None = None
        self._watcher_idle = False  # it waits with no deadline: tell it of a new one
        self._watch_closed = False

    def _threadless(self, execution: LiveExecution) -> bool:
        """Can ``execution`` start without a thread (its runner can begin it so)?"""
        ask = getattr(self._runner, "threadless", None)
        return execution.record is None and ask is not None and ask(execution.spec)

    def _begin(self, execution: LiveExecution) -> None:
        """Start ``execution`` in the calling thread, no thread waiting for it."""
        try:
            begun = self._runner.begin(execution.spec, execution.control,
                                       functools.partial(self._on_ready, execution))
        except Exception as exc:  # a runner bug: a worker hands on the error
            log.exception("runner failed for execution %s", execution.spec.key)
            execution.preset = self._runner_failed(execution, exc)
            self._start_worker(execution)
            return
        if isinstance(begun, ExecutionResult):  # it could not start: a worker hands it on
            execution.preset = begun
            self._start_worker(execution)
            return
        execution.begun = begun
        self._watch(execution)

    def _on_ready(self, execution: LiveExecution, begun: Any, ended: bool) -> None:
        """The runner's word on a threadless execution (any thread): finish it here, or
        hand it to a worker."""
        execution.begun = begun
        if ended:  # (never raises: this may be the keeper's reader, which must go on)
            execution.thread = threading.current_thread()
            try:
                result, fatal = self._outcome_of(execution)
                self._conclude(execution, result)
            except Exception:
                log.exception("execution %s could not be concluded", execution.spec.key)
            else:
                if fatal is not None:
                    log.error("execution %s: %r while it was concluded; ignored here",
                              execution.spec.key, fatal)
            return
        try:
            self._start_worker(execution)
        except Exception:
            log.exception("no thread could take execution %s; its outcome is recovered "
                          "at the next start", execution.spec.key)

    def _watch(self, execution: LiveExecution) -> None:
        watcher = None
        with self._watch_cond:
            self._watched.append((time.monotonic() + THREADLESS_WAIT_S, execution))
            if self._watcher is None:
                watcher = self._watcher = threading.Thread(
                    target=self._watch_loop, daemon=False, name="kandevd-exec-watch")
            elif self._watcher_idle:
                self._watch_cond.notify()
        if watcher is not None:
            with self._cond:
                self._threads.append(watcher)  # (joined by stop())
            watcher.start()

    def _watch_loop(self) -> None:
        """Hand every execution still without a thread after THREADLESS_WAIT_S to one."""
        while True:
            due: list[LiveExecution] = []
            with self._watch_cond:
                while not due:
                    if self._watch_closed:
                        return
                    now = time.monotonic()
                    while self._watched and self._watched[0][0] <= now:
                        due.append(self._watched.popleft()[1])
                    if due:
                        break
                    # (at most one wake-up a second: a hand-over may come a second late)
                    timeout = max(self._watched[0][0] - now, _WATCH_TICK_S) \
                        if self._watched else None
                    self._watcher_idle = timeout is None
                    self._watch_cond.wait(timeout)
                    self._watcher_idle = False
            for execution in due:
                if not execution.finished and execution.begun is not None:
                    try:
                        self._runner.hurry(execution.begun)
                    except Exception:
                        log.exception("execution %s: could not hand it to a thread",
                                      execution.spec.key)

    def _close_watch(self) -> None:
        with self._watch_cond:
            self._watch_closed = True
            self._watch_cond.notify_all()
