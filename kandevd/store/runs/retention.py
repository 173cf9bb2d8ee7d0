"""Retention's side of the store: which terminal runs have expired, and their rows deleted.

A run is a candidate when its status is terminal and it ended (``finished_at``,
else ``updated_at``) before the cutoff; ``queued`` and ``claimed`` runs are
never touched. A run named by a live idempotency key is kept (a request with
that key answers with the run itself), and so is a run any ``keep`` rule
keeps (Office budgets keep the costed runs they count). Candidates are found
through the partial index ``runs_terminal_ended``, never by a scan of ``runs``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypedDict

from kandevd.runs.model import IDEMPOTENCY_WINDOW_S
from kandevd.store.base import BaseStore
from kandevd.timeutil import after, rfc3339


@dataclass(frozen=True)
class KeepRule:
    """A condition on run ``r`` under which an expired run is kept, and its parameters."""

    sql: str
    params: Callable[[datetime], dict[str, Any]]


#: The candidates, oldest end first. The ``status IN`` term and the COALESCE
#: expression are exactly those of the partial index ``runs_terminal_ended``, and
#: the index is named: without statistics the planner would rather walk
#: ``runs(status, seq)`` (every terminal run) and sort.
_CANDIDATES = """/* retention */
SELECT r.seq, r.id, r.log_path FROM runs r INDEXED BY runs_terminal_ended
WHERE r.status IN ('finished', 'failed', 'cancelled')
  AND COALESCE(r.finished_at, r.updated_at) < :cutoff
  AND NOT EXISTS (SELECT 1 FROM run_keys k
                  WHERE k.run_id = r.id AND k.created_at >= :key_cutoff)
  {keep}
  {home_only}
ORDER BY COALESCE(r.finished_at, r.updated_at)
LIMIT :limit
"""
#: Several daemons on one store: each prunes the runs whose files are in its own home
#: (and runs that never executed, which have none), so no home keeps files of runs
#: another daemon deleted.
_HOME_ONLY = ("AND (r.log_path IS NULL"
              " OR substr(r.log_path, 1, length(:home_prefix)) = :home_prefix)")


class ExpiredRuns:
    """The expired runs of a store, found and deleted a batch at a time."""

    def __init__(self, store: BaseStore, *, keep: Sequence[KeepRule] = (),
                 home_prefix: str | None = None) -> None:
        self.store = store
        self._keep = tuple(keep)
        self._home_prefix = home_prefix
        self._candidates = _CANDIDATES.format(
            keep="".join(f"AND NOT ({rule.sql})\n  " for rule in self._keep).rstrip(),
            home_only=_HOME_ONLY if home_prefix is not None else "")

    def params(self, cutoff: datetime, now: datetime, limit: int) -> dict[str, Any]:
        params: dict[str, Any] = {"cutoff": rfc3339(cutoff),
                                  "key_cutoff": rfc3339(after(now, -IDEMPOTENCY_WINDOW_S)),
                                  "limit": limit}
        for rule in self._keep:
            params.update(rule.params(now))
        if self._home_prefix is not None:
            params["home_prefix"] = self._home_prefix
        return params

    def any(self, params: dict[str, Any]) -> bool:
        """Is anything due? A read without the write lock (most passes find nothing)."""
        return self.store.query_one(self._candidates, {**params, "limit": 1}) is not None

    def delete_batch(self, params: dict[str, Any], live: Collection[str], batch: int
                     ) -> list[tuple[str, str | None]]:
        """Delete up to ``batch`` in one transaction; ``[(id, log_path)]`` of what went."""
        with self.store.transaction() as conn:
            rows = [r for r in conn.execute(self._candidates, params).fetchall()
                    if r["id"] not in live][:batch]
            if not rows:
                return []
            seqs = [r["seq"] for r in rows]
            conn.execute(f"DELETE FROM runs WHERE seq IN ({', '.join('?' * len(seqs))})", seqs)
        return [(r["id"], r["log_path"]) for r in rows]


def oldest_run_at(store: BaseStore) -> str | None:
    """``requested_at`` of the oldest retained run (the first in request order), or None."""
    row = store.query_one("SELECT requested_at FROM runs ORDER BY seq LIMIT 1")
    return row[0] if row else None


class DbStatus(TypedDict):
    """``daemon.status``'s ``store.db``."""

    size_bytes: int
    oldest_run_at: str | None
    retention_days: float


def db_status(store: BaseStore, retention_days: float) -> DbStatus:
    """``daemon.status``'s ``store.db``: ``{size_bytes, oldest_run_at, retention_days}``."""
    return {"size_bytes": store.size_bytes(), "oldest_run_at": oldest_run_at(store),
            "retention_days": retention_days}
