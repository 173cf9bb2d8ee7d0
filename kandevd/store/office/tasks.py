"""The runs of Office tasks: every statement of assignment (:mod:`kandevd.office.subscribers`)
and unstarted-task recovery (:mod:`kandevd.office.recovery`).

``reason`` is the assignment runs' reason, passed in by the caller. The
recovery rules for a task aliased ``t`` are :data:`RECOVERABLE_SQL`
(parameters ``:reason``, ``:cutoff``, ``:max_chains``): nothing live or
finished, the latest run not a user's cancel, chains left within the
lookback. Every subquery is a probe of ``runs(task_id)``.
"""

from __future__ import annotations

import sqlite3

from kandevd.store.base import BaseStore
from kandevd.store.office.predicate import OFFICE_TASK_SQL
from kandevd.store.workspace import RUNNER_SQL

_BLOCKING = "('queued', 'claimed', 'finished')"
#: cancel reasons the daemon writes itself; any other cancel is a user's
SYSTEM_CANCEL_REASONS = ("reassigned", "run_too_old")
_WITHDRAWN = "(c.status = 'cancelled' AND COALESCE(c.cancel_reason, '') = 'reassigned')"
#: chains used by task ``t``: its assignment runs since ``:cutoff``, withdrawals aside
_CHAINS_SQL = ("(SELECT COUNT(*) FROM runs c WHERE c.task_id = t.id AND c.reason = :reason"
               f" AND c.requested_at >= :cutoff AND NOT {_WITHDRAWN})")

RECOVERABLE_SQL = f"""(
  NOT EXISTS (SELECT 1 FROM runs r WHERE r.task_id = t.id AND r.status IN {_BLOCKING})
  AND NOT EXISTS (
    SELECT 1 FROM runs l
    WHERE l.seq = (SELECT MAX(m.seq) FROM runs m WHERE m.task_id = t.id)
      AND l.status = 'cancelled'
      AND COALESCE(l.cancel_reason, '') NOT IN {SYSTEM_CANCEL_REASONS!r})
  AND {_CHAINS_SQL} < :max_chains
)"""

_SCAN_SQL = f"""/* office:recovery-scan */
SELECT t.id, t.workspace_id, {RUNNER_SQL} AS runner
FROM tasks t
JOIN workspaces w ON w.id = t.workspace_id
LEFT JOIN workflow_steps s ON s.workflow_id = t.workflow_id AND s.id = t.step_id
WHERE t.state = 'TODO' AND t.created_at >= :cutoff
  AND {OFFICE_TASK_SQL}
  AND {RUNNER_SQL} IS NOT NULL
  AND {RECOVERABLE_SQL}
ORDER BY t.created_at, t.id
LIMIT :limit
"""

#: The same run rules for one task, re-checked inside the enqueue's transaction;
#: also returns the chains used so far.
_RECHECK_SQL = f"""/* office:recovery-recheck */
SELECT {_CHAINS_SQL} AS chains
FROM tasks t WHERE t.id = :task AND {RECOVERABLE_SQL}
"""


def recoverable_tasks(store: BaseStore, reason: str, cutoff: str, max_chains: int,
                      limit: int) -> list[sqlite3.Row]:
    """Office ``TODO`` tasks created since ``cutoff`` with a runner and no run standing for
    the work (id, workspace_id, runner), oldest first."""
    return store.query(_SCAN_SQL, {"reason": reason, "cutoff": cutoff, "limit": limit,
                                   "max_chains": max_chains})


def chains_if_recoverable(conn: sqlite3.Connection, task_id: str, reason: str, cutoff: str,
                          max_chains: int) -> int | None:
    """The chains ``task_id`` used since ``cutoff`` if it is still recoverable, else None."""
    row = conn.execute(_RECHECK_SQL, {"task": task_id, "reason": reason, "cutoff": cutoff,
                                      "max_chains": max_chains}).fetchone()
    return None if row is None else int(row["chains"])


def assignment_runs(conn: sqlite3.Connection | BaseStore, task_id: str, agent_id: str,
                    reason: str) -> int:
    """How many ``reason`` runs ``task_id`` has had for ``agent_id``, whatever became of them."""
    sql = "SELECT COUNT(*) FROM runs WHERE task_id = ? AND agent_id = ? AND reason = ?"
    if isinstance(conn, BaseStore):
        return int(conn.query_one(sql, (task_id, agent_id, reason))[0])
    return int(conn.execute(sql, (task_id, agent_id, reason)).fetchone()[0])


def queued_assignment_runs(store: BaseStore, task_id: str, agent_id: str,
                           reason: str) -> list[str]:
    """The ids of ``task_id``'s ``reason`` runs for ``agent_id`` that are still queued."""
    return [row["id"] for row in store.query(
        "SELECT id FROM runs WHERE task_id = ? AND agent_id = ? AND reason = ?"
        " AND status = 'queued'", (task_id, agent_id, reason))]


def office_workflow_id(store: BaseStore, workspace_id: str) -> str | None:
    """The workspace's Office workflow (None: none set, or no such workspace)."""
    row = store.query_one("SELECT office_workflow_id FROM workspaces WHERE id = ?",
                          (workspace_id,))
    return row["office_workflow_id"] if row is not None else None
