"""What a runner holds, kept in its home so that a restarted runner takes it back.

Each execution a runner starts is written to ``<home>/executions/<id>.json`` (the
execution as the server handed it) and removed once the server has its outcome.
A runner that starts again (after a crash, or a kill of its process alone) finds
these, and for each whose agent its keeper still runs, adopts the agent (its
output and end are reported as if nothing happened); for each that ended
meanwhile, reports the end its record tells. Those are the executions it names
in its ``hello``; the server keeps their claims, and re-queues the others.
``<home>/runner-state.json`` keeps the server's ``dead_after_s`` for the keeper
of the next start.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from kandevd.fsutil import ensure_dir, replace_atomically
from kandevd.gateway.protocol import Execution
from kandevd.paths import HomeLayout
from kandevd.runtime import ERROR, INTERRUPTED, AgentRuntime, ExecutionResult, ExecutionSpec
from kandevd.runtime.attempts import attempt_dir
from kandevd.runtime.records import locate, outcome_from_record, record_alive

log = logging.getLogger("kandevd.runner")

STATE_FILE = "runner-state.json"


@dataclass
class Kept:
    """An execution taken back at start: adopted (``pid``) or ended (``result``)."""

    execution: Execution
    log_path: Path
    pid: int | None = None
    result: ExecutionResult | None = None


class HeldFiles:
    def __init__(self, layout: HomeLayout) -> None:
        self.layout = layout
        self.folder = layout.root / "executions"

    def keep(self, execution: Execution) -> None:
        ensure_dir(self.folder)
        replace_atomically(self.folder / f"{_safe(execution['id'])}.json",
                           json.dumps(execution) + "\n", durable=False)

    def forget(self, execution_id: str) -> None:
        (self.folder / f"{_safe(execution_id)}.json").unlink(missing_ok=True)

    def saved(self) -> list[Execution]:
        found = []
        for path in sorted(self.folder.glob("*.json")) if self.folder.is_dir() else []:
            try:
                value = json.loads(path.read_text("utf-8"))
            except (OSError, ValueError):
                path.unlink(missing_ok=True)
                continue
            if isinstance(value, dict) and isinstance(value.get("id"), str) \
                    and isinstance(value.get("run_id"), str):
                found.append(value)  # type: ignore[arg-type]
        return found

    def dead_after_s(self) -> float | None:
        try:
            value = json.loads((self.layout.root / STATE_FILE).read_text("utf-8"))
        except (OSError, ValueError):
            return None
        found = value.get("dead_after_s") if isinstance(value, dict) else None
        return float(found) if isinstance(found, int | float) and found > 0 else None

    def remember(self, dead_after_s: float) -> None:
        replace_atomically(self.layout.root / STATE_FILE,
                           json.dumps({"dead_after_s": dead_after_s}) + "\n", durable=False)

    def take_back(self, runtime: AgentRuntime, log_path_of: Callable[[str], Path],
                  done: Callable[[str, ExecutionResult], None]) -> list[Kept]:
        """Adopt the agents still running, read the ends of those that ended; what was
        taken back (the others' files are forgotten: their runs are re-queued)."""
        kept = []
        for execution in self.saved():
            key, run_id = execution["id"], execution["run_id"]
            record_dir = attempt_dir(self.layout.attempts, run_id, key)
            record = runtime.record_for(record_dir)
            if record is None:
                self.forget(key)
                continue
            record = locate(record)
            log_path = log_path_of(key)
            if record_alive(record):
                spec = ExecutionSpec(
                    key=key, kind=execution.get("kind", "run"), argv=record.argv, stdin={},
                    cwd=self.layout.runs / key, log_path=record.log_path,
                    timeout_s=record.timeout_s, session_id=record.session_id,
                    run_id=run_id, home=str(self.layout.root), record_dir=record_dir)
                runtime.adopt(spec, record, lambda result, key=key: done(key, result))
                kept.append(Kept(execution, log_path, pid=record.pid))
                log.info("%s %s: adopted its agent (pid %d) left running by the previous "
                         "runner", execution.get("kind", "run"), run_id, record.pid)
                continue
            ended = outcome_from_record(record, record_dir)
            if ended is None:
                self.forget(key)
                continue
            if ended.outcome == INTERRUPTED:  # its keeper stopped it while no runner ran:
                # a counted attempt (an uncounted one could be retried without bound)
                ended = replace(ended, outcome=ERROR, error="stopped by the runner's keeper "
                                "while no runner process was attached")
            kept.append(Kept(execution, log_path, result=ended))
        return kept


def _safe(execution_id: str) -> str:
    """An execution id as a file name (the server's ids are hex, dots and a prefix)."""
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in execution_id)[:200]
