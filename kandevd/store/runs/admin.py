"""An operator's changes to a run: cancel it, or queue a failed or cancelled one again."""

from __future__ import annotations

from datetime import datetime

from kandevd.runs.model import TERMINAL, Run, RunConflict, RunNotFound
from kandevd.store.runners import stop_on_runner
from kandevd.store.runs.base import RunRepositoryBase
from kandevd.timeutil import rfc3339


class Admin(RunRepositoryBase):
    def retry(self, run_id: str, now: datetime) -> Run:
        """A ``failed`` or ``cancelled`` run back to ``queued`` with a fresh attempt budget.

        It is a new request (``requested_at`` now, so the retry policy's age
        limit counts from here) with its history kept: its id, its earlier
        error, cost and log. Anything else is :class:`RunConflict`.
        """
        now_s = rfc3339(now)
        with self.store.transaction() as conn:
            row = conn.execute("SELECT status FROM runs WHERE id = ?", (run_id,)).fetchone()
            if row is None:
                raise RunNotFound(run_id)
            if row["status"] not in ("failed", "cancelled"):
                raise RunConflict(f"run {run_id!r} is {row['status']}; only a failed or "
                                  "cancelled run can be retried")
            updated = conn.execute(
                "UPDATE runs SET status = 'queued', attempt = 0, retry_count = 0,"
                " scheduled_retry_at = NULL, claimed_at = NULL, finished_at = NULL,"
                " claim_token = NULL, claimed_by = NULL, cancel_reason = NULL,"
                " requested_at = :now, updated_at = :now WHERE id = :id RETURNING *",
                {"now": now_s, "id": run_id}).fetchone()
        return Run.from_row(updated)

    def cancel(self, run_id: str, reason: str | None, now: datetime, *,
               only_queued: bool = False, log_path: str | None = None) -> tuple[Run, str]:
        """Cancel a queued or claimed run (only a queued one with ``only_queued``).

        ``log_path``: the run's log, when it has one, named on the run unless it names
        one already (an attempt cancelled while it ran writes no outcome that would).
        Returns (run, previous status); a run not in a cancellable status is RunConflict.
        """
        now_s = rfc3339(now)
        with self.store.transaction() as conn:
            # The status read is the status changed: a claim made in between (on
            # PostgreSQL claims do not take the writer lock) is seen, and read again.
            while True:
                row = conn.execute("SELECT id, status, agent_id, claimed_by, claim_token"
                                   " FROM runs WHERE id = ?", (run_id,)).fetchone()
                if row is None:
                    raise RunNotFound(run_id)
                previous = row["status"]
                if previous in TERMINAL or (only_queued and previous != "queued"):
                    raise RunConflict(f"run {run_id!r} is already {previous}; nothing to cancel")
                updated = conn.execute(
                    "UPDATE runs SET status = 'cancelled', cancel_reason = ?, finished_at = ?,"
                    " claim_token = NULL, log_path = COALESCE(log_path, ?), updated_at = ?"
                    " WHERE id = ? AND status = ? AND COALESCE(claim_token, '') = ?"
                    " RETURNING *",
                    (reason or "cancelled", now_s, log_path, now_s, run_id,
                     previous, row["claim_token"] or "")).fetchone()
                if updated is not None:
                    stop_on_runner(conn, row, now_s)
                    return Run.from_row(updated), previous
