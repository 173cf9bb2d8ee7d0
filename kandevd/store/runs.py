"""The runs repository: the persisted global queue.

Every state change of a run happens inside a ``BEGIN IMMEDIATE`` transaction
here (outcomes that arrive together may share one, see
:mod:`kandevd.queue.groupcommit`), so the rows are always the truth and
memory may be lost at any moment.

Claims are fenced: a claim writes a fresh ``claim_token``; finishing or
failing an attempt names the token it was given, and a late completion from
a superseded attempt (re-queued as stale, cancelled, or claimed again after a
restart) matches no row and changes nothing.

This is the small repository interface a PostgreSQL implementation would
provide too (claims with ``FOR UPDATE SKIP LOCKED``): enqueue, claim_next /
claim_batch, finish, fail_attempt, requeue, requeue_foreign_claims,
recover_stale, cancel.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import uuid
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from kandevd.config import RetryConfig
from kandevd.queue.retry import RetryDecision, decide_retry
from kandevd.store.db import BaseStore
from kandevd.timeutil import after, parse_rfc3339, rfc3339

IDEMPOTENCY_WINDOW_S = 24 * 3600
COALESCE_WINDOW_S = 5.0
TERMINAL = frozenset({"finished", "failed", "cancelled"})
STATUSES = ("queued", "claimed", "finished", "failed", "cancelled")

#: An attempt's reported cost is added to what earlier attempts of the run cost,
#: so budgets see every attempt; an attempt that reports nothing adds nothing.
_ADD_COST = ("CASE WHEN CAST(:cost AS DOUBLE PRECISION) IS NULL THEN cost_cents"
             " ELSE COALESCE(cost_cents, 0) + CAST(:cost AS DOUBLE PRECISION) END")

#: A successful attempt's row, less its WHERE clause (fenced by the claim token).
_FINISH = ("UPDATE runs SET status = 'finished', finished_at = :now, output_summary = :summary,"
           " cost_cents = " + _ADD_COST + ", log_path = :log, claim_token = NULL,"
           " error_message = NULL, scheduled_retry_at = NULL, updated_at = :now")

#: ``after(now, cooldown_s)`` written down as :func:`~kandevd.timeutil.rfc3339` does, in
#: PostgreSQL (its session runs in UTC): a cooldown beyond any date ends at the last
#: representable instant, as in Python (10**12 s already lies past the year 9999).
_PG_COOLDOWN_UNTIL = (
    "CASE WHEN agents.cooldown_s > 0 THEN to_char(LEAST(CAST(:now AS TIMESTAMPTZ)"
    " + LEAST(agents.cooldown_s, 1e12) * INTERVAL '1 second',"
    " TIMESTAMPTZ '9999-12-31 23:59:59.999999+00'), 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')"
    " END")

#: PostgreSQL: a successful attempt in one statement, its locks in a claim's order (the
#: agent first: the run's update reads the locked agent, so it cannot lock the run before
#: it); the agent's last run ended and its cooldown starts, from the ``cooldown_s`` read
#: under that lock. A row back: the attempt was current and is recorded.
_PG_FINISH = (
    "WITH agent AS (SELECT a.id FROM agents a JOIN runs r ON r.agent_id = a.id"
    "  WHERE r.id = :id FOR UPDATE OF a),"
    " finished AS (" + _FINISH + " FROM agent WHERE runs.id = :id"
    "  AND runs.agent_id = agent.id AND runs.status = 'claimed'"
    "  AND runs.claim_token = :token RETURNING runs.agent_id),"
    " cooled AS (UPDATE agents SET last_finished_at = :now, cooldown_until = "
    + _PG_COOLDOWN_UNTIL + " FROM finished WHERE agents.id = finished.agent_id)"
    " SELECT agent_id FROM finished")

RUN_FIELDS = (
    "id", "seq", "workspace_id", "agent_id", "task_id", "reason", "payload", "status",
    "idempotency_key", "coalesced_count", "retry_count", "scheduled_retry_at", "requested_at",
    "claimed_at", "finished_at", "error_message", "cancel_reason", "output_summary",
    "cost_cents", "log_path", "attempt",
)


log = logging.getLogger("kandevd.store.runs")


class RunNotFound(LookupError):
    def __init__(self, run_id: str) -> None:
        super().__init__(f"run {run_id!r} does not exist")


class RunReferenceError(ValueError):
    """The run names a workspace or agent that does not exist (or do not match)."""


class RunConflict(RuntimeError):
    pass


class BatchItemError(RunReferenceError):
    """An item of ``enqueue_many`` that cannot be stored; ``index`` names it."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(f"runs.{index}.{message}")  # message: "<field>: <why>"
        self.index = index


