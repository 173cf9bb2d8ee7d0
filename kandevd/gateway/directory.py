"""The runners a daemon knows: registered with a token shown once, listed, removed.

``runners.add`` makes a token (256 random bits) and keeps only its SHA-256;
``runners.remove`` deletes the row, so the runner's next request is refused.
A runner is online while its last request is more recent than
``gateway.dead_after_s`` (as any daemon on the store saw it).
"""

from __future__ import annotations

import logging
import re
import sqlite3
from collections.abc import Sequence
from datetime import datetime
from typing import TypedDict

from kandevd.gateway.protocol import new_token, token_hash
from kandevd.runs.labels import bad_label
from kandevd.store.runners import RunnerRow, Runners
from kandevd.timeutil import rfc3339, utc_now

log = logging.getLogger("kandevd.gateway")

#: A runner's name: it appears in logs, claims and paths of nothing (but keep it tame).
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")


class RunnerNotFound(LookupError):
    pass


class RunnerItem(TypedDict):
    name: str
    labels: list[str]
    online: bool
    last_seen_at: str | None
    running: int


class Added(TypedDict):
    name: str
    labels: list[str]
    token: str


class RunnerDirectory:
    def __init__(self, runners: Runners, *, dead_after_s: float) -> None:
        self.runners = runners
        self.dead_after_s = dead_after_s
        #: The runners online as last read (the database out of reach: what was known).
        self._online_seen: tuple[frozenset[str], ...] = ()

    def add(self, name: str, labels: Sequence[str], now: datetime) -> Added:
        """Register ``name``; its token, which nothing keeps (ValueError: a bad name or
        label; RunnerExists: the name is taken)."""
        if not NAME_RE.fullmatch(name):
            raise ValueError(f"name: {name!r} is not a runner name (letters, digits, '.', "
                             "'_', '-'; 63 at most)")
        bad = bad_label(labels)
        if bad is not None:
            raise ValueError(f"labels: {bad!r} is not a label")
        token = new_token()
        unique = sorted(set(labels))
        self.runners.add(name, unique, token_hash(token), now)
        log.info("runner %s added (labels %s)", name, ",".join(unique) or "-")
        return {"name": name, "labels": unique, "token": token}

    def remove(self, name: str) -> None:
        if not self.runners.remove(name):
            raise RunnerNotFound(f"no runner {name!r}")
        log.info("runner %s removed: its token is refused from now on", name)

    def online_labels(self) -> tuple[frozenset[str], ...]:
        """The label sets of the runners online (seen by any daemon within dead_after_s);
        as last read while the database is out of reach or refuses (a job's state says
        what it can, not an error)."""
        if self.runners.store.out_of_reach() is not None:
            return self._online_seen
        now = utc_now()
        try:
            rows = self.runners.all()
        except sqlite3.Error as exc:
            log.debug("the runners cannot be read: %s", exc)
            return self._online_seen
        self._online_seen = tuple(frozenset(row.labels) for row in rows
                                  if row.online(now, self.dead_after_s))
        return self._online_seen

    def items(self, now: datetime) -> list[RunnerItem]:
        running = self.runners.running()
        return [{"name": row.name, "labels": list(row.labels),
                 "online": row.online(now, self.dead_after_s),
                 "last_seen_at": rfc3339(row.last_seen_at) if row.last_seen_at else None,
                 "running": running.get(row.name, 0)}
                for row in self.runners.all()]


def home_problem(runners: Runners, runner: RunnerRow, home_id: str, *, hello: bool,
                 dead_after_s: float, now: datetime) -> str | None:
    """Why runner home ``home_id`` may not act as ``runner`` now (None: it may).

    One token serves one runner: a second runner process on another home would
    take the first one's runs as "lost" and have them taken back in turn, each
    attempt cut short. The home that said hello last serves the name; another one
    is refused while that one is heard from (within ``dead_after_s``), and takes
    the name over once it is silent. (A runner that says no home, of an earlier
    version, is not checked.)"""
    serving = runner.home_id
    if not home_id or serving is None or serving == home_id:
        if hello and home_id and serving != home_id:
            runners.served_by(runner.name, home_id, now)
        return None
    if not hello:
        return (f"runner {runner.name} is served by another runner home now: this "
                "process is not that runner any more")
    silent = _silent_for(runner, now)
    if silent is not None and silent < dead_after_s:
        return (f"runner {runner.name} is served by another runner home, heard from "
                f"{silent:.0f}s ago: one token serves one runner process; stop that "
                f"one (or wait until it has been silent for {dead_after_s:g}s), or add "
                "another runner for this one")
    log.warning("runner %s: taken over by another runner home (the one before was "
                "silent)", runner.name)
    runners.served_by(runner.name, home_id, now)
    return None


def _silent_for(runner: RunnerRow, now: datetime) -> float | None:
    """Seconds since any daemon last heard from ``runner`` (what ``runners.list`` calls
    online: within ``dead_after_s``); None: never, or it stopped since."""
    if not runner.online(now, float("inf")):
        return None
    assert runner.last_seen_at is not None
    return max(0.0, (now - runner.last_seen_at).total_seconds())
