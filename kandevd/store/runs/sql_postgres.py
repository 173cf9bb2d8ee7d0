"""The run repository's PostgreSQL statements: row locks instead of one writer, pipelines.

Claims and outcomes do not take the store-wide writer lock here: a claim
locks the agents it claims for (``FOR UPDATE SKIP LOCKED``) and an outcome
locks its run's agent first, in the same order, so daemons claim for
different agents at once and never wait on each other in a cycle. The
partial unique index (one claimed run per agent) stays the last word.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from kandevd.store.base import BaseStore
from kandevd.store.runs.base import RunRepositoryBase
from kandevd.store.runs.statements import CLAIM, FINISH, HEADS, exclusion

#: ``after(now, cooldown_s)`` written down as :func:`~kandevd.timeutil.rfc3339` does, in
#: PostgreSQL (its session runs in UTC): a cooldown beyond any date ends at the last
#: representable instant, as in Python (10**12 s already lies past the year 9999).
COOLDOWN_UNTIL = (
    "CASE WHEN agents.cooldown_s > 0 THEN to_char(LEAST(CAST(:now AS TIMESTAMPTZ)"
    " + LEAST(agents.cooldown_s, 1e12) * INTERVAL '1 second',"
    " TIMESTAMPTZ '9999-12-31 23:59:59.999999+00'), 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')"
    " END")

#: A successful attempt in one statement, its locks in a claim's order (the agent first:
#: the run's update reads the locked agent, so it cannot lock the run before it); the
#: agent's last run ended and its cooldown starts, from the ``cooldown_s`` read under that
#: lock. A row back: the attempt was current and is recorded.
FINISH_ONE_STATEMENT = (
    "WITH agent AS (SELECT a.id FROM agents a JOIN runs r ON r.agent_id = a.id"
    "  WHERE r.id = :id FOR UPDATE OF a),"
    " finished AS (" + FINISH + " FROM agent WHERE runs.id = :id"
    "  AND runs.agent_id = agent.id AND runs.status = 'claimed'"
    "  AND runs.claim_token = :token RETURNING runs.agent_id),"
    " cooled AS (UPDATE agents SET last_finished_at = :now, cooldown_until = "
    + COOLDOWN_UNTIL + " FROM finished WHERE agents.id = finished.agent_id)"
    " SELECT agent_id FROM finished")

#: The agents this transaction's last lock statement locked (a JSON list kept in a
#: transaction-local setting), as an array to compare agent ids with.
CLAIMABLE = ("ARRAY(SELECT jsonb_array_elements_text(COALESCE(NULLIF("
             "current_setting('kandevd.claimable', true), ''), '[]')::jsonb))")


class PostgresRuns:
    def count_queued(self, conn: Any, inserted: int) -> None:
        if inserted:
            # Shard -1, which no trigger uses (they use their connection's pid): an
            # enqueue never waits for a count row a claim or an outcome holds.
            conn.execute("INSERT INTO run_counts (status, shard, n) VALUES ('queued', -1, ?)"
                         " ON CONFLICT (status, shard) DO UPDATE"
                         " SET n = run_counts.n + excluded.n", (inserted,))

    @contextmanager
    def claim_sync(self, store: BaseStore) -> Iterator[None]:
        yield  # SET LOCAL synchronous_commit rides in the claim's own pipeline

    def claim(self, repo: RunRepositoryBase, conn: Any, excluded: set[str],
              params: dict[str, Any], limit: int, now: datetime, own: bool,
              only: frozenset[str] | None = None) -> tuple[list[Any], dict[str, str]]:
        """Lock up to ``limit`` agents to claim for, and claim, in one round trip.

        Two statements, sent together in one pipeline. The first locks
        (``FOR UPDATE SKIP LOCKED``) the agents whose oldest due run is
        oldest, as the claim takes them, skipping agents another daemon is
        claiming for right now, and notes which in a transaction-local
        setting; the second claims the oldest due run of each agent noted.
        The claim, a statement of its own, reads a fresh snapshot and so sees
        every claim committed before it.

        With a ``claim_gate_probe``, the first statement locks nothing when
        the probe is true (then the second claims nothing): the gate is asked,
        and its blocked agents excluded from a second pair of statements. In
        its own transaction, a claim does not wait for the WAL flush (said in
        the same round trip).
        """
        first = [("SET LOCAL synchronous_commit TO OFF", ())] if own else []
        gate, probe = repo.claim_gate, repo.claim_gate_probe
        gate_checked = gate is None or probe is None
        if gate is not None and probe is None:
            excluded.update(gate(conn, now))
        while True:
            excluding = exclusion(excluded, params, only)
            # The heads read with room to skip agents locked elsewhere; the LIMIT counts
            # only the agents actually locked (PostgreSQL locks below the limit). They are
            # joined by seq, not "seq IN (heads)": each head is looked up by its key
            # instead of every queued run being scanned (PostgreSQL's planner chose that
            # scan while the table had no statistics yet).
            locked = ("SELECT a.id FROM (" + HEADS.format(exclusion=excluding)
                      + ") AS heads JOIN runs q ON q.seq = heads.s"
                      " JOIN agents a ON a.id = q.agent_id"
                      + ("" if gate_checked else " WHERE NOT g.gated")
                      + " ORDER BY q.seq LIMIT :lock_limit FOR UPDATE OF a SKIP LOCKED")
            note = ("set_config('kandevd.claimable', COALESCE((SELECT json_agg(l.id) FROM ("
                    + locked + ") AS l)::text, '[]'), true)")
            lock = (f"SELECT FALSE, {note}" if gate_checked else
                    f"SELECT g.gated, {note} FROM ({probe}) AS g(gated)")
            # status again outside the subquery: PostgreSQL re-checks only these terms on
            # a row a concurrent cancel changed before committing. The agents' profiles
            # come back in the same statement.
            claim = (CLAIM + " FROM (" + HEADS.format(
                         exclusion=excluding + " AND a.id = ANY(" + CLAIMABLE + ")")
                     + ") AS heads WHERE runs.seq = heads.s AND runs.status = 'queued'"
                     " RETURNING runs.*, (SELECT profile FROM agents"
                     " WHERE id = runs.agent_id) AS agent_profile")
            scan = {**params, "limit": limit * 4, "lock_limit": int(limit)}
            sent = conn.pipelined([*first, (lock, scan), (claim, params)])
            first = []
            gated = bool(sent[-2].fetchone()[0])
            rows = sent[-1].fetchall()
            if not gated:
                return rows, {r["agent_id"]: r["agent_profile"] for r in rows}
            if rows or gate is None:  # the first statement locked nothing
                raise RuntimeError("a gated claim claimed runs")
            excluded.update(gate(conn, now))
            gate_checked = True

    def lock_agent_of(self, conn: Any, run_id: str) -> float | None:
        """Lock the run's agent row before the run's (an outcome's lock order).

        Outcomes do not take the writer lock here. Taking the agent first, as
        every claim does, means an outcome never holds a run or a run count
        while it waits for an agent a claim holds: no lock cycle between them.
        Returns the agent's ``cooldown_s``, read with the lock.
        """
        row = conn.execute("SELECT a.cooldown_s FROM agents a JOIN runs r ON r.agent_id = a.id"
                           " WHERE r.id = ? FOR UPDATE OF a", (run_id,)).fetchone()
        return float(row[0] or 0) if row is not None else None

    def finish(self, repo: RunRepositoryBase, conn: Any, params: dict[str, Any],
               now: datetime) -> bool:
        # One round trip instead of three (the agent locked, the run, the agent's
        # cooldown): this is every run's outcome, on a database across a network.
        return conn.execute(FINISH_ONE_STATEMENT, params).fetchone() is not None

    def live_peer_excluded(self, dead_after_s: float | None, held: Sequence[str]) -> str:
        if dead_after_s is None:
            return ""
        kept = "".join(f" AND d.boot_id != '{boot}'" for boot in held
                       if boot.isalnum())  # boot ids are hex: nothing to quote
        return (" AND NOT EXISTS (SELECT 1 FROM daemons d WHERE d.boot_id = runs.claimed_by"
                " AND d.stopped_at IS NULL AND d.heartbeat_at >= now() - make_interval(secs =>"
                f" {float(dead_after_s)!r}){kept})")

    def earlier_instances_only(self, dead_after_s: float | None, held: Sequence[str]) -> str:
        """What start-up settles: claims of this home's earlier instances (and unowned ones).

        A dead daemon of another home is rescued by the heartbeat, once this
        daemon's own heartbeat is steady: right after an outage of the database
        every heartbeat is old, and a daemon starting then must not take
        everyone else for dead.
        """
        if dead_after_s is None:
            return ""
        kept = ", ".join(f"'{boot}'" for boot in held if boot.isalnum())
        return f" AND (claimed_by IS NULL{f' OR claimed_by IN ({kept})' if kept else ''})"
