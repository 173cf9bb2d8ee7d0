"""Retention: terminal runs older than ``queue.retention_days`` are pruned with their files.

A run is a candidate when its status is terminal (``finished``, ``failed``,
``cancelled``) and it ended (``finished_at``, else ``updated_at`` when that is
NULL) before ``now - retention_days``. ``queued`` and ``claimed`` runs are
never touched, whatever their age; ``retention_days = 0`` keeps everything.

The queue loop calls :meth:`RunPruner.prune` from its safety pass, so at most
once per ``queue.safety_interval_s``. One call is bounded: rows go in batches
of :data:`BATCH` (oldest first), each batch its own short ``BEGIN IMMEDIATE``
transaction, and no new batch starts once the call has used its time budget
(:data:`BUDGET_S`), so the store lock is never held long and claims are never
blocked for more than one batch. A backlog is worked off over the next passes.
The candidates are found through the partial index ``runs_terminal_ended``
(migration v4), never by a scan of ``runs``.

A run's files go only after the batch that deleted its row has committed (a
rolled-back batch deletes nothing): its log (the ``log_path`` column, and
``<home>/logs/runs/<id>.log``), the agent's input beside it
(``<id>.input.json``), its working folder ``<home>/runs/<id>/`` and its
attempt journal ``<home>/attempts/<id>.<token>/`` (``<id>/`` in the legacy
layout). Only paths inside the home are
removed: a ``log_path`` outside it (or reached through a symbolic link that
leads out of it) is left alone, and a symbolic link is removed as a link,
never followed.

Runs that are kept although they are old enough:

* **Live idempotency keys.** ``run_keys`` maps a key to its run for 24 h
  (:data:`~kandevd.store.runs.IDEMPOTENCY_WINDOW_S`), and a request with that
  key answers with the run itself (``deduplicated: true``), so it needs the
  row. Rather than a second copy of the run for that purpose, a run named by
  a ``run_keys`` row younger than the window is simply not deleted until the
  key expires (looked up through the ``run_keys(run_id)`` index). With
  ``retention_days >= 1`` this rarely matters (a key is given when the run is
  requested), but a fractional retention is allowed.
* **Budgets.** Office budgets add up ``cost_cents`` of the scope's runs
  (:func:`kandevd.office.budgets.spent_cents`), so deleting a costed run would
  lower what an agent or workspace has spent and could lift a hard budget. A
  run with a cost whose agent or workspace has a budget policy is kept while
  it counts: for a ``lifetime`` budget always, for a ``monthly`` one while it
  ended in the current (UTC) month.
* **Live executions.** Runs the queue still has an execution or an
  unwritten outcome for (``live``), e.g. a cancelled run whose agent is being
  stopped.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kandevd.paths import HomeLayout, check_safe_name
from kandevd.store.db import BaseStore
from kandevd.store.runs import IDEMPOTENCY_WINDOW_S
from kandevd.timeutil import after, rfc3339

log = logging.getLogger("kandevd.store.retention")

#: Rows deleted per transaction.
BATCH = 200
#: No new batch starts once a call has run this long (files included).
BUDGET_S = 0.020
_DAY_S = 86400.0

#: The candidates, oldest end first. The ``status IN`` term and the COALESCE
#: expression are exactly those of the partial index ``runs_terminal_ended``, and
#: the index is named: without statistics the planner would rather walk
#: ``runs(status, seq)`` (every terminal run) and sort.
#: Several daemons on one store: each prunes the runs whose files are in its own home
#: (and runs that never executed, which have none), so no home keeps files of runs
#: another daemon deleted.
_HOME_ONLY = ("AND (r.log_path IS NULL"
              " OR substr(r.log_path, 1, length(:home_prefix)) = :home_prefix)")

_CANDIDATES = """/* retention */
SELECT r.seq, r.id, r.log_path FROM runs r INDEXED BY runs_terminal_ended
WHERE r.status IN ('finished', 'failed', 'cancelled')
  AND COALESCE(r.finished_at, r.updated_at) < :cutoff
  AND NOT EXISTS (SELECT 1 FROM run_keys k
                  WHERE k.run_id = r.id AND k.created_at >= :key_cutoff)
  AND NOT (r.cost_cents IS NOT NULL AND EXISTS (
        SELECT 1 FROM office_budget_policies p
        WHERE ((p.scope_type = 'agent' AND p.scope_id = r.agent_id)
               OR (p.scope_type = 'workspace' AND p.scope_id = r.workspace_id))
          AND (p.period != 'monthly'
               OR COALESCE(r.finished_at, r.requested_at) >= :month_start)))
  {home_only}
ORDER BY COALESCE(r.finished_at, r.updated_at)
LIMIT :limit
"""


@dataclass(frozen=True)
class PruneResult:
    deleted: int = 0
    #: a batch came back full: there may be more to delete on the next pass
    more: bool = False


def _month_start(now: datetime) -> datetime:
    moment = now.astimezone(UTC)
    return datetime(moment.year, moment.month, 1, tzinfo=UTC)


def oldest_run_at(store: BaseStore) -> str | None:
    """``requested_at`` of the oldest retained run (the first in request order), or None."""
    row = store.query_one("SELECT requested_at FROM runs ORDER BY seq LIMIT 1")
    return row[0] if row else None


def db_size_bytes(path: str | os.PathLike[str]) -> int:
    """Size of the database file plus its write-ahead log (absent files count 0)."""
    total = 0
    for name in (os.fspath(path), os.fspath(path) + "-wal"):
        try:
            total += os.stat(name).st_size
        except OSError:
            pass
    return total


def db_status(store: BaseStore, retention_days: float) -> dict[str, Any]:
    """``daemon.status``'s ``store.db``: ``{size_bytes, oldest_run_at, retention_days}``."""
    return {"size_bytes": store.size_bytes(), "oldest_run_at": oldest_run_at(store),
            "retention_days": retention_days}


