"""Intake: a run request stored, with idempotency keys and coalescing."""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from kandevd.runs.coalescing import Coalescing
from kandevd.runs.model import (
    COALESCE_WINDOW_S,
    IDEMPOTENCY_WINDOW_S,
    BatchItemError,
    EnqueueRequest,
    EnqueueResult,
    Run,
    RunReferenceError,
)
from kandevd.store.runs.base import RunRepositoryBase
from kandevd.timeutil import after, rfc3339


class Enqueue(RunRepositoryBase):
    def enqueue(self, *, workspace_id: str, agent_id: str, reason: str, now: datetime,
                task_id: str | None = None, payload: dict[str, Any] | None = None,
                idempotency_key: str | None = None, coalesce: bool = True) -> EnqueueResult:
        with self.store.transaction() as conn:
            result = self._enqueue(conn, workspace_id=workspace_id, agent_id=agent_id,
                                   reason=reason, now=now, task_id=task_id, payload=payload,
                                   idempotency_key=idempotency_key, coalesce=coalesce)
            if result.inserted:
                self.sql.count_queued(conn, 1)
            return result

    def enqueue_many(self, items: Sequence[EnqueueRequest], *, now: datetime
                     ) -> list[EnqueueResult]:
        """Enqueue every item (the keyword arguments of :meth:`enqueue`) in one transaction.

        All or nothing: an item that refers to nothing raises
        :class:`BatchItemError` naming its index, and nothing of the batch is
        stored. Items see the ones before them, so a key given twice
        deduplicates and a repeated agent and reason coalesce, as they would
        one request after the other. One commit (one fsync) for the batch.
        """
        refs: dict[tuple[str, str, str | None], tuple[str | None, bool]] = {}
        stamps = (rfc3339(now), rfc3339(after(now, -COALESCE_WINDOW_S)))
        results: list[EnqueueResult] = []
        with self.store.transaction() as conn:
            for index, item in enumerate(items):
                try:
                    results.append(self._enqueue(conn, now=now, refs=refs, stamps=stamps,
                                                 **item))
                except RunReferenceError as exc:
                    raise BatchItemError(index, str(exc)) from None
            self.sql.count_queued(conn, sum(result.inserted for result in results))
        return results

    def _enqueue(self, conn: sqlite3.Connection, *, workspace_id: str, agent_id: str,
                 reason: str, now: datetime, task_id: str | None = None,
                 payload: dict[str, Any] | None = None, idempotency_key: str | None = None,
                 coalesce: bool = True,
                 refs: dict[tuple[str, str, str | None], tuple[str | None, bool]]
                 | None = None,
                 stamps: tuple[str, str] | None = None) -> EnqueueResult:
        """One enqueue inside the caller's transaction.

        A batch passes ``refs`` (reference checks already made) and ``stamps``
        (``now`` and the coalescing window's start, formatted once).
        """
        payload_json = json.dumps(payload or {}, separators=(",", ":"), sort_keys=True)
        key = idempotency_key or None
        now_s = stamps[0] if stamps else rfc3339(now)
        checked = refs.get((workspace_id, agent_id, task_id)) if refs is not None else None
        if checked is None:
            checked = self._references(conn, workspace_id, agent_id, task_id)
            if refs is not None:
                refs[(workspace_id, agent_id, task_id)] = checked
        problem, paused = checked
        if problem is not None:
            raise RunReferenceError(problem)
        if key is not None:
            known = self._run_of_key(conn, key, now)
            if known is not None:
                return EnqueueResult(Run.from_row(known), deduplicated=True)
            # Expired (or never seen): the key is free again.
            conn.execute("UPDATE runs SET key_active = 0 WHERE idempotency_key = ?"
                         " AND key_active = 1", (key,))
        if coalesce and self.coalescing.may_merge(key):
            merged = self._coalesce(conn, self.coalescing, agent_id=agent_id, reason=reason,
                                    task_id=task_id, key=key, payload_json=payload_json,
                                    now=now, window_start=stamps[1] if stamps else None)
            if merged is not None:
                self._remember_key(conn, key, merged.id, now_s)
                return EnqueueResult(merged, coalesced=True)
        run_id = "run_" + os.urandom(16).hex()  # as unique as a uuid4, a fifth of the time
        seq = conn.execute(
            "INSERT INTO runs (id, workspace_id, agent_id, task_id, reason, payload, status,"
            " idempotency_key, key_active, requested_at, updated_at)"
            " VALUES (?, ?, ?, ?, ?, ?, 'queued', ?, ?, ?, ?) RETURNING seq",
            (run_id, workspace_id, agent_id, task_id, reason,
             payload_json, key, 1 if key else 0, now_s, now_s),
        ).fetchone()[0]
        self._remember_key(conn, key, run_id, now_s)
        # The row just written, without reading it back (RETURNING * and its
        # conversion cost a batch of a thousand a third of its time); a unit test
        # checks that this equals what runs.get reads.
        return EnqueueResult(Run(
            id=run_id, seq=seq, workspace_id=workspace_id, agent_id=agent_id,
            task_id=task_id, reason=reason, payload=json.loads(payload_json),
            status="queued", idempotency_key=key, coalesced_count=0, retry_count=0,
            scheduled_retry_at=None, requested_at=now_s, claimed_at=None, finished_at=None,
            error_message=None, cancel_reason=None, output_summary=None, cost_cents=None,
            log_path=None, attempt=0), claimable=not paused)

    @classmethod
    def _references(cls, conn: sqlite3.Connection, workspace_id: str, agent_id: str,
                    task_id: str | None = None) -> tuple[str | None, bool]:
        """(Why the run's references cannot take it, None when they can; whether its
        agent is paused), from one statement."""
        refs = conn.execute(
            "SELECT EXISTS (SELECT 1 FROM workspaces WHERE id = :ws) AS workspace,"
            " (SELECT workspace_id FROM agents WHERE id = :agent) AS agent_workspace,"
            " (SELECT status FROM agents WHERE id = :agent) AS agent_status,"
            " (SELECT workspace_id FROM tasks WHERE id = :task) AS task_workspace",
            {"ws": workspace_id, "agent": agent_id, "task": task_id}).fetchone()
        return cls._reference_problem(refs, workspace_id, agent_id, task_id), \
            refs["agent_status"] == "paused"

    @staticmethod
    def _reference_problem(refs: Any, workspace_id: str, agent_id: str,
                           task_id: str | None) -> str | None:
        """Why ``workspace_id``/``agent_id`` (and ``task_id``, when given) cannot take a
        run, or None when they can."""
        if not refs["workspace"]:
            return f"workspace_id: workspace {workspace_id!r} does not exist"
        if refs["agent_workspace"] is None:
            return f"agent_id: agent {agent_id!r} does not exist"
        if refs["agent_workspace"] != workspace_id:
            return (f"agent_id: agent {agent_id!r} belongs to workspace "
                    f"{refs['agent_workspace']!r}, not {workspace_id!r}")
        if task_id is not None and refs["task_workspace"] is None:
            return f"task_id: task {task_id!r} does not exist"
        if task_id is not None and refs["task_workspace"] != workspace_id:
            return (f"task_id: task {task_id!r} belongs to workspace "
                    f"{refs['task_workspace']!r}, not {workspace_id!r}")
        return None

    @staticmethod
    def _run_of_key(conn: sqlite3.Connection, key: str, now: datetime) -> sqlite3.Row | None:
        """The run ``key`` was given to within the idempotency window, if any."""
        mapped = conn.execute("SELECT run_id, created_at FROM run_keys"
                              " WHERE idempotency_key = ?", (key,)).fetchone()
        if mapped is None or mapped["created_at"] < rfc3339(after(now, -IDEMPOTENCY_WINDOW_S)):
            return None
        return conn.execute("SELECT * FROM runs WHERE id = ?", (mapped["run_id"],)).fetchone()

    @staticmethod
    def _remember_key(conn: sqlite3.Connection, key: str | None, run_id: str,
                      now_s: str) -> None:
        if key is not None:
            conn.execute("INSERT INTO run_keys (idempotency_key, run_id, created_at)"
                         " VALUES (?, ?, ?) ON CONFLICT (idempotency_key) DO UPDATE"
                         " SET run_id = excluded.run_id, created_at = excluded.created_at",
                         (key, run_id, now_s))

    def prune_keys(self, now: datetime) -> int:
        """Forget idempotency keys older than the window (they no longer deduplicate)."""
        cutoff = rfc3339(after(now, -IDEMPOTENCY_WINDOW_S))
        if self.store.query_one("SELECT EXISTS (SELECT 1 FROM run_keys WHERE created_at < ?)",
                                (cutoff,))[0] == 0:
            return 0
        return self.store.execute("DELETE FROM run_keys WHERE created_at < ?", (cutoff,))

    @staticmethod
    def _coalesce(conn: sqlite3.Connection, rules: Coalescing, *, agent_id: str, reason: str,
                  task_id: str | None, key: str | None, payload_json: str, now: datetime,
                  window_start: str | None = None) -> Run | None:
        sql = ("SELECT * FROM runs WHERE agent_id = ? AND reason = ? AND status = 'queued'"
               " AND requested_at > ?")
        params: list[Any] = [agent_id, reason,
                             window_start or rfc3339(after(now, -COALESCE_WINDOW_S))]
        if rules.per_task(reason):
            sql += " AND task_id IS ?"
            params.append(task_id)
        row = conn.execute(sql + " ORDER BY seq DESC LIMIT 1", params).fetchone()
        if row is None:
            return None
        # Any recent queued run of the agent and reason absorbs the request, keyed or not
        # (the absorbing run keeps its own key), but one the rules keep apart.
        if not rules.may_merge(row["idempotency_key"]):
            return None
        new_key_active = 1 if (key or row["idempotency_key"]) else 0
        # Still queued: on PostgreSQL a claim (which does not take the writer lock) may
        # have taken the run since it was read; then the request is a run of its own.
        updated = conn.execute(
            "UPDATE runs SET coalesced_count = coalesced_count + 1, payload = ?,"
            " idempotency_key = COALESCE(idempotency_key, ?), key_active = ?, updated_at = ?"
            " WHERE seq = ? AND status = 'queued' RETURNING *",
            (payload_json, key, new_key_active, rfc3339(now), row["seq"]),
        ).fetchone()
        return Run.from_row(updated) if updated is not None else None

