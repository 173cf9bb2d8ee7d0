"""Rescue and recovery: claims whose execution is gone, and what a restart finds.

An execution whose outcome is unknown goes back to the queue, or, once its
run has used its attempts (the caller's ``give_up`` policy), to the dead letter
(``failed``), so a run is never executed again without bound.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from datetime import datetime
from typing import Any

from kandevd.runs.model import Claim, Run
from kandevd.store.runs.base import RunRepositoryBase
from kandevd.store.runs.statements import NOT_A_RUNNERS, REQUEUE
from kandevd.timeutil import after, rfc3339


class Recovery(RunRepositoryBase):
    def rescue(self, conn: Any, run_id: str, token: str | None, now: datetime,
               why: str) -> str | None:
        """An execution whose outcome is unknown: back to the queue, or the dead letter.

        The execution counted an attempt when it was claimed; a run that has
        used its attempts (``give_up``) becomes ``failed`` ("gave up after N
        attempts; last: <why>") instead of executing again without bound. Returns the
        new status, or None when the claim (fenced by ``token``) is gone.
        Runs inside the caller's transaction.
        """
        row = conn.execute("SELECT seq, attempt, agent_id FROM runs WHERE id = ?"
                           " AND status = 'claimed' AND claim_token IS ?",
                           (run_id, token)).fetchone()
        if row is None:
            return None
        now_s = rfc3339(now)
        # Fenced in the write too: on PostgreSQL an outcome (which takes no writer lock)
        # may have been recorded since the read.
        final = self.give_up(row["attempt"], why)
        if final is not None:
            # PostgreSQL: the agent locked before the run, in the order claims and outcomes
            # take them (the cooldown below writes the agent).
            cooldown_s = self.sql.lock_agent_of(conn, run_id)
            failed = conn.execute(
                "UPDATE runs SET status = 'failed', finished_at = ?, claim_token = NULL,"
                " error_message = ?, scheduled_retry_at = NULL, updated_at = ?"
                " WHERE seq = ? AND status = 'claimed' AND claim_token IS ?",
                (now_s, final, now_s, row["seq"], token)).rowcount
            if not failed:
                return None
            self.start_cooldown(conn, row["agent_id"], now, cooldown_s)
            return "failed"
        requeued = conn.execute(REQUEUE + ", error_message = :why WHERE seq = :seq"
                                " AND status = 'claimed' AND claim_token IS :token",
                                {"now": now_s, "why": why, "seq": row["seq"],
                                 "token": token}).rowcount
        return "queued" if requeued else None

    def _earlier_instances(self) -> str:
        """With peers: only claims of this home's earlier instances (and unowned ones)."""
        return self.sql.earlier_instances_only(self.peers_dead_after_s, self.held_peers)

    def foreign_claims(self) -> list[Any]:
        """Claims made by an earlier instance of this daemon (at start-up: all of theirs)."""
        return self.store.query(
            "SELECT id, claim_token, agent_id, attempt FROM runs WHERE status = 'claimed'"
            " AND (claimed_by IS NULL OR claimed_by != ?)" + NOT_A_RUNNERS
            + self._earlier_instances() + " ORDER BY seq", (self.boot_id,))

    def claim_of(self, run_id: str, token: str) -> Claim | None:
        """The claim ``token`` of run ``run_id`` while it is still in force, else None."""
        with self.store.connection() as conn:
            row = conn.execute("SELECT * FROM runs WHERE id = ? AND status = 'claimed'"
                               " AND claim_token = ?", (run_id, token)).fetchone()
            if row is None:
                return None
            profile = conn.execute("SELECT profile FROM agents WHERE id = ?",
                                   (row["agent_id"],)).fetchone()
        return Claim(Run.from_row(row), token, profile["profile"] if profile else "default")

    def not_claimed_here(self, run_ids: Collection[str]) -> list[str]:
        """Those of ``run_ids`` that are no longer claimed by this daemon."""
        if not run_ids:
            return []
        ids = sorted(run_ids)
        mine = {r["id"] for r in self.store.query(
            f"SELECT id FROM runs WHERE id IN ({', '.join('?' * len(ids))})"
            " AND status = 'claimed' AND claimed_by = ?", [*ids, self.boot_id])}
        return [run_id for run_id in ids if run_id not in mine]

    def claimed_tokens(self) -> dict[str, str]:
        """``{run_id: claim_token}`` of every claimed run."""
        return {r["id"]: r["claim_token"] for r in self.store.query(
            "SELECT id, claim_token FROM runs WHERE status = 'claimed'")}

    def adopt_claim(self, run_id: str, token: str) -> bool:
        """Make an earlier instance's claim this instance's own (its agent was adopted)."""
        return self.store.execute(
            "UPDATE runs SET claimed_by = ? WHERE id = ? AND status = 'claimed'"
            " AND claim_token = ?", (self.boot_id, run_id, token)) > 0

    def requeue_interrupted(self, conn: Any, run_id: str, token: str | None, now: datetime,
                            why: str) -> str | None:
        """An execution a graceful stop cut short: back to the queue, its attempt uncounted.

        A shutdown never terminally fails a run: the claim counted an attempt,
        which is given back, so restarts alone never lead to the dead letter.
        (A crash is not this: with no outcome on disk, :meth:`rescue` counts it.)
        """
        requeued = conn.execute(REQUEUE + ", error_message = :why,"
                                " attempt = CASE WHEN attempt > 0 THEN attempt - 1 ELSE 0 END"
                                " WHERE id = :id AND status = 'claimed' AND claim_token IS :token",
                                {"now": rfc3339(now), "why": why, "id": run_id,
                                 "token": token}).rowcount
        return "queued" if requeued else None

    def own_claims(self) -> list[Any]:
        """This instance's claims: ``id`` and ``claim_token``."""
        return self.store.query("SELECT id, claim_token FROM runs WHERE status = 'claimed'"
                                " AND claimed_by = ? ORDER BY seq", (self.boot_id,))

    def release_interrupted(self, now: datetime, claims: Collection[tuple[str, str]],
                            why: str = "interrupted: the daemon stopped gracefully during"
                                       " the execution") -> list[str]:
        """Re-queue these ``(run_id, token)`` claims a graceful stop (or a fence)
        interrupted, uncounted."""
        released = []
        with self.store.transaction() as conn:
            for run_id, token in claims:
                if self.requeue_interrupted(conn, run_id, token, now, why):
                    released.append(run_id)
        return released

    def rescue_claims(self, now: datetime, claims: Collection[tuple[str, str]], why: str
                      ) -> dict[str, str]:
        """Rescue these ``(run_id, token)`` claims (their execution's end is unknown: a
        runner went silent), each counted; ``{run_id: new status}``."""
        done: dict[str, str] = {}
        with self.store.transaction() as conn:
            for run_id, token in claims:
                status = self.rescue(conn, run_id, token, now, why)
                if status is not None:
                    done[run_id] = status
        return done

    def requeue_foreign_claims(self, now: datetime,
                               why: str = "interrupted: the daemon stopped during the execution",
                               *, keep: Collection[str] = (), dead_peers: bool = False,
                               uncounted: Collection[str] = ()) -> dict[str, str]:
        """At start-up: claims of earlier instances with no known outcome are rescued.

        ``keep``: runs whose outcome is known here but not written yet.
        ``uncounted``: runs a graceful stop interrupted (their attempt is given
        back, see :meth:`requeue_interrupted`). Returns ``{run_id: new status}``
        (``queued``, or ``failed`` once the run has used its attempts).
        """
        done: dict[str, str] = {}
        with self.store.transaction() as conn:
            scope = (self.sql.live_peer_excluded(self.peers_dead_after_s, self.held_peers)
                     if dead_peers else self._earlier_instances())
            rows = conn.execute(
                "SELECT id, claim_token FROM runs WHERE status = 'claimed'"
                " AND (claimed_by IS NULL OR claimed_by != ?)" + NOT_A_RUNNERS + scope
                + " ORDER BY seq", (self.boot_id,)).fetchall()
            for r in rows:
                if r["id"] in keep:
                    continue
                if r["id"] in uncounted:
                    status = self.requeue_interrupted(
                        conn, r["id"], r["claim_token"], now,
                        "interrupted: the daemon stopped gracefully during the execution")
                else:
                    status = self.rescue(conn, r["id"], r["claim_token"], now, why)
                if status is not None:
                    done[r["id"]] = status
        return done

    def recover_stale(self, now: datetime, stale_s: float, live: Iterable[str]
                      ) -> dict[str, str]:
        """Claims older than ``stale_s`` with no live execution here are rescued.

        Runs every tick, so it first looks without the write lock; only when
        there is something to rescue does it take a transaction (and each
        rescue is fenced by the token it saw). Returns ``{run_id: new status}``.
        """
        live_ids = set(live)
        cutoff = rfc3339(after(now, -stale_s))
        # With peers: this daemon's own claims only (a dead peer's are the heartbeat's).
        own = f" AND claimed_by = '{self.boot_id}'" if self.peers_dead_after_s is not None \
            and self.boot_id.isalnum() else ""
        sql = ("SELECT id, claim_token FROM runs WHERE status = 'claimed' AND claimed_at < ?"
               + NOT_A_RUNNERS + own)
        if not [r for r in self.store.query(sql, (cutoff,)) if r["id"] not in live_ids]:
            return {}
        why = f"the claim went stale (no execution alive after {stale_s:g}s)"
        recovered: dict[str, str] = {}
        with self.store.transaction() as conn:
            for r in conn.execute(sql, (cutoff,)).fetchall():
                if r["id"] in live_ids:
                    continue
                status = self.rescue(conn, r["id"], r["claim_token"], now, why)
                if status is not None:
                    recovered[r["id"]] = status
        return recovered
