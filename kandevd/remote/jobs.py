"""What a runner holds: each execution handed to it, until the server has its end."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from kandevd.gateway.protocol import Ending, Execution, Held
from kandevd.runtime import ExecutionResult
from kandevd.timeutil import rfc3339

#: What an execution's and a run's ids may be (they become file names on the runner).
SAFE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*(\.[A-Za-z0-9_-]+)*")


@dataclass
class Job:
    """An execution this runner holds."""

    execution: Execution
    log_path: Path
    sent: int = 0
    result: ExecutionResult | None = None
    #: The server refused its output: it is no longer this runner's.
    refused: bool = False
    #: Stopped by the fence (said once).
    fenced: bool = False

    @property
    def held(self) -> Held:
        return {"id": self.execution["id"], "run_id": self.execution["run_id"]}


def ending_of(result: ExecutionResult) -> Ending:
    """The end of ``result`` as the runner protocol reports it."""
    return {"outcome": result.outcome, "exit_code": result.exit_code,
            "summary": result.summary, "cost_cents": result.cost_cents,
            "evaluation": result.evaluation, "error": result.error,
            "started_at": rfc3339(result.started_at), "ended_at": rfc3339(result.ended_at)}
