"""The runners on other machines: the ``runners`` table and the agents' ``runs_on``.

A runner is a name, the labels it carries and the SHA-256 of its token (the
token itself is shown once, by ``kandevd runners add``, and never stored). Its
runs are the runs claimed with ``claimed_by = 'runner:<name>'``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any, NamedTuple

from kandevd.store.base import BaseStore
from kandevd.timeutil import parse_rfc3339, rfc3339

#: What ``runs.claimed_by`` holds for a run a runner took.
CLAIMED_BY_PREFIX = "runner:"


def claimed_by(name: str) -> str:
    """The ``claimed_by`` of runner ``name``'s claims."""
    return CLAIMED_BY_PREFIX + name


class RunnerRow(NamedTuple):
    name: str
    labels: tuple[str, ...]
    token_hash: str
    created_at: str
    last_seen_at: datetime | None
    #: The runner home that serves this runner now (None: none said yet).
    home_id: str | None = None
    #: When it last stopped gracefully, saying so (None: never).
    left_at: datetime | None = None

    def online(self, now: datetime, dead_after_s: float) -> bool:
        """Heard from within ``dead_after_s``, and not stopped since (gracefully)."""
        if self.last_seen_at is None or (self.left_at is not None
                                         and self.left_at >= self.last_seen_at):
            return False
        return (now - self.last_seen_at).total_seconds() < dead_after_s


class RunnerExists(ValueError):
    """A runner of that name is already registered."""


