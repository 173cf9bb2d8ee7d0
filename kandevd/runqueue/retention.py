"""Retention: terminal runs older than ``queue.retention_days`` are pruned with their files.

The queue loop calls :meth:`RunPruner.prune` from its safety pass. One call is
bounded: rows go in batches of :data:`BATCH` (oldest first), each batch its
own short transaction, and no new batch starts once the call has used its
time budget (:data:`BUDGET_S`), so claims are never blocked for more than one
batch; a backlog is worked off over the next passes. Which runs have expired
(and which are kept although old enough) is the store's
(:mod:`kandevd.store.runs.retention`).

A run's files go only after the batch that deleted its row has committed:
its log and the agent's input beside it, its working folder and its attempt
folders. Only paths inside the home are removed; a symbolic link is removed
as a link, never followed.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from kandevd.paths import HomeLayout, check_safe_name
from kandevd.runtime import attempts
from kandevd.runtime.execution import input_path_of
from kandevd.store.runs.retention import ExpiredRuns, oldest_run_at
from kandevd.timeutil import after

log = logging.getLogger("kandevd.store.retention")  # (its name in every log since)

#: Rows deleted per transaction.
BATCH = 200
#: No new batch starts once a call has run this long (files included).
BUDGET_S = 0.020
_DAY_S = 86400.0


@dataclass(frozen=True)
class PruneResult:
    deleted: int = 0
    #: a batch came back full: there may be more to delete on the next pass
    more: bool = False


class RunPruner:
    """Deletes old terminal runs and their files, a bounded amount per call."""

    def __init__(self, expired: ExpiredRuns, layout: HomeLayout, retention_days: float, *,
                 batch: int = BATCH, budget_s: float = BUDGET_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.expired = expired
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
        params = self.expired.params(self.cutoff(now), now, self.batch + len(live))
        live_ids = frozenset(live)
        # Most passes find nothing: look without the write lock first.
        if not self.expired.any(params):
            return PruneResult()
        deleted = 0
        more = False
        while True:
            rows = self.expired.delete_batch(params, live_ids, self.batch)
            deleted += len(rows)
            self._remove_files(rows)
            more = len(rows) >= self.batch
            if not more or self.clock() - started >= self.budget_s:
                break
        if deleted:
            self.deleted_total += deleted
            log.info("retention: deleted %d terminal runs older than %g days (oldest kept: %s)",
                     deleted, self.retention_days, oldest_run_at(self.expired.store) or "none")
        return PruneResult(deleted, more)

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
                files += [path, input_path_of(path)]
            try:
                check_safe_name(run_id, "run id")
            except ValueError:
                pass  # not a name that can be a file of its own: only its log_path
            else:
                logged = self.layout.run_logs / f"{run_id}.log"
                files += [logged, input_path_of(logged)]
                folders.append(self.layout.runs / run_id)
                folders += attempts.of_run(self.layout.attempts, run_id)
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

