"""Scheduled turns handed to runners: the ``remote_turns`` table and their output.

A turn of a schedule with ``runs_on`` is written here by the daemon whose session
runs it (its ``owner``), so that any daemon's gateway on the same database can
hand it to a runner, take its output and its end. Only the owner reads the output
into the turn's log and gives the end to its session; then it deletes the row.
The output travels as base64 chunks (``remote_turn_output``), each from the byte
offset the runner gave it, so a resent chunk is never appended twice.

On PostgreSQL a turn whose owner is not alive (its heartbeat older than the
cluster's ``dead_after_s``, or stopped) is not handed out, and a runner holding one
is told to stop it: nobody would record its end.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, NamedTuple

from kandevd.store.base import BaseStore
from kandevd.timeutil import parse_rfc3339, rfc3339

#: How many waiting turns one look reads (the oldest first).
WAITING_LIMIT = 200


class WaitingTurn(NamedTuple):
    token: str
    run_id: str
    profile: str
    labels: tuple[str, ...]
    stdin: dict[str, Any]


class HeldTurn(NamedTuple):
    token: str
    handed_at: datetime
    #: Stop it: its session stopped it, or its owner is gone.
    cancel: bool


class OwnTurn(NamedTuple):
    """One of the owner's turns as the table has it."""

    runner: str | None
    ending: dict[str, Any] | None


class Appended(NamedTuple):
    """A chunk's fate: ``gap`` (it starts past ``received``: resend from there)."""

    received: int
    gap: bool


