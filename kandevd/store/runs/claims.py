"""Dispatch's side of the store: claims (the oldest eligible run of each eligible agent).

Claims are fenced: a claim writes a fresh ``claim_token``; finishing or
failing an attempt names the token it was given, so a late completion of a
superseded attempt matches no row and changes nothing.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection
from datetime import datetime
from typing import Any

from kandevd.runs.model import Claim, Run
from kandevd.store.runs.base import RunRepositoryBase
from kandevd.store.runs.statements import HEADS, exclusion
from kandevd.timeutil import parse_rfc3339, rfc3339


class Claims(RunRepositoryBase):
    def claim_next(self, now: datetime, *, exclude_agents: Collection[str] = ()) -> Claim | None:
        """Atomically claim the oldest eligible queued run across every workspace."""
        claims = self.claim_batch(now, 1, exclude_agents=exclude_agents)
        return claims[0] if claims else None

    def claim_batch(self, now: datetime, limit: int, *,
                    exclude_agents: Collection[str] = (),
                    runner: tuple[str, frozenset[str]] | None = None) -> list[Claim]:
        """Claim up to ``limit`` runs in one statement, oldest first, one per agent.

        This is what ``limit`` successive :meth:`claim_next` calls would claim
        (each claim makes its agent busy, so the next one takes the next
        agent's oldest run), in one transaction. ``exclude_agents`` are agents
        that still have an execution running here (e.g. a cancelled run whose
        process is being stopped). Only agents that run here are claimed for,
        unless ``runner`` is ``(claimed_by, agents)``: a runner's claim, among
        those agents only.

        A claim made in its own transaction does not wait for its commit to
        reach the disk: a claim lost to a power cut leaves its run ``queued``,
        which is what start-up recovery makes of a claim that did reach it.
        The outcome written afterwards is durable and carries the claim with
        it. Inside a caller's transaction (the queue loop writing outcomes
        together with its claims) the claim simply shares that commit.
        """
        if limit < 1:
            return []
        only = runner[1] if runner is not None else None
        params: dict[str, Any] = {"now": rfc3339(now), "token": uuid.uuid4().hex,
                                  "boot": runner[0] if runner is not None else self.boot_id,
                                  "limit": int(limit)}
        own = not self.store.writing
        if own and not self._anything_claimable(params, exclude_agents, only):
            # Nothing to claim (every queued run's agent is paused, busy or cooling
            # down): known from one read on a read connection, without the write lock,
            # the transaction and the sync switches a claim needs. Each enqueue wakes the
            # loop, so this is what a backlog of a paused agent costs per request.
            return []
        # Claims guard themselves with row locks where the database has them (PostgreSQL):
        # they need no store-wide writer lock (SQLite always writes alone).
        with self.sql.claim_sync(self.store), self.store.transaction(exclusive=False) as conn:
            rows, profiles = self.sql.claim(self, conn, set(exclude_agents), params, limit,
                                            now, own, only)
        rows.sort(key=lambda r: r["seq"])
        return [Claim(Run.from_row(r), r["claim_token"], profiles[r["agent_id"]]) for r in rows]

    def _anything_claimable(self, params: dict[str, Any], exclude_agents: Collection[str],
                            only: frozenset[str] | None = None) -> bool:
        """Would the claim find a run (the hard-budget gate aside)? A read, no write lock."""
        probe = dict(params)
        excluding = exclusion(set(exclude_agents), probe, only)
        with self.store.reading():
            row = self.store.query_one(
                "SELECT EXISTS (" + HEADS.format(exclusion=excluding) + ")", probe)
        return bool(row and row[0])

    def has_queued(self) -> bool:
        """Is any run queued at all? (A cheap read before trying to claim.)"""
        return self.store.query_one(
            "SELECT EXISTS (SELECT 1 FROM runs WHERE status = 'queued')")[0] == 1

    def next_due(self, now: datetime) -> datetime | None:
        """The earliest future moment a queued run may become claimable (retry, cooldown)."""
        now_s = rfc3339(now)
        row = self.store.query_one(
            "SELECT MIN(t) FROM ("
            " SELECT MIN(scheduled_retry_at) AS t FROM runs INDEXED BY runs_queued_retry_at"
            "  WHERE status = 'queued' AND scheduled_retry_at IS NOT NULL"
            "  AND scheduled_retry_at > :now"
            " UNION ALL"
            " SELECT MIN(a.cooldown_until) FROM agents a WHERE a.cooldown_until > :now"
            "  AND EXISTS (SELECT 1 FROM runs r WHERE r.agent_id = a.id AND r.status = 'queued')"
            ") AS due",
            {"now": now_s})
        return parse_rfc3339(row[0]) if row and row[0] else None