def gave_up(attempts: int, last: str | None) -> str:
    """The dead letter's ``error_message``."""
    return f"gave up after {attempts} attempts; last: {last or 'unknown'}"


def run_from_row(row: sqlite3.Row) -> dict[str, Any]:
    """The contract's RUN object from a ``runs`` row."""
    run = {name: row[name] for name in RUN_FIELDS}
    run["payload"] = json.loads(row["payload"] or "{}")
    return run


@dataclass(frozen=True)
class EnqueueResult:
    run: dict[str, Any]
    deduplicated: bool = False
    coalesced: bool = False

    @property
    def inserted(self) -> bool:
        return not (self.deduplicated or self.coalesced)


@dataclass(frozen=True)
class Claim:
    """A claimed run, the token that fences its attempt, and its agent's profile."""

    run: dict[str, Any]
    token: str
    profile: str


#: ``(conn, now) -> {agent_id: reason}``: agents that must not be claimed for now
#: (a hard budget they are over), asked inside the claim's transaction.
ClaimGate = Callable[[sqlite3.Connection, datetime], Mapping[str, str]]


class RunRepository:
    """The runs table's rules: enqueue, claim, outcomes, recovery, on either store.

    ``claim_gate_probe``: a query of one boolean, false whenever ``claim_gate``
    blocks no agent (the gate's own cheap first look). On PostgreSQL a claim
    sends it inside the statement that locks the agents to claim for, so the
    gate costs no round trip of its own while it has nothing to block.
    """

    def __init__(self, store: BaseStore, boot_id: str, *, max_attempts: int = 6,
                 claim_gate: ClaimGate | None = None,
                 claim_gate_probe: str | None = None) -> None:
        self.store = store
        self.boot_id = boot_id
        self.max_attempts = max_attempts
        self.claim_gate = claim_gate
        self.claim_gate_probe = claim_gate_probe if claim_gate is not None else None
        self._sync_level: int | None = None  # the store's PRAGMA synchronous, read once
        #: Several daemons on one store (PostgreSQL): claims of a daemon whose heartbeat
        #: is younger than this many seconds are its own, never rescued here. None: this
        #: daemon is alone, and every claim not its own is an earlier instance's.
        self.peers_dead_after_s: float | None = None
        #: Earlier daemons of this host and home (kept alive by this one until their
        #: claims are restored): their claims are this daemon's to restore or rescue.
        self.held_peers: tuple[str, ...] = ()

    # -- enqueue ----------------------------------------------------------------
    def enqueue(self, *, workspace_id: str, agent_id: str, reason: str, now: datetime,
                task_id: str | None = None, payload: dict[str, Any] | None = None,
                idempotency_key: str | None = None, coalesce: bool = True) -> EnqueueResult:
        with self.store.transaction() as conn:
            result = self._enqueue(conn, workspace_id=workspace_id, agent_id=agent_id,
                                   reason=reason, now=now, task_id=task_id, payload=payload,
                                   idempotency_key=idempotency_key, coalesce=coalesce)
            if result.inserted:
                self._count_queued(conn, 1)
            return result

    def enqueue_many(self, items: Sequence[Mapping[str, Any]], *, now: datetime
                     ) -> list[EnqueueResult]:
        """Enqueue every item (the keyword arguments of :meth:`enqueue`) in one transaction.

        All or nothing: an item that refers to nothing raises
        :class:`BatchItemError` naming its index, and nothing of the batch is
        stored. Items see the ones before them, so a key given twice
        deduplicates and a repeated agent and reason coalesce, as they would
        one request after the other. One commit (one fsync) for the batch.
        """
        refs: dict[tuple[str, str], str | None] = {}
        stamps = (rfc3339(now), rfc3339(after(now, -COALESCE_WINDOW_S)))
        results: list[EnqueueResult] = []
        with self.store.transaction() as conn:
            for index, item in enumerate(items):
                try:
                    results.append(self._enqueue(conn, now=now, refs=refs, stamps=stamps,
                                                 **item))
                except RunReferenceError as exc:
                    raise BatchItemError(index, str(exc)) from None
            self._count_queued(conn, sum(result.inserted for result in results))
        return results

    def _count_queued(self, conn: sqlite3.Connection, inserted: int) -> None:
        """Add ``inserted`` new runs to ``run_counts`` (no trigger counts inserts)."""
        if inserted:
            if self.store.dialect == "postgresql":
                # Shard -1, which no trigger uses (they use their connection's pid): an
                # enqueue never waits for a count row a claim or an outcome holds.
                conn.execute("INSERT INTO run_counts (status, shard, n) VALUES ('queued', -1, ?)"
                             " ON CONFLICT (status, shard) DO UPDATE"
                             " SET n = run_counts.n + excluded.n", (inserted,))
            else:
                conn.execute("INSERT INTO run_counts (status, n) VALUES ('queued', ?)"
                             " ON CONFLICT (status) DO UPDATE SET n = run_counts.n + excluded.n",
                             (inserted,))

    def _enqueue(self, conn: sqlite3.Connection, *, workspace_id: str, agent_id: str,
                 reason: str, now: datetime, task_id: str | None = None,
                 payload: dict[str, Any] | None = None, idempotency_key: str | None = None,
                 coalesce: bool = True,
                 refs: dict[tuple[str, str], str | None] | None = None,
                 stamps: tuple[str, str] | None = None) -> EnqueueResult:
        """One enqueue inside the caller's transaction.

        A batch passes ``refs`` (reference checks already made) and ``stamps``
        (``now`` and the coalescing window's start, formatted once).
        """
        payload_json = json.dumps(payload or {}, separators=(",", ":"), sort_keys=True)
        key = idempotency_key or None
        now_s = stamps[0] if stamps else rfc3339(now)
        # "" = not checked yet (None = checked, fine; a text = why it cannot be stored).
        problem = refs.get((workspace_id, agent_id), "") if refs is not None else ""
        if problem == "":
            problem = self._reference_problem(conn, workspace_id, agent_id)
            if refs is not None:
                refs[(workspace_id, agent_id)] = problem
        if problem is not None:
            raise RunReferenceError(problem)
        if key is not None:
            known = self._run_of_key(conn, key, now)
            if known is not None:
                return EnqueueResult(run_from_row(known), deduplicated=True)
            # Expired (or never seen): the key is free again.
            conn.execute("UPDATE runs SET key_active = 0 WHERE idempotency_key = ?"
                         " AND key_active = 1", (key,))
        if coalesce and not (key or "").startswith("task_comment:"):
            merged = self._coalesce(conn, agent_id=agent_id, reason=reason, task_id=task_id,
                                    key=key, payload_json=payload_json, now=now,
                                    window_start=stamps[1] if stamps else None)
            if merged is not None:
                self._remember_key(conn, key, merged["id"], now_s)
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
        return EnqueueResult({
            "id": run_id, "seq": seq, "workspace_id": workspace_id, "agent_id": agent_id,
            "task_id": task_id, "reason": reason, "payload": json.loads(payload_json),
            "status": "queued", "idempotency_key": key, "coalesced_count": 0,
            "retry_count": 0, "scheduled_retry_at": None, "requested_at": now_s,
            "claimed_at": None, "finished_at": None, "error_message": None,
            "cancel_reason": None, "output_summary": None, "cost_cents": None,
            "log_path": None, "attempt": 0})

    @staticmethod
    def _reference_problem(conn: sqlite3.Connection, workspace_id: str,
                           agent_id: str) -> str | None:
        """Why ``workspace_id``/``agent_id`` cannot take a run, or None when they can."""
        refs = conn.execute(
            "SELECT EXISTS (SELECT 1 FROM workspaces WHERE id = :ws) AS workspace,"
            " (SELECT workspace_id FROM agents WHERE id = :agent) AS agent_workspace",
            {"ws": workspace_id, "agent": agent_id}).fetchone()
        if not refs["workspace"]:
            return f"workspace_id: workspace {workspace_id!r} does not exist"
        if refs["agent_workspace"] is None:
            return f"agent_id: agent {agent_id!r} does not exist"
        if refs["agent_workspace"] != workspace_id:
            return (f"agent_id: agent {agent_id!r} belongs to workspace "
                    f"{refs['agent_workspace']!r}, not {workspace_id!r}")
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
    def _coalesce(conn: sqlite3.Connection, *, agent_id: str, reason: str, task_id: str | None,
                  key: str | None, payload_json: str, now: datetime,
                  window_start: str | None = None) -> dict[str, Any] | None:
        sql = ("SELECT * FROM runs WHERE agent_id = ? AND reason = ? AND status = 'queued'"
               " AND requested_at > ?")
        params: list[Any] = [agent_id, reason,
                             window_start or rfc3339(after(now, -COALESCE_WINDOW_S))]
        if reason == "task_assigned":
            sql += " AND task_id IS ?"
            params.append(task_id)
        row = conn.execute(sql + " ORDER BY seq DESC LIMIT 1", params).fetchone()
        if row is None:
            return None
        # As the contract says: any recent queued run of the agent and reason absorbs the
        # request, keyed or not (the absorbing run keeps its own key); only comment events,
        # each of which must be seen, are never merged.
        if (row["idempotency_key"] or "").startswith("task_comment:"):
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
        return run_from_row(updated) if updated is not None else None

    # -- claim ------------------------------------------------------------------
    #: Each eligible agent's oldest due queued run, oldest first. Eligible: active,
    #: cooled down, no claimed run. Driven by the agents (one index probe each on
    #: runs(agent_id, status), whose rowid order is the request order), so a busy
    #: agent's backlog is never walked, however deep it is.
    _HEADS = """
        SELECT s FROM (
          SELECT (SELECT q.seq FROM runs q
                  WHERE q.agent_id = a.id AND q.status = 'queued'
                    AND (q.scheduled_retry_at IS NULL OR q.scheduled_retry_at <= :now)
                  ORDER BY q.seq LIMIT 1) AS s
          FROM agents a
          WHERE a.status = 'active'
            AND (a.cooldown_until IS NULL OR a.cooldown_until <= :now)
            AND NOT EXISTS (SELECT 1 FROM runs c WHERE c.agent_id = a.id
                            AND c.status = 'claimed')
            {exclusion}
        ) AS heads WHERE s IS NOT NULL ORDER BY s LIMIT :limit
    """

    def claim_next(self, now: datetime, *, exclude_agents: Collection[str] = ()) -> Claim | None:
        """Atomically claim the oldest eligible queued run across every workspace."""
        claims = self.claim_batch(now, 1, exclude_agents=exclude_agents)
        return claims[0] if claims else None

    def claim_batch(self, now: datetime, limit: int, *,
                    exclude_agents: Collection[str] = ()) -> list[Claim]:
        """Claim up to ``limit`` runs in one statement, oldest first, one per agent.

        This is what ``limit`` successive :meth:`claim_next` calls would claim
        (each claim makes its agent busy, so the next one takes the next
        agent's oldest run), in one transaction. ``exclude_agents`` are agents
        that still have an execution running here (e.g. a cancelled run whose
        process is being stopped).

        A claim made in its own transaction does not wait for fsync
        (``synchronous=NORMAL`` for it alone): a claim lost to a power cut
        leaves its run ``queued``, which is exactly what start-up recovery
        makes of a claim that did reach the disk, so durability of the claim
        buys nothing. The outcome written afterwards is committed with full
        sync and carries the claim to disk with it. Inside a caller's
        transaction (the queue loop writing outcomes together with its
        claims) the claim simply shares that commit.
        """
        if limit < 1:
            return []
        token = uuid.uuid4().hex
        params: dict[str, Any] = {"now": rfc3339(now), "token": token, "boot": self.boot_id,
                                  "limit": int(limit)}
        if not self.store.writing and not self._anything_claimable(params, exclude_agents):
            # Nothing to claim (every queued run's agent is paused, busy or cooling
            # down): known from one read on a read connection, without the write lock,
            # the transaction and the sync switches a claim needs. Each enqueue wakes the
            # loop, so this is what a backlog of a paused agent costs per request.
            return []
        # (No subquery in RETURNING: SQLite evaluates it with a full scan of its table.)
        postgres = self.store.dialect == "postgresql"
        own = not self.store.writing
        with self._relaxed_sync(), self.store.transaction(exclusive=not postgres) as conn:
            excluded = set(exclude_agents)
            if postgres:
                # In its own transaction, a claim does not wait for the WAL flush (as
                # _relaxed_sync): said in the same round trip as the claim.
                rows = self._lock_and_claim_pg(
                    conn, excluded, params, limit, now,
                    first=[("SET LOCAL synchronous_commit TO OFF", ())] if own else [])
            else:
                if self.claim_gate is not None:
                    excluded.update(self.claim_gate(conn, now))
                rows = conn.execute(
                    self._CLAIM + " WHERE status = 'queued' AND seq IN ("
                    + self._HEADS.format(exclusion=self._exclusion(excluded, params))
                    + ") RETURNING *", params).fetchall()
            if not rows:
                return []
            if postgres:
                profiles = {r["agent_id"]: r["agent_profile"] for r in rows}
            else:
                agents = sorted({r["agent_id"] for r in rows})
                profiles = dict(conn.execute(
                    f"SELECT id, profile FROM agents WHERE id IN ({', '.join('?' * len(agents))})",
                    agents).fetchall())
        rows.sort(key=lambda r: r["seq"])
        return [Claim(run_from_row(r), r["claim_token"], profiles[r["agent_id"]]) for r in rows]

    def _anything_claimable(self, params: dict[str, Any], exclude_agents: Collection[str]
                            ) -> bool:
        """Would the claim find a run (the hard-budget gate aside)? A read, no write lock."""
        probe = dict(params)
        exclusion = self._exclusion(set(exclude_agents), probe)
        with self.store.reading():
            row = self.store.query_one(
                "SELECT EXISTS (" + self._HEADS.format(exclusion=exclusion) + ")", probe)
        return bool(row and row[0])

    _CLAIM = ("UPDATE runs SET status = 'claimed', claimed_at = :now,"
              " claim_token = :token || '.' || seq, claimed_by = :boot,"
              " attempt = attempt + 1, finished_at = NULL, updated_at = :now")
    #: PostgreSQL: the agents this transaction's last lock statement locked (a JSON list
    #: kept in a transaction-local setting), as an array to compare agent ids with.
    _CLAIMABLE = ("ARRAY(SELECT jsonb_array_elements_text(COALESCE(NULLIF("
                  "current_setting('kandevd.claimable', true), ''), '[]')::jsonb))")

    def _lock_and_claim_pg(self, conn: Any, excluded: set[str], params: dict[str, Any],
                           limit: int, now: datetime,
                           first: list[tuple[str, Any]] | None = None) -> list[Any]:
        """PostgreSQL: lock up to ``limit`` agents to claim for, and claim, in one round trip.

        Two statements, sent together in one pipeline. The first locks
        (``FOR UPDATE SKIP LOCKED``) the agents whose oldest due run is
        oldest, as the claim takes them, skipping agents another daemon is
        claiming for right now, and notes which in a transaction-local
        setting; the second claims the oldest due run of each agent noted.
        Every claim takes these locks first, so while this transaction holds
        an agent no other daemon claims for it; the claim, a statement of its
        own, reads a fresh snapshot and so sees every claim committed before
        it. The partial unique index (one claimed run per agent) stays the
        last word.

        With a ``claim_gate_probe``, the first statement locks nothing when
        the probe is true (then the second claims nothing): the gate is asked,
        and its blocked agents excluded from a second pair of statements.
        ``first``: statements sent before them, in the same round trip.
        """
        gate_checked = self.claim_gate is None or self.claim_gate_probe is None
        if self.claim_gate is not None and self.claim_gate_probe is None:
            excluded.update(self.claim_gate(conn, now))
        while True:
            exclusion = self._exclusion(excluded, params)
            # The heads read with room to skip agents locked elsewhere; the LIMIT counts
            # only the agents actually locked (PostgreSQL locks below the limit). They are
            # joined by seq, not "seq IN (heads)": each head is looked up by its key
            # instead of every queued run being scanned (PostgreSQL's planner chose that
            # scan while the table had no statistics yet).
            locked = ("SELECT a.id FROM (" + self._HEADS.format(exclusion=exclusion)
                      + ") AS heads JOIN runs q ON q.seq = heads.s"
                      " JOIN agents a ON a.id = q.agent_id"
                      + ("" if gate_checked else " WHERE NOT g.gated")
                      + " ORDER BY q.seq LIMIT :lock_limit FOR UPDATE OF a SKIP LOCKED")
            note = ("set_config('kandevd.claimable', COALESCE((SELECT json_agg(l.id) FROM ("
                    + locked + ") AS l)::text, '[]'), true)")
            lock = (f"SELECT FALSE, {note}" if gate_checked else
                    f"SELECT g.gated, {note} FROM ({self.claim_gate_probe}) AS g(gated)")
            # status again outside the subquery: PostgreSQL re-checks only these terms on
            # a row a concurrent cancel changed before committing. The agents' profiles
            # come back in the same statement.
            claim = (self._CLAIM + " FROM (" + self._HEADS.format(
                         exclusion=exclusion + " AND a.id = ANY(" + self._CLAIMABLE + ")")
                     + ") AS heads WHERE runs.seq = heads.s AND runs.status = 'queued'"
                     " RETURNING runs.*, (SELECT profile FROM agents"
                     " WHERE id = runs.agent_id) AS agent_profile")
            scan = {**params, "limit": limit * 4, "lock_limit": int(limit)}
            sent = conn.pipelined([*(first or ()), (lock, scan), (claim, params)])
            first = None
            gated = bool(sent[-2].fetchone()[0])
            rows = sent[-1].fetchall()
            if not gated:
                return rows
            if rows or self.claim_gate is None:  # the first statement locked nothing
                raise RuntimeError("a gated claim claimed runs")
            excluded.update(self.claim_gate(conn, now))
            gate_checked = True

    @staticmethod
    def _exclusion(excluded: set[str], params: dict[str, Any]) -> str:
        """The HEADS clause leaving out ``excluded`` agents; their names go into ``params``."""
        if not excluded:
            return ""
        names = []
        for i, agent in enumerate(sorted(excluded)):
            params[f"x{i}"] = agent
            names.append(f":x{i}")
        return f"AND a.id NOT IN ({', '.join(names)})"

    @contextmanager
    def _relaxed_sync(self) -> Iterator[None]:
        """``synchronous=NORMAL`` on the store's connection for the enclosed transaction."""
        if self.store.dialect != "sqlite":  # a SQLite setting; PostgreSQL commits as it does
            yield
            return
        with self.store.connection() as conn:
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

    # -- attempt outcomes -------------------------------------------------------
    def _lock_agent_of(self, conn: Any, run_id: str) -> float | None:
        """PostgreSQL: lock the run's agent row before the run's (an outcome's lock order).

        Outcomes do not take the writer lock there. Taking the agent first, as
        every claim does, means an outcome never holds a run or a run count
        while it waits for an agent a claim holds: no lock cycle between them.
        Returns the agent's ``cooldown_s`` (None on SQLite), read with the lock.
        """
        if self.store.dialect != "postgresql":
            return None
        row = conn.execute("SELECT a.cooldown_s FROM agents a JOIN runs r ON r.agent_id = a.id"
                           " WHERE r.id = ? FOR UPDATE OF a", (run_id,)).fetchone()
        return float(row[0] or 0) if row is not None else None

    def finish(self, run_id: str, token: str, *, now: datetime, summary: str | None,
               cost_cents: float | None, log_path: str | None) -> bool:
        """Record a successful attempt (fenced by ``token``); False when it was superseded.

        Single-row and fenced, so on PostgreSQL it needs no writer lock.
        """
        params = {"now": rfc3339(now), "summary": summary, "cost": cost_cents,
                  "log": log_path, "id": run_id, "token": token}
        with self.store.transaction(exclusive=False) as conn:
            if self.store.dialect == "postgresql":
                # One round trip instead of three (the agent locked, the run, the agent's
                # cooldown): this is every run's outcome, on a database across a network.
                return conn.execute(_PG_FINISH, params).fetchone() is not None
            row = conn.execute(_FINISH + " WHERE id = :id AND status = 'claimed'"
                               " AND claim_token = :token RETURNING agent_id",
                               params).fetchone()
            if row is None:
                return False
            self._start_cooldown(conn, row["agent_id"], now)
        return True

    def fail_attempt(self, run_id: str, token: str, *, now: datetime, error: str,
                     policy: RetryConfig, summary: str | None = None,
                     cost_cents: float | None = None, log_path: str | None = None,
                     draw: float | None = None) -> dict[str, Any] | None:
        """Apply the retry policy to a failed attempt; None when the token is stale."""
        now_s = rfc3339(now)
        with self.store.transaction(exclusive=False) as conn:
            cooldown_s = self._lock_agent_of(conn, run_id)
            row = conn.execute("SELECT * FROM runs WHERE id = ? AND status = 'claimed'"
                               " AND claim_token = ?", (run_id, token)).fetchone()
            if row is None:
                return None
            decision = decide_retry(policy, retry_count=row["retry_count"],
                                    requested_at=parse_rfc3339(row["requested_at"]),
                                    now=now, draw=draw)
            common = {"now": now_s, "error": error, "summary": summary, "cost": cost_cents,
                      "log": log_path, "seq": row["seq"]}
            if row["attempt"] >= self.max_attempts and decision.action == "retry":
                decision = RetryDecision("fail", None)
                common["error"] = gave_up(row["attempt"], error)
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
                sql + " output_summary = :summary, cost_cents = " + _ADD_COST + ","
                " log_path = COALESCE(:log, log_path), updated_at = :now"
                " WHERE seq = :seq AND status = 'claimed' AND claim_token = :token"
                " RETURNING *", {**common, "token": token}).fetchone()
            if updated is None:
                return None
            self._start_cooldown(conn, row["agent_id"], now, cooldown_s)
        return run_from_row(updated)

    @staticmethod
    def _start_cooldown(conn: sqlite3.Connection, agent_id: str, now: datetime,
                        cooldown_s: float | None = None) -> None:
        """The agent's last run ended now: record it and start its cooldown.

        ``cooldown_s``: the agent's, when the caller read it already.
        """
        if cooldown_s is None:
            agent = conn.execute("SELECT cooldown_s FROM agents WHERE id = ?",
                                 (agent_id,)).fetchone()
            cooldown_s = float(agent["cooldown_s"] or 0) if agent else 0.0
        cooldown = cooldown_s
        conn.execute(
            "UPDATE agents SET last_finished_at = ?, cooldown_until = ? WHERE id = ?",
            (rfc3339(now), rfc3339(after(now, cooldown)) if cooldown > 0 else None, agent_id))

    # -- recovery ---------------------------------------------------------------
    _REQUEUE = ("UPDATE runs SET status = 'queued', claimed_at = NULL, claim_token = NULL,"
                " claimed_by = NULL, updated_at = :now")

    def requeue(self, run_id: str, token: str, now: datetime) -> bool:
        """Put a claim whose execution never started back in the queue.

        Nothing ran, so the claim's attempt is given back.
        """
        with self.store.transaction() as conn:
            return conn.execute(self._REQUEUE + ", attempt = CASE WHEN attempt > 0"
                                " THEN attempt - 1 ELSE 0 END"
                                " WHERE id = :id AND status = 'claimed'"
                                " AND claim_token = :token",
                                {"now": rfc3339(now), "id": run_id, "token": token}).rowcount > 0

    def rescue(self, conn: sqlite3.Connection, run_id: str, token: str | None, now: datetime,
               why: str) -> str | None:
        """An execution whose outcome is unknown: back to the queue, or the dead letter.

        The execution counted an attempt when it was claimed; a run that has
        used ``max_attempts`` becomes ``failed`` ("gave up after N attempts;
        last: <why>") instead of executing again without bound. Returns the
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
        if row["attempt"] >= self.max_attempts:
            # PostgreSQL: the agent locked before the run, in the order claims and outcomes
            # take them (the cooldown below writes the agent).
            cooldown_s = self._lock_agent_of(conn, run_id)
            failed = conn.execute(
                "UPDATE runs SET status = 'failed', finished_at = ?, claim_token = NULL,"
                " error_message = ?, scheduled_retry_at = NULL, updated_at = ?"
                " WHERE seq = ? AND status = 'claimed' AND claim_token IS ?",
                (now_s, gave_up(row["attempt"], why), now_s, row["seq"], token)).rowcount
            if not failed:
                return None
            self._start_cooldown(conn, row["agent_id"], now, cooldown_s)
            return "failed"
        requeued = conn.execute(self._REQUEUE + ", error_message = :why WHERE seq = :seq"
                                " AND status = 'claimed' AND claim_token IS :token",
                                {"now": now_s, "why": why, "seq": row["seq"],
                                 "token": token}).rowcount
        return "queued" if requeued else None

    def _not_a_live_peers(self) -> str:
        """The SQL condition: the claim's daemon is not another live daemon."""
        if self.peers_dead_after_s is None:
            return ""
        held = "".join(f" AND d.boot_id != '{boot}'" for boot in self.held_peers
                       if boot.isalnum())  # boot ids are hex: nothing to quote
        return (" AND NOT EXISTS (SELECT 1 FROM daemons d WHERE d.boot_id = runs.claimed_by"
                " AND d.stopped_at IS NULL AND d.heartbeat_at >= now() - make_interval(secs =>"
                f" {float(self.peers_dead_after_s)!r}){held})")

    def _earlier_instances_only(self) -> str:
        """With peers: only claims of this home's earlier instances (and unowned ones).

        What start-up settles. A dead daemon of another home is rescued by the
        heartbeat, once this daemon's own heartbeat is steady: right after an
        outage of the database every heartbeat is old, and a daemon starting
        then must not take everyone else for dead.
        """
        if self.peers_dead_after_s is None:
            return ""
        held = ", ".join(f"'{boot}'" for boot in self.held_peers if boot.isalnum())
        return f" AND (claimed_by IS NULL{f' OR claimed_by IN ({held})' if held else ''})"

    def foreign_claims(self) -> list[sqlite3.Row]:
        """Claims made by an earlier instance of this daemon (at start-up: all of theirs)."""
        return self.store.query(
            "SELECT id, claim_token, agent_id, attempt FROM runs WHERE status = 'claimed'"
            " AND (claimed_by IS NULL OR claimed_by != ?)" + self._earlier_instances_only()
            + " ORDER BY seq", (self.boot_id,))

    def claim_of(self, run_id: str, token: str) -> Claim | None:
        """The claim ``token`` of run ``run_id`` while it is still in force, else None."""
        with self.store.connection() as conn:
            row = conn.execute("SELECT * FROM runs WHERE id = ? AND status = 'claimed'"
                               " AND claim_token = ?", (run_id, token)).fetchone()
            if row is None:
                return None
            profile = conn.execute("SELECT profile FROM agents WHERE id = ?",
                                   (row["agent_id"],)).fetchone()
        return Claim(run_from_row(row), token, profile["profile"] if profile else "default")

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

    def requeue_foreign_claims(self, now: datetime,
                               why: str = "interrupted: the daemon stopped during the execution",
                               *, keep: Collection[str] = (), dead_peers: bool = False
                               ) -> dict[str, str]:
        """At start-up: claims of earlier instances with no known outcome are rescued.

        ``keep``: runs whose outcome is known here but not written yet. Returns
        ``{run_id: new status}`` (``queued``, or ``failed`` once the run has
        used its attempts).
        """
        done: dict[str, str] = {}
        with self.store.transaction() as conn:
            scope = self._not_a_live_peers() if dead_peers else self._earlier_instances_only()
            rows = conn.execute(
                "SELECT id, claim_token FROM runs WHERE status = 'claimed'"
                " AND (claimed_by IS NULL OR claimed_by != ?)" + scope
                + " ORDER BY seq", (self.boot_id,)).fetchall()
            for r in rows:
                if r["id"] in keep:
                    continue
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
               + own)
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

    def retry(self, run_id: str, now: datetime) -> dict[str, Any]:
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
        return run_from_row(updated)

    def oldest_queued_at(self) -> str | None:
        """``requested_at`` of the oldest queued run (request order), or None."""
        row = self.store.query_one("SELECT requested_at FROM runs WHERE status = 'queued'"
                                   " ORDER BY seq LIMIT 1")
        return row[0] if row else None

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

    # -- cancel -----------------------------------------------------------------
    def cancel(self, run_id: str, reason: str | None, now: datetime, *,
               only_queued: bool = False) -> tuple[dict[str, Any], str]:
        """Cancel a queued or claimed run (only a queued one with ``only_queued``).

        Returns (run, previous status); a run not in a cancellable status is RunConflict.
        """
        now_s = rfc3339(now)
        with self.store.transaction() as conn:
            # The status read is the status changed: a claim made in between (on
            # PostgreSQL claims do not take the writer lock) is seen, and read again.
            while True:
                row = conn.execute("SELECT status FROM runs WHERE id = ?",
                                   (run_id,)).fetchone()
                if row is None:
                    raise RunNotFound(run_id)
                previous = row["status"]
                if previous in TERMINAL or (only_queued and previous != "queued"):
                    raise RunConflict(f"run {run_id!r} is already {previous}; nothing to cancel")
                updated = conn.execute(
                    "UPDATE runs SET status = 'cancelled', cancel_reason = ?, finished_at = ?,"
                    " claim_token = NULL, updated_at = ? WHERE id = ? AND status = ? RETURNING *",
                    (reason or "cancelled", now_s, now_s, run_id, previous)).fetchone()
                if updated is not None:
                    return run_from_row(updated), previous

    # -- reads ------------------------------------------------------------------
    def get(self, run_id: str) -> dict[str, Any]:
        row = self.store.query_one("SELECT * FROM runs WHERE id = ?", (run_id,))
        if row is None:
            raise RunNotFound(run_id)
        return run_from_row(row)

    def list(self, *, limit: int = 50, offset: int = 0, order: str = "asc",
             **filters: Any) -> dict[str, Any]:
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
        return {"items": [run_from_row(r) for r in rows], "total": total,
                "limit": limit, "offset": offset}

    def explain(self, run_id: str, now: datetime, *, runtime_full: bool,
                live_agents: Collection[str] = ()) -> dict[str, Any]:
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
            if self.claim_gate is not None:
                gate = self.claim_gate(conn, now).get(run["agent_id"])
                if gate is not None:
                    blockers.append("budget_exceeded")
                    details["budget_exceeded"] = gate
            busy = conn.execute("SELECT id FROM runs WHERE agent_id = ? AND status = 'claimed'",
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
            if runtime_full:
                blockers.append("runtime_full")
        return {"eligible": not blockers, "blockers": blockers, "details": details}
