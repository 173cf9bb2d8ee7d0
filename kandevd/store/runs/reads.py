"""Reads of the runs: one run, a page of runs, counts, and why a queued run waits."""

from __future__ import annotations

import json
import logging
from collections.abc import Collection
from datetime import datetime
from typing import Any

from kandevd.runs.model import STATUSES, Explanation, Run, RunNotFound, RunPage
from kandevd.store.runs.base import RunRepositoryBase
from kandevd.timeutil import rfc3339

log = logging.getLogger("kandevd.store.runs")


class Reads(RunRepositoryBase):
    def oldest_queued_at(self, now: datetime) -> str | None:
        """``requested_at`` of the oldest queued run ready to claim at ``now`` (request
        order; a run waiting for its retry back-off is not ready), or None."""
        row = self.store.query_one(
            "SELECT requested_at FROM runs WHERE status = 'queued'"
            " AND (scheduled_retry_at IS NULL OR scheduled_retry_at <= :now)"
            " ORDER BY seq LIMIT 1", {"now": rfc3339(now)})
        return row[0] if row else None

    def retrying(self, now: datetime) -> tuple[int, str | None]:
        """Queued runs still waiting for their ``scheduled_retry_at`` at ``now``: how
        many, and the earliest of those times (None: none waits)."""
        row = self.store.query_one(
            "SELECT COUNT(*), MIN(scheduled_retry_at) FROM runs INDEXED BY runs_queued_retry_at"
            " WHERE status = 'queued' AND scheduled_retry_at IS NOT NULL"
            " AND scheduled_retry_at > :now", {"now": rfc3339(now)})
        return (int(row[0]), row[1]) if row else (0, None)

    def count_by_status(self) -> dict[str, int]:
        """``{status: number of runs}`` for every status (zeros included)."""
        counts = dict.fromkeys(STATUSES, 0)
        # Kept in run_counts (migration 6) instead of a GROUP BY over every run. The
        # check against COUNT(*) (SQLite's count of the smallest index, no row read)
        # repairs counts that runs written behind the daemon's back put off.
        with self.store.connection() as conn:
            # One statement, one snapshot: the counts and the total agree in time.
            rows = conn.execute("SELECT status, CAST(SUM(n) AS BIGINT) AS n,"
                                " (SELECT COUNT(*) FROM runs) AS total"
                                " FROM run_counts GROUP BY status").fetchall()
            kept = {row["status"]: row["n"] for row in rows}
            total = rows[0]["total"] if rows else \
                conn.execute("SELECT COUNT(*) FROM runs").fetchone()[0]
        if sum(kept.values()) != total:
            kept = self._recount()
        counts.update(kept)
        return counts

    def _recount(self) -> dict[str, int]:
        """Rebuild ``run_counts`` from the runs themselves; the new counts."""
        with self.store.transaction() as conn:
            conn.execute("DELETE FROM run_counts")
            conn.execute("INSERT INTO run_counts (status, n) SELECT status, COUNT(*)"
                         " FROM runs GROUP BY status")
            log.warning("run counts did not match the runs table (runs written outside the "
                        "daemon?); recounted")
            return dict(conn.execute("SELECT status, CAST(SUM(n) AS BIGINT) FROM run_counts"
                                     " GROUP BY status").fetchall())

    def get(self, run_id: str) -> Run:
        row = self.store.query_one("SELECT * FROM runs WHERE id = ?", (run_id,))
        if row is None:
            raise RunNotFound(run_id)
        return Run.from_row(row)

    def list(self, *, limit: int = 50, offset: int = 0, order: str = "asc",
             **filters: str | None) -> RunPage:
        """Runs matching ``filters``, in request order (``order="desc"``: newest first)."""
        where, params = [], []
        for column in ("status", "agent_id", "workspace_id", "task_id", "reason"):
            value = filters.get(column)
            if value is not None:
                where.append(f"{column} = ?")
                params.append(value)
        clause = (" WHERE " + " AND ".join(where)) if where else ""
        total = self.store.query_one(f"SELECT COUNT(*) FROM runs{clause}", params)[0]
        direction = "DESC" if order == "desc" else "ASC"
        rows = self.store.query(f"SELECT * FROM runs{clause} ORDER BY seq {direction}"
                                " LIMIT ? OFFSET ?",
                                [*params, limit, offset])
        return RunPage([Run.from_row(r) for r in rows], total, limit, offset)

    def explain(self, run_id: str, now: datetime, *, runtime_full: bool,
                live_agents: Collection[str] = ()) -> Explanation:
        """Why a queued run is not claimed yet: a list of blocker names plus details."""
        now_s = rfc3339(now)
        with self.store.connection() as conn:
            run = conn.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone()
            if run is None:
                raise RunNotFound(run_id)
            blockers: list[str] = []
            details: dict[str, Any] = {}
            if run["status"] != "queued":
                return {"eligible": False, "blockers": [f"status_{run['status']}"],
                        "details": {"status": run["status"]}}
            agent = conn.execute("SELECT * FROM agents WHERE id = ?",
                                 (run["agent_id"],)).fetchone()
            if agent["status"] != "active":
                blockers.append("agent_paused")
            runs_on = json.loads(agent["runs_on"]) if agent["runs_on"] else None
            if runs_on:  # (a runner on another machine takes it: no slot here matters)
                details["runs_on"] = runs_on
            if self.claim_gate is not None:
                gate = self.claim_gate(conn, now).get(run["agent_id"])
                if gate is not None:
                    blockers.append("budget_exceeded")
                    details["budget_exceeded"] = gate
            busy = conn.execute("SELECT id FROM runs WHERE agent_id = ? AND status = 'claimed'",
                                (run["agent_id"],)).fetchone()
            if busy is None and runs_on:  # (a cancelled run its runner is still stopping)
                busy = conn.execute("SELECT run_id AS id FROM runner_stops WHERE agent_id = ?",
                                    (run["agent_id"],)).fetchone()
            if busy is not None or run["agent_id"] in live_agents:
                blockers.append("agent_busy")
                if busy is not None:
                    details["agent_busy"] = busy["id"]
            if agent["cooldown_until"] and agent["cooldown_until"] > now_s:
                blockers.append("cooldown_until")
                details["cooldown_until"] = agent["cooldown_until"]
            if run["scheduled_retry_at"] and run["scheduled_retry_at"] > now_s:
                blockers.append("retry_at")
                details["retry_at"] = run["scheduled_retry_at"]
            earlier = conn.execute(
                "SELECT id FROM runs WHERE agent_id = ? AND status = 'queued' AND seq < ?"
                " AND (scheduled_retry_at IS NULL OR scheduled_retry_at <= ?)"
                " ORDER BY seq LIMIT 1", (run["agent_id"], run["seq"], now_s)).fetchone()
            if earlier is not None:
                blockers.append("queued_behind")
                details["queued_behind"] = earlier["id"]
            if runtime_full and not runs_on:
                blockers.append("runtime_full")
        return {"eligible": not blockers, "blockers": blockers, "details": details}
