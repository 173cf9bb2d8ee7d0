"""The in-process double of a runner: no child process, no log file.

Benchmarks and tests measure the runtime and the queue with it without
paying for process start-up.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kandevd.runtime.execution import (
    ERROR,
    FAILED,
    SUCCEEDED,
    ExecutionControl,
    ExecutionResult,
    ExecutionSpec,
    termination_error,
)
from kandevd.runtime.records import ExecutionRecord
from kandevd.timeutil import utc_now

log = logging.getLogger("kandevd.runtime.process")


class InProcessRunner:
    """Runs ``fn(spec) -> (exit_code, summary, cost_cents)`` in the worker thread.

    No child process and no log file: this exists so benchmarks and tests can
    measure the runtime and the queue without paying for process start-up.
    ``fn`` cannot be interrupted; a termination requested before it starts
    means it never starts. Detach requests are ignored (there is nothing to
    leave running) and nothing can be adopted.
    """

    def __init__(self, fn: Callable[[ExecutionSpec], tuple[int, str | None, float | None]]):
        self._fn = fn

    def run(self, spec: ExecutionSpec, control: ExecutionControl) -> ExecutionResult:
        """Call ``fn`` and turn its answer (or its exception) into a result."""
        started_at = utc_now()
        outcome: str
        exit_code: int | None = None
        summary: str | None = None
        cost: float | None = None
        error: str | None = None
        request = control.requested
        if request is not None:
            outcome = request[0]
            error = termination_error(request[0], request[1], spec)
        else:
            try:
                exit_code, summary, cost = self._fn(spec)
            except Exception as exc:  # the function's failure is the execution's failure
                log.exception("in-process execution %s raised", spec.key)
                outcome, error = ERROR, f"in-process agent raised {type(exc).__name__}: {exc}"
            else:
                outcome = SUCCEEDED if exit_code == 0 else FAILED
                error = None if exit_code == 0 else f"exit code {exit_code}"
        return ExecutionResult(
            key=spec.key, outcome=outcome, exit_code=exit_code, summary=summary,
            cost_cents=cost, error=error, started_at=started_at, ended_at=utc_now(),
            log_path=spec.log_path,
        )

    def adopt(self, spec: ExecutionSpec, control: ExecutionControl,
              record: ExecutionRecord) -> ExecutionResult:
        """In-process executions never outlive the daemon: nothing to adopt."""
        raise NotImplementedError("an in-process runner cannot adopt a process")
