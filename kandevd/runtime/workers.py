"""The pool's threads (the working half of :class:`AgentRuntime`): a worker runs,
adopts or finishes one execution after another, and hands each result on.

Workers are started on demand, reused, and joined by ``stop()`` (see
:mod:`kandevd.runtime.stopping`); an execution that needs none (see
:mod:`kandevd.runtime.threadless`) is concluded where its end was heard.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from kandevd.runtime.execution import ERROR, ExecutionResult
from kandevd.runtime.stopping import LiveExecution
from kandevd.timeutil import utc_now

log = logging.getLogger("kandevd.runtime")


class Workers:
    """The pool's threads; the state is :class:`~kandevd.runtime.pool.AgentRuntime`'s."""

    _runner: Any
    _cond: threading.Condition
    _work_ready: threading.Condition
    _live: dict[str, LiveExecution]
    _threads: list[threading.Thread]
    _jobs: deque[LiveExecution]
    _idle_workers: int
    _workers_started: int
    _pool_closed: bool
    _listeners: list[Callable[[], None]]
    _interrupted_if_stopping: Callable[[LiveExecution, ExecutionResult], ExecutionResult]

    def _start_worker(self, execution: LiveExecution) -> None:
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

    def _work(self, execution: LiveExecution) -> None:
        result, fatal = self._outcome_of(execution)
        self._conclude(execution, result)
        if fatal is not None:
            raise fatal

    def _outcome_of(self, execution: LiveExecution
                    ) -> tuple[ExecutionResult, BaseException | None]:
        """Run (or adopt, or finish) the execution; its result, and what must be raised
        once it is concluded (SystemExit, KeyboardInterrupt: not ours to swallow)."""
        fatal: BaseException | None = None
        try:
            if execution.preset is not None:
                result = execution.preset
            elif execution.begun is not None:
                result = self._runner.finish(execution.begun, execution.control)
            elif execution.record is not None:
                result = self._runner.adopt(execution.spec, execution.control, execution.record)
            else:
                result = self._runner.run(execution.spec, execution.control)
        except BaseException as exc:  # a runner bug must not kill the worker silently
            if not isinstance(exc, Exception):
                fatal = exc  # (this worker dies after the execution is settled)
            log.exception("runner failed for execution %s", execution.spec.key)
            result = self._runner_failed(execution, exc)
        return self._interrupted_if_stopping(execution, result), fatal

    def _runner_failed(self, execution: LiveExecution, exc: BaseException) -> ExecutionResult:
        now = utc_now()
        record = execution.record
        return ExecutionResult(
            key=execution.spec.key, outcome=ERROR, exit_code=None, summary=None,
            cost_cents=None, error=f"runner failed: {type(exc).__name__}: {exc}",
            started_at=min(now, record.started_at) if record is not None else now,
            ended_at=now, log_path=execution.spec.log_path)

    def _conclude(self, execution: LiveExecution, result: ExecutionResult) -> None:
        """Hand the result on (on_done) and free the slot."""
        spec = execution.spec
        try:
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

    def _notify_slot_listeners(self) -> None:
        with self._cond:
            listeners = list(self._listeners)
        for callback in listeners:
            try:
                callback()
            except Exception:
                log.exception("slot listener %r raised; ignored", callback)