class RemoteTurnRows:
    """Every statement about turns on runners, on either database."""

    def __init__(self, store: BaseStore, owner: str, *,
                 owners_dead_after_s: float | None = None) -> None:
        self.store = store
        self.owner = owner
        if owners_dead_after_s is None:  # one daemon on the database: every owner is it
            self._alive, self._alive_params = "1 = 1", ()
        else:
            self._alive = ("owner IN (SELECT boot_id FROM daemons WHERE stopped_at IS NULL"
                           " AND heartbeat_at >= now() - make_interval(secs => ?))")
            self._alive_params = (float(owners_dead_after_s),)

    def forget_others(self) -> int:
        """Delete the turns of other owners (one daemon on a database: they are an
        earlier instance's, whose sessions a restart settles); how many."""
        with self.store.transaction() as conn:
            gone = conn.execute("DELETE FROM remote_turns WHERE owner != ?",
                                (self.owner,)).rowcount
            conn.execute("DELETE FROM remote_turn_output WHERE token NOT IN"
                         " (SELECT token FROM remote_turns)")
        return int(gone)

    def add(self, turn: WaitingTurn, now: datetime) -> None:
        self.store.execute(
            "INSERT INTO remote_turns (token, owner, run_id, profile, labels, stdin,"
            " queued_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (turn.token, self.owner, turn.run_id, turn.profile, json.dumps(list(turn.labels)),
             json.dumps(turn.stdin), rfc3339(now)))

    def waiting(self) -> list[WaitingTurn]:
        """The turns no runner took yet, of owners alive, the oldest first."""
        rows = self.store.query(
            "SELECT token, run_id, profile, labels, stdin FROM remote_turns"
            f" WHERE runner IS NULL AND {self._alive} ORDER BY queued_at, token"
            f" LIMIT {WAITING_LIMIT}", self._alive_params)
        return [WaitingTurn(str(r[0]), str(r[1]), str(r[2]), tuple(json.loads(r[3])),
                            json.loads(r[4])) for r in rows]

    def hand(self, token: str, runner: str, now: datetime) -> bool:
        """Give ``token`` to ``runner``; False: another poll took it first."""
        return self.store.execute(
            "UPDATE remote_turns SET runner = ?, handed_at = ? WHERE token = ?"
            " AND runner IS NULL", (runner, rfc3339(now), token)) == 1

    def held(self, runner: str) -> dict[str, HeldTurn]:
        """The turns ``runner`` holds that have not ended, by token."""
        rows = self.store.query(
            f"SELECT token, handed_at, cancel, CASE WHEN {self._alive} THEN 0 ELSE 1 END"
            " FROM remote_turns WHERE runner = ? AND ending IS NULL",
            (*self._alive_params, runner))
        return {str(r[0]): HeldTurn(str(r[0]), parse_rfc3339(str(r[1])),
                                    bool(r[2]) or bool(r[3])) for r in rows}

    def append(self, token: str, runner: str, offset: int, data: bytes) -> Appended | None:
        """Keep the bytes of ``data`` (from ``offset`` of this runner's execution, which
        starts at ``base`` of the turn's output) not received yet; None: ``runner``
        holds no such turn (or it ended)."""
        with self.store.transaction() as conn:
            row = conn.execute("SELECT received, base FROM remote_turns WHERE token = ?"
                               " AND runner = ? AND ending IS NULL", (token, runner)).fetchone()
            if row is None:
                return None
            received, base = int(row[0]), int(row[1])
            if offset > received - base:
                return Appended(received - base, gap=True)
            fresh = data[received - base - offset:]
            if fresh:
                self._output(conn, token, received, fresh)
            return Appended(received - base + len(fresh), gap=False)

    def release(self, token: str, runner: str, note: bytes) -> bool:
        """``runner`` stopped during the turn (gracefully): it waits for a runner again,
        ``note`` in its output, the next execution's output after it; False: not its,
        ended, or stopped by its session (which the interruption then ends)."""
        with self.store.transaction() as conn:
            row = conn.execute("SELECT received FROM remote_turns WHERE token = ? AND"
                               " runner = ? AND ending IS NULL AND cancel = 0",
                               (token, runner)).fetchone()
            if row is None:
                return False
            self._output(conn, token, int(row[0]), note)
            conn.execute("UPDATE remote_turns SET runner = NULL, handed_at = NULL,"
                         " base = received WHERE token = ?", (token,))
        return True

    @staticmethod
    def _output(conn: Any, token: str, at: int, data: bytes) -> None:
        conn.execute("INSERT INTO remote_turn_output (token, start, data) VALUES (?, ?, ?)",
                     (token, at, base64.b64encode(data).decode("ascii")))
        conn.execute("UPDATE remote_turns SET received = ? WHERE token = ?",
                     (at + len(data), token))

    def end(self, token: str, runner: str, ending: Mapping[str, object]) -> bool:
        """Note how ``runner``'s turn ended; False: not its, or ended already."""
        return self.store.execute(
            "UPDATE remote_turns SET ending = ? WHERE token = ? AND runner = ?"
            " AND ending IS NULL", (json.dumps(ending), token, runner)) == 1

    def withdraw(self, token: str) -> bool:
        """Delete ``token`` if no runner took it yet; False: one did."""
        return self.store.execute("DELETE FROM remote_turns WHERE token = ?"
                                  " AND runner IS NULL", (token,)) == 1

    def cancel(self, token: str) -> None:
        self.store.execute("UPDATE remote_turns SET cancel = 1 WHERE token = ?", (token,))

    def own(self, tokens: Sequence[str]) -> dict[str, OwnTurn]:
        """The owner's turns among ``tokens`` that are still in the table."""
        if not tokens:
            return {}
        marks = ", ".join("?" for _ in tokens)
        rows = self.store.query(f"SELECT token, runner, ending FROM remote_turns"
                                f" WHERE owner = ? AND token IN ({marks})",
                                (self.owner, *tokens))
        return {str(r[0]): OwnTurn(r[1], json.loads(r[2]) if r[2] else None) for r in rows}

    def output(self, token: str) -> list[tuple[int, bytes]]:
        """The output chunks of ``token`` not read yet, in order."""
        rows = self.store.query("SELECT start, data FROM remote_turn_output WHERE token = ?"
                                " ORDER BY start", (token,))
        return [(int(r[0]), base64.b64decode(r[1])) for r in rows]

    def output_read(self, token: str, through: int) -> None:
        """The chunks of ``token`` starting at or before ``through`` are in its log."""
        self.store.execute("DELETE FROM remote_turn_output WHERE token = ? AND start <= ?",
                           (token, through))

    def drop(self, token: str) -> None:
        """Forget ``token`` and what is left of its output."""
        with self.store.transaction() as conn:
            conn.execute("DELETE FROM remote_turns WHERE token = ?", (token,))
            conn.execute("DELETE FROM remote_turn_output WHERE token = ?", (token,))