class RunPruner:
    """Deletes old terminal runs and their files, a bounded amount per call."""

    def __init__(self, store: BaseStore, layout: HomeLayout, retention_days: float, *,
                 batch: int = BATCH, budget_s: float = BUDGET_S,
                 clock: Callable[[], float] = time.monotonic, home_only: bool = False) -> None:
        self.store = store
        self._candidates = _CANDIDATES.format(home_only=_HOME_ONLY if home_only else "")
        self.layout = layout
        self.retention_days = float(retention_days)
        self.batch = max(1, int(batch))
        self.budget_s = float(budget_s)
        self.clock = clock
        self.deleted_total = 0

    @property
    def enabled(self) -> bool:
        return self.retention_days > 0

    def cutoff(self, now: datetime) -> datetime:
        """Terminal runs that ended before this are pruned."""
        return after(now, -self.retention_days * _DAY_S)

    def prune(self, now: datetime, live: Collection[str] = ()) -> PruneResult:
        """One bounded pass: delete what is due, batch by batch, within the time budget.

        Logs one INFO line when it deleted something, nothing otherwise.
        """
        if not self.enabled:
            return PruneResult()
        started = self.clock()
        params = {"cutoff": rfc3339(self.cutoff(now)),
                  "key_cutoff": rfc3339(after(now, -IDEMPOTENCY_WINDOW_S)),
                  "month_start": rfc3339(_month_start(now)),
                  "limit": self.batch + len(live)}
        if "home_prefix" in self._candidates:
            params["home_prefix"] = str(self.layout.root).rstrip(os.sep) + os.sep
        live_ids = frozenset(live)
        # Most passes find nothing: look without the write lock first.
        if self.store.query_one(self._candidates, {**params, "limit": 1}) is None:
            return PruneResult()
        deleted = 0
        more = False
        while True:
            rows = self._delete_batch(params, live_ids)
            deleted += len(rows)
            self._remove_files(rows)
            more = len(rows) >= self.batch
            if not more or self.clock() - started >= self.budget_s:
                break
        if deleted:
            self.deleted_total += deleted
            log.info("retention: deleted %d terminal runs older than %g days (oldest kept: %s)",
                     deleted, self.retention_days, oldest_run_at(self.store) or "none")
        return PruneResult(deleted, more)

    def _delete_batch(self, params: dict[str, Any], live: frozenset[str]
                      ) -> list[tuple[str, str | None]]:
        """Delete up to one batch in one transaction; ``[(id, log_path)]`` of what went."""
        with self.store.transaction() as conn:
            rows = [r for r in conn.execute(self._candidates, params).fetchall()
                    if r["id"] not in live][:self.batch]
            if not rows:
                return []
            seqs = [r["seq"] for r in rows]
            conn.execute(f"DELETE FROM runs WHERE seq IN ({', '.join('?' * len(seqs))})", seqs)
        return [(r["id"], r["log_path"]) for r in rows]

    # -- files --------------------------------------------------------------------
    def _remove_files(self, rows: list[tuple[str, str | None]]) -> None:
        if not rows:
            return
        roots = self._real_roots()
        for run_id, log_path in rows:
            files: list[Path] = []
            folders: list[Path] = []
            if log_path:
                path = Path(log_path)
                files += [path, path.with_name(path.stem + ".input.json")]
            try:
                check_safe_name(run_id, "run id")
            except ValueError:
                pass  # not a name that can be a file of its own: only its log_path
            else:
                files += [self.layout.run_logs / f"{run_id}.log",
                          self.layout.run_logs / f"{run_id}.input.json"]
                folders += [self.layout.runs / run_id, self.layout.attempts / run_id]
                folders += self.layout.attempts.glob(f"{run_id}.*")  # one folder per attempt
            for path in dict.fromkeys(files):
                if self._inside(path, roots):
                    _unlink(path)
            for path in folders:
                if self._inside(path, roots):
                    _remove_tree(path)

    def _real_roots(self) -> tuple[str, ...]:
        """The home and its run folders as the file system resolves them (they may be links)."""
        layout = self.layout
        return tuple(dict.fromkeys(os.path.realpath(p) for p in (
            layout.root, layout.run_logs, layout.runs, layout.attempts)))

    def _inside(self, path: Path, roots: tuple[str, ...]) -> bool:
        """``path`` names an entry inside the home, and its folder is really there too."""
        if not path.is_absolute():
            return False
        normal = Path(os.path.normpath(path))
        root = self.layout.root
        if normal == root or not normal.is_relative_to(root):
            return False
        parent = os.path.realpath(normal.parent)
        return any(parent == r or parent.startswith(r.rstrip(os.sep) + os.sep) for r in roots)


def _unlink(path: Path) -> None:
    try:
        if path.is_dir() and not path.is_symlink():
            return  # a file name that is a folder: not ours to remove
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("retention: cannot remove %s (%s)", path, exc)


def _remove_tree(path: Path) -> None:
    try:
        if path.is_symlink() or not path.is_dir():
            path.unlink()  # a link is removed as a link, never followed
            return
    except FileNotFoundError:
        return
    except OSError as exc:
        log.warning("retention: cannot remove %s (%s)", path, exc)
        return
    shutil.rmtree(path, ignore_errors=True)