class Runners:
    """Every statement about runners, on either database."""

    def __init__(self, store: BaseStore) -> None:
        self.store = store

    def add(self, name: str, labels: Sequence[str], token_hash: str, now: datetime) -> None:
        with self.store.transaction() as conn:
            if conn.execute("SELECT 1 FROM runners WHERE name = ?", (name,)).fetchone():
                raise RunnerExists(f"a runner named {name!r} already exists")
            conn.execute("INSERT INTO runners (name, token_hash, labels, created_at)"
                         " VALUES (?, ?, ?, ?)",
                         (name, token_hash, json.dumps(list(labels)), rfc3339(now)))

    def remove(self, name: str) -> bool:
        """Forget runner ``name`` (its token stops working at once); False: none."""
        return self.store.execute("DELETE FROM runners WHERE name = ?", (name,)) > 0

    def all(self) -> list[RunnerRow]:
        rows = self.store.query("SELECT name, labels, token_hash, created_at, last_seen_at,"
                                " home_id, left_at FROM runners ORDER BY name")
        return [_row(r) for r in rows]

    def by_token_hash(self, token_hash: str) -> RunnerRow | None:
        row = self.store.query_one("SELECT name, labels, token_hash, created_at,"
                                   " last_seen_at, home_id, left_at FROM runners"
                                   " WHERE token_hash = ?",
                                   (token_hash,))
        return _row(row) if row is not None else None

    def served_by(self, name: str, home_id: str, now: datetime) -> None:
        """Runner home ``home_id`` serves ``name`` from now on (it said hello)."""
        self.store.execute("UPDATE runners SET home_id = ?, last_seen_at = ? WHERE name = ?",
                           (home_id, rfc3339(now), name))

    def offline(self, name: str, now: datetime) -> None:
        """``name`` stopped gracefully: not online from ``now`` (until it is heard again)."""
        self.store.execute("UPDATE runners SET left_at = ? WHERE name = ?", (rfc3339(now), name))

    def seen(self, name: str, now: datetime) -> None:
        self.store.execute("UPDATE runners SET last_seen_at = ? WHERE name = ?",
                           (rfc3339(now), name))

    def running(self) -> dict[str, int]:
        """How many runs each runner holds claimed, by runner name."""
        rows = self.store.query(
            "SELECT claimed_by, COUNT(*) FROM runs WHERE status = 'claimed'"
            " AND claimed_by LIKE 'runner:%' GROUP BY claimed_by")
        return {str(r[0])[len(CLAIMED_BY_PREFIX):]: int(r[1]) for r in rows}

    def claims_of(self, name: str) -> list[tuple[str, str]]:
        """The ``(run id, claim token)`` of every run runner ``name`` holds claimed."""
        rows = self.store.query("SELECT id, claim_token FROM runs WHERE status = 'claimed'"
                                " AND claimed_by = ?", (claimed_by(name),))
        return [(str(r[0]), str(r[1])) for r in rows]

    def every_claim(self) -> list[tuple[str, str]]:
        """The ``(run id, claim token)`` of every run a runner holds claimed."""
        rows = self.store.query("SELECT id, claim_token FROM runs WHERE status = 'claimed'"
                                " AND claimed_by LIKE 'runner:%'")
        return [(str(r[0]), str(r[1])) for r in rows]

    def remote_agents(self) -> dict[str, tuple[str, ...]]:
        """Every agent that runs on a runner, with the labels it needs."""
        rows = self.store.query("SELECT id, runs_on FROM agents WHERE runs_on IS NOT NULL")
        return {str(r[0]): tuple(json.loads(r[1])) for r in rows if r[1]}


    # -- cancelled runs whose agent a runner is still stopping ------------------------
    def stops_of(self, name: str) -> dict[str, datetime]:
        """The executions runner ``name`` is stopping (their runs cancelled), with when
        each was cancelled, by execution id."""
        rows = self.store.query("SELECT token, since FROM runner_stops WHERE runner = ?",
                                (name,))
        return {str(r[0]): parse_rfc3339(str(r[1])) for r in rows}

    def stopping(self) -> dict[str, str]:
        """Every agent a runner is still stopping, with that runner's name: until it
        has, the agent takes no other run (one execution per agent, on any daemon)."""
        rows = self.store.query("SELECT agent_id, runner FROM runner_stops")
        return {str(r[0]): str(r[1]) for r in rows}

    def stops_ended(self, name: str, tokens: Sequence[str] | None) -> list[str]:
        """Runner ``name`` no longer runs these executions (None: any of its stops), ended
        or never had; the runs whose stop this ends."""
        if tokens is not None and not tokens:
            return []
        which = "" if tokens is None else f" AND token IN ({', '.join('?' * len(tokens))})"
        with self.store.transaction() as conn:
            rows = conn.execute(f"DELETE FROM runner_stops WHERE runner = ?{which}"
                                " RETURNING run_id", (name, *(tokens or ()))).fetchall()
        return [str(r[0]) for r in rows]

    def forget_stops(self) -> None:
        """No runner can be heard (no gateway): what they were stopping is not waited for."""
        self.store.execute("DELETE FROM runner_stops")


def stop_on_runner(conn: Any, claimed: Any, now_s: str) -> None:
    """Inside the cancel of ``claimed`` (a run's row as it was): when a runner holds
    it, the runner's execution is being stopped from now on (until the runner says
    it ended, or is silent long enough to have stopped it)."""
    by = claimed["claimed_by"]
    if claimed["status"] == "claimed" and by and str(by).startswith(CLAIMED_BY_PREFIX) \
            and claimed["claim_token"]:
        conn.execute("INSERT INTO runner_stops (token, runner, run_id, agent_id, since)"
                     " VALUES (?, ?, ?, ?, ?) ON CONFLICT (token) DO NOTHING",
                     (claimed["claim_token"], str(by)[len(CLAIMED_BY_PREFIX):],
                      claimed["id"], claimed["agent_id"], now_s))


def _row(row: Sequence[object]) -> RunnerRow:
    seen = row[4]
    return RunnerRow(name=str(row[0]), labels=tuple(json.loads(str(row[1]))),
                     token_hash=str(row[2]), created_at=str(row[3]),
                     last_seen_at=parse_rfc3339(str(seen)) if seen else None,
                     home_id=str(row[5]) if len(row) > 5 and row[5] else None,
                     left_at=parse_rfc3339(str(row[6])) if len(row) > 6 and row[6] else None)
