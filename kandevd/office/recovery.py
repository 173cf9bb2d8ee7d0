"""Unstarted-task recovery: Office ``TODO`` tasks whose assignment run never happened.

The assignment subscriber queues a task's first ``task_assigned`` run at the
moment of assignment, but events live in memory: a crash between the task's
commit and the enqueue, a task inserted by another process, or a run that
failed for good all leave an Office task nobody works on. Each Office tick
this handler finds such tasks and queues exactly one ``task_assigned`` run
each, at most :data:`MAX_PER_TICK` per tick.

A task qualifies when it is an Office task (the predicate, in SQL), its state
is ``TODO``, it has an effective runner, it was created within
``office.recovery_lookback_hours``, and no run *for that task* is
``queued``, ``claimed`` or ``finished``. Failed or cancelled runs do not
block: recovery then uses the next attempt's idempotency key
(:func:`kandevd.office.subscribers.task_assigned_key`), because the key of a
failed run inside the 24 h window would otherwise dedupe forever.

Gate: the handler only scans when Office adoption exists
(:func:`kandevd.office.predicate.office_adopted`); otherwise a tick costs one
tiny existence query and touches no ``tasks`` row.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from kandevd.model.repository import RUNNER_SQL
from kandevd.office.predicate import OFFICE_TASK_SQL, office_adopted
from kandevd.office.subscribers import REASON, task_assigned_key
from kandevd.queue.processor import RunQueue
from kandevd.store.db import Store
from kandevd.store.runs import RunReferenceError
from kandevd.timeutil import rfc3339

from . import HandlerResult

log = logging.getLogger("kandevd.office.recovery")

MAX_PER_TICK = 5
#: candidates read per scan; more than MAX_PER_TICK so a task that cannot be
#: queued (its runner was moved to another workspace) does not starve the rest
CANDIDATES = MAX_PER_TICK * 4

_BLOCKING = "('queued', 'claimed', 'finished')"

_SCAN_SQL = f"""/* office:recovery-scan */
SELECT t.id, t.workspace_id, {RUNNER_SQL} AS runner
FROM tasks t
JOIN workspaces w ON w.id = t.workspace_id
LEFT JOIN workflow_steps s ON s.workflow_id = t.workflow_id AND s.id = t.step_id
WHERE t.state = 'TODO' AND t.created_at >= :cutoff
  AND {OFFICE_TASK_SQL}
  AND {RUNNER_SQL} IS NOT NULL
  AND NOT EXISTS (SELECT 1 FROM runs r WHERE r.task_id = t.id AND r.status IN {_BLOCKING})
ORDER BY t.created_at, t.id
LIMIT :limit
"""


class UnstartedTaskRecovery:
    name = "recovery"

    def __init__(self, store: Store, queue: RunQueue, *, lookback_hours: float,
                 max_per_tick: int = MAX_PER_TICK) -> None:
        self.store = store
        self.queue = queue
        self.lookback = timedelta(hours=lookback_hours)
        self.max_per_tick = max_per_tick

    def active(self) -> bool:
        with self.store.connection() as conn:
            return office_adopted(conn)

    def tick(self, now: datetime) -> HandlerResult:
        if not self.active():
            return HandlerResult(scanned=False)
        cutoff = rfc3339(now - self.lookback)
        candidates = self.store.query(_SCAN_SQL, {"cutoff": cutoff, "limit": CANDIDATES})
        queued = 0
        for row in candidates:
            if queued >= self.max_per_tick:
                break
            if self._recover(row["id"], row["workspace_id"], row["runner"]):
                queued += 1
        return HandlerResult(scanned=True, acted=queued)

    def _recover(self, task_id: str, workspace_id: str, agent: str) -> bool:
        """Queue the task's next ``task_assigned`` run; False when none was inserted.

        The re-check and the enqueue share one transaction, so a subscriber
        enqueueing for the same task at the same moment cannot make two runs.
        """
        try:
            with self.store.transaction() as conn:
                blocked = conn.execute(
                    f"SELECT 1 FROM runs WHERE task_id = ? AND status IN {_BLOCKING} LIMIT 1",
                    (task_id,)).fetchone()
                if blocked is not None:
                    return False
                attempt = conn.execute(
                    "SELECT COUNT(*) FROM runs WHERE task_id = ? AND agent_id = ?"
                    " AND reason = ?", (task_id, agent, REASON)).fetchone()[0]
                result = self.queue.enqueue(
                    workspace_id=workspace_id, agent_id=agent, reason=REASON, task_id=task_id,
                    payload={"task_id": task_id},
                    idempotency_key=task_assigned_key(task_id, agent, attempt))
        except RunReferenceError as exc:
            log.warning("recovery: task %s cannot be queued for %s: %s", task_id, agent, exc)
            return False
        if not result.inserted:
            log.debug("recovery: task %s: run %s already covers attempt %d", task_id,
                      result.run["id"], attempt)
            return False
        log.info("recovered unstarted Office task %s: %s run %s queued for %s (attempt %d)",
                 task_id, REASON, result.run["id"], agent, attempt)
        return True
