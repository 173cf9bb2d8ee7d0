"""The outcomes' side of the store: an attempt finished, failed, or never started.

Each is fenced by the claim token the attempt was given: a superseded
attempt's outcome matches no row and changes nothing. The retry decision is
the caller's (``decide``); the store only writes it.
"""

from __future__ import annotations

from datetime import datetime

from kandevd.runs.model import FailedAttempt, RetryDecision, Run
from kandevd.runs.retry import RetryDecider
from kandevd.store.runs.base import RunRepositoryBase
from kandevd.store.runs.statements import ADD_COST, REQUEUE
from kandevd.timeutil import parse_rfc3339, rfc3339


class Outcomes(RunRepositoryBase):
    def finish(self, run_id: str, token: str, *, now: datetime, summary: str | None,
               cost_cents: float | None, log_path: str | None) -> bool:
        """Record a successful attempt (fenced by ``token``); False when it was superseded.

        Single-row and fenced, so where rows are locked it needs no writer lock.
        """
        params = {"now": rfc3339(now), "summary": summary, "cost": cost_cents,
                  "log": log_path, "id": run_id, "token": token}
        with self.store.transaction(exclusive=False) as conn:
            return self.sql.finish(self, conn, params, now)

    def fail_attempt(self, run_id: str, token: str, *, now: datetime, error: str,
                     decide: RetryDecider, summary: str | None = None,
                     cost_cents: float | None = None, log_path: str | None = None
                     ) -> Run | None:
        """A failed attempt: retried, cancelled as too old, or failed, as ``decide`` says.

        A run that has used its attempts (``give_up`` says so, with the message)
        fails instead of being retried. None when the token is stale.
        """
        now_s = rfc3339(now)
        with self.store.transaction(exclusive=False) as conn:
            cooldown_s = self.sql.lock_agent_of(conn, run_id)
            row = conn.execute("SELECT * FROM runs WHERE id = ? AND status = 'claimed'"
                               " AND claim_token = ?", (run_id, token)).fetchone()
            if row is None:
                return None
            decision = decide(FailedAttempt(row["attempt"], row["retry_count"],
                                            parse_rfc3339(row["requested_at"]), now))
            common = {"now": now_s, "error": error, "summary": summary, "cost": cost_cents,
                      "log": log_path, "seq": row["seq"]}
            final = self.give_up(row["attempt"], error) if decision.action == "retry" else None
            if final is not None:
                decision = RetryDecision("fail", None)
                common["error"] = final
            if decision.action == "retry":
                assert decision.retry_at is not None
                sql = ("UPDATE runs SET status = 'queued', retry_count = retry_count + 1,"
                       " scheduled_retry_at = :retry_at, claimed_at = NULL, finished_at = NULL,"
                       " claim_token = NULL, claimed_by = NULL, error_message = :error,")
                common["retry_at"] = rfc3339(decision.retry_at)
            elif decision.action == "too_old":
                sql = ("UPDATE runs SET status = 'cancelled', cancel_reason = 'run_too_old',"
                       " finished_at = :now, claim_token = NULL, error_message = :error,"
                       " scheduled_retry_at = NULL,")
            else:
                sql = ("UPDATE runs SET status = 'failed', finished_at = :now,"
                       " claim_token = NULL, error_message = :error, scheduled_retry_at = NULL,")
            # Fenced again in the write itself: a cancel on another daemon may have come
            # between the read and here (outcomes do not take the writer lock there).
            updated = conn.execute(
                sql + " output_summary = :summary, cost_cents = " + ADD_COST + ","
                " log_path = COALESCE(:log, log_path), updated_at = :now"
                " WHERE seq = :seq AND status = 'claimed' AND claim_token = :token"
                " RETURNING *", {**common, "token": token}).fetchone()
            if updated is None:
                return None
            self.start_cooldown(conn, row["agent_id"], now, cooldown_s)
        return Run.from_row(updated)

    def requeue(self, run_id: str, token: str, now: datetime) -> bool:
        """Put a claim whose execution never started back in the queue.

        Nothing ran, so the claim's attempt is given back.
        """
        with self.store.transaction() as conn:
            return conn.execute(REQUEUE + ", attempt = CASE WHEN attempt > 0"
                                " THEN attempt - 1 ELSE 0 END"
                                " WHERE id = :id AND status = 'claimed'"
                                " AND claim_token = :token",
                                {"now": rfc3339(now), "id": run_id, "token": token}).rowcount > 0
