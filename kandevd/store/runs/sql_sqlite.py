"""The run repository's SQLite statements: what only SQLite says this way."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from kandevd.store.base import BaseStore
from kandevd.store.runs.base import RunRepositoryBase
from kandevd.store.runs.statements import CLAIM, FINISH, HEADS, QUEUE_FRONT, exclusion

#: How many runs at the head of the queue a claim looks at before it asks every agent.
HEAD_WINDOW = 16


class SqliteRuns:
    def __init__(self) -> None:
        self._sync_level: int | None = None  # the store's PRAGMA synchronous, read once

    def count_queued(self, conn: Any, inserted: int) -> None:
        if inserted:
            conn.execute("INSERT INTO run_counts (status, n) VALUES ('queued', ?)"
                         " ON CONFLICT (status) DO UPDATE SET n = run_counts.n + excluded.n",
                         (inserted,))

    @contextmanager
    def claim_sync(self, store: BaseStore) -> Iterator[None]:
        """``synchronous=NORMAL`` on the writer for the enclosed (claim) transaction."""
        with store.connection() as conn:
            if self._sync_level is None:
                self._sync_level = int(conn.execute("PRAGMA synchronous").fetchone()[0])
            level = self._sync_level
            # Already NORMAL or OFF: nothing to relax. Inside a caller's transaction the
            # level cannot change (SQLite refuses); that transaction decides.
            if level <= 1 or conn.in_transaction:
                yield
                return
            conn.execute("PRAGMA synchronous=NORMAL")
            try:
                yield
            finally:
                conn.execute(f"PRAGMA synchronous={level}")

    def claim(self, repo: RunRepositoryBase, conn: Any, excluded: set[str],
              params: dict[str, Any], limit: int, now: datetime, own: bool,
              only: frozenset[str] | None = None) -> tuple[list[Any], dict[str, str]]:
        """One ``UPDATE ... RETURNING`` under SQLite's one writer lock; then the profiles.

        The runs are found at the head of the queue when they are there (a busy
        queue's usual case: a few rows read); else every agent is asked for its
        oldest due run (HEADS), so a deep backlog of busy agents is never walked.
        (No subquery in RETURNING: SQLite evaluates it with a full scan of its table.)
        """
        if repo.claim_gate is not None:
            excluded.update(repo.claim_gate(conn, now))
        front = heads_at_the_front(conn, excluded, str(params["now"]), limit) \
            if only is None else None  # (a runner's claim: among its agents only)
        if front is None:
            where = "seq IN (" + HEADS.format(exclusion=exclusion(excluded, params, only)) + ")"
            profiles: dict[str, str] = {}
        elif front[0]:  # (bound, not spelled out: the statement is prepared once per count)
            seqs, profiles = front
            where = "seq IN (" + ", ".join(f":s{n}" for n in range(len(seqs))) + ")"
            params.update({f"s{n}": int(seq) for n, seq in enumerate(seqs)})
        else:
            return [], {}
        rows = conn.execute(CLAIM + " WHERE status = 'queued' AND " + where + " RETURNING *",
                            params).fetchall()
        if not rows:
            return [], {}
        agents = sorted({r["agent_id"] for r in rows} - profiles.keys())
        if agents:  # (the front read its agents' profiles already)
            profiles = {**profiles, **dict(conn.execute(
                f"SELECT id, profile FROM agents WHERE id IN ({', '.join('?' * len(agents))})",
                agents).fetchall())}
        return rows, profiles

    def lock_agent_of(self, conn: Any, run_id: str) -> float | None:
        return None  # the writer lock serializes every write already

    def finish(self, repo: RunRepositoryBase, conn: Any, params: dict[str, Any],
               now: datetime) -> bool:
        row = conn.execute(FINISH + " WHERE id = :id AND status = 'claimed'"
                           " AND claim_token = :token RETURNING agent_id", params).fetchone()
        if row is None:
            return False
        repo.start_cooldown(conn, row["agent_id"], now)
        return True

    def live_peer_excluded(self, dead_after_s: float | None, held: Sequence[str]) -> str:
        return ""  # one daemon per SQLite file

    def earlier_instances_only(self, dead_after_s: float | None, held: Sequence[str]) -> str:
        return ""


def _seq(row: Any) -> int:
    return int(row[0])


def heads_at_the_front(conn: Any, excluded: set[str], now: str, limit: int
                       ) -> tuple[list[int], dict[str, str]] | None:
    """What HEADS would claim, found among the first queued runs, with the profiles of
    their agents; None when they do not tell (the front holds fewer than ``limit``
    claimable runs and more runs wait behind).

    The first due run of each agent in the queue's front is that agent's oldest due
    run, and every agent whose oldest due run lies further back comes after them.
    One statement reads the front and its agents together.
    """
    window = max(HEAD_WINDOW, 4 * limit)
    front = sorted(conn.execute(QUEUE_FRONT, {"window": window, "now": now}).fetchall(),
                   key=_seq)
    seen: set[str] = set()  # agents whose first due run in the front was looked at
    seqs: list[int] = []
    profiles: dict[str, str] = {}
    for seq, agent, retry_at, profile, eligible in front:
        if agent in seen or agent in excluded or (retry_at is not None and retry_at > now):
            continue
        seen.add(agent)
        if eligible and len(seqs) < limit:
            seqs.append(seq)
            profiles[agent] = profile
    if len(seqs) < limit and len(front) == window:
        return None
    return seqs, profiles
