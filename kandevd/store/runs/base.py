"""What every part of the run repository shares: its store, its dialect, its bounds."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from datetime import datetime
from typing import Any, Protocol

from kandevd.runs.coalescing import Coalescing
from kandevd.runs.retry import GiveUp
from kandevd.store.base import BaseStore
from kandevd.timeutil import after, rfc3339

#: ``(conn, now) -> {agent_id: reason}``: agents that must not be claimed for now
#: (a hard budget they are over), asked inside the claim's transaction.
ClaimGate = Callable[[sqlite3.Connection, datetime], Mapping[str, str]]


class RunSql(Protocol):
    """What differs between the databases (sql_sqlite.py, sql_postgres.py)."""

    def count_queued(self, conn: Any, inserted: int) -> None:
        """Add ``inserted`` new runs to ``run_counts`` (no trigger counts inserts)."""

    def claim_sync(self, store: BaseStore) -> AbstractContextManager[None]:
        """The durability of a claim made in its own transaction (none needed)."""

    def claim(self, repo: RunRepositoryBase, conn: Any, excluded: set[str],
              params: dict[str, Any], limit: int, now: datetime, own: bool,
              only: frozenset[str] | None = None) -> tuple[list[Any], dict[str, str]]:
        """Claim up to ``limit`` heads (of the agents that run here; ``only``: of these
        agents, for a runner); the claimed rows and their agents' profiles."""

    def lock_agent_of(self, conn: Any, run_id: str) -> float | None:
        """Lock the run's agent before its run where rows are locked; its ``cooldown_s``."""

    def finish(self, repo: RunRepositoryBase, conn: Any, params: dict[str, Any],
               now: datetime) -> bool:
        """A successful attempt and its agent's cooldown; False when superseded."""

    def live_peer_excluded(self, dead_after_s: float | None, held: Sequence[str]) -> str:
        """The condition: a claim's daemon is not another live daemon ("" alone)."""

    def earlier_instances_only(self, dead_after_s: float | None, held: Sequence[str]) -> str:
        """The condition: a claim of this home's earlier instances ("" alone)."""


class RunRepositoryBase:
    """The state every part of :class:`~kandevd.store.runs.RunRepository` reads."""

    store: BaseStore
    sql: RunSql
    boot_id: str
    #: The attempt limit, the caller's policy (:func:`kandevd.runs.retry.attempt_limit`).
    give_up: GiveUp
    #: Which queued run a request merges into, the caller's rules (kandevd.runs.coalescing).
    coalescing: Coalescing
    claim_gate: ClaimGate | None
    claim_gate_probe: str | None
    #: Several daemons on one store: claims of a daemon whose heartbeat is younger than
    #: this many seconds are its own, never rescued here. None: this daemon is alone.
    peers_dead_after_s: float | None
    #: Earlier daemons of this host and home (kept alive by this one until their claims
    #: are restored): their claims are this daemon's to restore or rescue.
    held_peers: tuple[str, ...]

    def start_cooldown(self, conn: Any, agent_id: str, now: datetime,
                        cooldown_s: float | None = None) -> None:
        """The agent's last run ended now: record it and start its cooldown.

        ``cooldown_s``: the agent's, when the caller read it already.
        """
        now_s = rfc3339(now)
        if cooldown_s is None:
            # Most agents have no cooldown: for them one statement does it all.
            if conn.execute("UPDATE agents SET last_finished_at = ?, cooldown_until = NULL"
                            " WHERE id = ? AND COALESCE(cooldown_s, 0) <= 0",
                            (now_s, agent_id)).rowcount:
                return
            agent = conn.execute("SELECT cooldown_s FROM agents WHERE id = ?",
                                 (agent_id,)).fetchone()
            cooldown_s = float(agent["cooldown_s"] or 0) if agent else 0.0
        conn.execute(
            "UPDATE agents SET last_finished_at = ?, cooldown_until = ? WHERE id = ?",
            (now_s, rfc3339(after(now, cooldown_s)) if cooldown_s > 0 else None, agent_id))
