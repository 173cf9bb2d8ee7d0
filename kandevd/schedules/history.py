"""Run history: ``Workflow/<name>/schedule-runs.json``, newest first.

One entry per scheduled session (a cron fire or a manual trigger)::

    {id, schedule_id, run_folder, session_id, status, error, duration_ms, group_ids,
     started_at, completed_at, trigger_source: "cron"|"manual",
     turns: [{index, kind, message, workshop_mode, status, started_at, duration_ms,
              log_path, cost_cents, error, exit_code?, output?, evaluation?,
              adopted_at?}],
     cost_cents, first_message?}

A turn's ``output`` and ``evaluation`` are what its agent reported (its summary
line), so a run can be judged without its logs; a product run that resumed
after a failed one says where with ``first_message``.

``status`` is ``running`` while the session runs, then ``success``, ``error`` or
``stopped``. Entries are written through :class:`kandevd.formats.jsonfile.JsonFile`
(atomic, locked), so another process appending at the same time loses nothing.
Terminal entries older than the retention are pruned whenever a new run is
recorded; ``running`` entries and entries without a readable date are kept.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, TypedDict

from kandevd.formats.jsonfile import CorruptReporter, JsonFile
from kandevd.timeutil import parse_rfc3339, rfc3339

log = logging.getLogger("kandevd.scheduler.history")

HISTORY = "schedule-runs.json"
RUNNING, SUCCESS, ERROR, STOPPED = "running", "success", "error", "stopped"
TERMINAL = frozenset({SUCCESS, ERROR, STOPPED})
RESTART_ERROR = "interrupted: server restarted"
SHUTDOWN_ERROR = "interrupted: server shutting down"


class TurnRecord(TypedDict, total=False):
    """One turn of a history entry, as ``schedule-runs.json`` holds it."""

    index: int
    kind: str
    message: str
    workshop_mode: str | None
    status: str
    started_at: str
    duration_ms: int | None
    log_path: str | None
    cost_cents: float
    error: str | None
    exit_code: int
    output: str | None
    evaluation: Any
    adopted_at: str


class HistoryEntry(TypedDict, total=False):
    """One session's entry in ``schedule-runs.json`` (the module's docstring)."""

    id: str
    schedule_id: str
    product: str
    user_id: str
    run_folder: str | None
    session_id: str
    status: str
    error: str | None
    duration_ms: int | None
    group_ids: list[str]
    started_at: str
    completed_at: str | None
    trigger_source: str
    intended_at: str
    late_s: float
    fire_times: list[str]
    notified: dict[str, Any]
    turns: list[TurnRecord]
    cost_cents: float
    first_message: int | None


def entry_time(entry: Any) -> datetime | None:
    """When an entry ended (else started); None when it carries no readable date."""
    if not isinstance(entry, dict):
        return None
    for key in ("completed_at", "started_at"):
        value = entry.get(key)
        if isinstance(value, str):
            try:
                return parse_rfc3339(value)
            except ValueError:
                continue
    return None


def prune(entries: list[Any], now: datetime, retention_days: float) -> list[Any]:
    """Drop terminal entries older than ``retention_days`` (0: keep every one, as
    ``queue.retention_days`` does); keep running and undated ones."""
    if not retention_days:
        return list(entries)
    cutoff = now - timedelta(days=retention_days)
    cutoff_text = rfc3339(cutoff)
    kept = []
    for entry in entries:
        if not isinstance(entry, dict) or entry.get("status") not in TERMINAL:
            kept.append(entry)
            continue
        stamp = entry.get("completed_at") or entry.get("started_at")
        if isinstance(stamp, str) and len(stamp) == _STAMP_LEN and stamp.endswith("Z"):
            old = stamp < cutoff_text  # kandevd's own fixed-width stamps sort as text
        else:
            moment = entry_time(entry)
            old = moment is not None and moment < cutoff
        if not old:
            kept.append(entry)
    return kept


_STAMP_LEN = len("2026-12-02T13:00:00.123456Z")


class HistoryPage(TypedDict):
    """A page of a history, newest first (``scheduler.jobs.runs``)."""

    items: list[HistoryEntry]
    total: int
    limit: int
    offset: int


def page(entries: list[Any], *, schedule_id: str | None, limit: int, offset: int
         ) -> HistoryPage:
    """One page of the entries of ``schedule_id`` (all when None), newest first."""
    chosen = [e for e in entries if isinstance(e, dict)
              and (schedule_id is None or e.get("schedule_id") == schedule_id)]
    return {"items": chosen[offset:offset + limit], "total": len(chosen), "limit": limit,
            "offset": offset}


def interrupt(entries: list[Any], now: datetime, error: str) -> int:
    """Turn every ``running`` entry into ``error`` with ``error``; how many.

    The list is changed in place, its entries are replaced (never mutated)."""
    fixed = 0
    for index, entry in enumerate(entries):
        if isinstance(entry, dict) and entry.get("status") != RUNNING and _running_turn(entry):
            # Interrupted already, its turn adopted by a daemon that died in turn.
            entries[index] = {**entry, "turns": [
                {**turn, "status": ERROR, "error": error}
                if isinstance(turn, dict) and turn.get("status") == RUNNING else turn
                for turn in entry["turns"]]}
            fixed += 1
        elif isinstance(entry, dict) and entry.get("status") == RUNNING:
            changed = {**entry, "status": ERROR, "error": error, "completed_at": rfc3339(now)}
            if isinstance(entry.get("turns"), list):
                changed["turns"] = [
                    {**turn, "status": ERROR, "error": error}
                    if isinstance(turn, dict) and turn.get("status") == RUNNING else turn
                    for turn in entry["turns"]]
            started = entry_time({"started_at": entry.get("started_at")})
            if started is not None and entry.get("duration_ms") is None:
                changed["duration_ms"] = max(0, int((now - started).total_seconds() * 1000))
            entries[index] = changed  # replaced, never mutated: see JsonFile(cache=True)
            fixed += 1
    return fixed


def _running_turn(entry: HistoryEntry) -> bool:
    turns = entry.get("turns")
    return isinstance(turns, list) and any(
        isinstance(t, dict) and t.get("status") == RUNNING for t in turns)


def outcome_after_restart(entry: HistoryEntry) -> tuple[str, str | None] | None:
    """How a run a previous daemon left ends, judged from its turns as a session judges
    them as they end (a pulse's outcome never counts): ``(status, error)``. A turn with
    no recorded end (none found, its record lost: it reads ``error: interrupted: server
    restarted``) leaves the run interrupted; None while a turn still runs."""
    turns = [t for t in entry.get("turns") or [] if isinstance(t, dict)]
    if not turns:
        return ERROR, RESTART_ERROR
    for position, turn in enumerate(turns):
        if turn.get("kind") == "pulse":
            continue
        status, error = turn.get("status"), turn.get("error")
        if status == RUNNING:
            return None
        if status == SUCCESS:
            continue
        if status == ERROR and error == RESTART_ERROR:
            return ERROR, RESTART_ERROR
        if status == STOPPED:
            return STOPPED, error
        index = turn.get("index")
        number = (index if isinstance(index, int) else position) + 1  # (as a live session says)
        return ERROR, f"{turn.get('kind')} turn {number} failed: {error}"
    return SUCCESS, None


def left_running(entry: Any) -> bool:
    """An entry a dead daemon left running: itself, or a turn of it it had adopted."""
    return isinstance(entry, dict) and (entry.get("status") == RUNNING or _running_turn(entry))


class PendingWrites:
    """History writes that failed (a full disk, a read-only remount): kept in memory
    and written again until they land, as run outcomes are, so a session's record is
    never lost to a passing lack of space. One per workflow root (its registry's),
    shared by every :class:`History` of it, keyed by the file and the entry; the
    newest fields of an entry win."""

    def __init__(self, wake: Callable[[], None] | None = None) -> None:
        """``wake()`` when a write is kept (the cron loop's, so it retries soon)."""
        self._lock = threading.Lock()
        self._pending: dict[tuple[Path, str], tuple[History, HistoryEntry]] = {}
        #: What waits for a kept write to land (a turn's record, removed only once its
        #: outcome is on the entry), by the same key.
        self._after: dict[tuple[Path, str], list[Callable[[], None]]] = {}
        #: One lock per file, held across a write and its bookkeeping, so a retried
        #: (older) write never lands after a newer one of the same entry.
        self._files: dict[Path, threading.Lock] = {}
        self.wake = wake

    def file_lock(self, path: Path) -> threading.Lock:
        with self._lock:
            return self._files.setdefault(path, threading.Lock())

    def __len__(self) -> int:
        with self._lock:
            return len(self._pending)

    def keep(self, history: History, entry_id: str, fields: HistoryEntry,
             error: OSError, after: Callable[[], None] | None = None) -> None:
        with self._lock:
            first = not self._pending
            self._pending[(history.file.path, entry_id)] = (history, fields)
            if after is not None:
                self._after.setdefault((history.file.path, entry_id), []).append(after)
        if first:
            log.warning("%s: history write failed (%s); kept in memory and written again "
                        "until it lands", history.file.path, error.strerror or error)
        if self.wake is not None:
            self.wake()

    def forget(self, history: History, entry_id: str) -> list[Callable[[], None]]:
        """A newer write of the entry landed: nothing of it waits any more; what waited
        for the kept one (to be called: that write carried its content too)."""
        with self._lock:
            self._pending.pop((history.file.path, entry_id), None)
            return self._after.pop((history.file.path, entry_id), [])

    def flush(self) -> int:
        """Write what is pending; how many writes are still pending."""
        with self._lock:
            items = list(self._pending.items())
        written = 0
        for key, (history, _fields) in items:
            with self.file_lock(key[0]):
                with self._lock:  # the newest fields, now that no write of it runs
                    current = self._pending.get(key)
                if current is None:
                    continue  # written meanwhile by the session itself
                try:
                    history.write_entry(key[1], current[1])
                except OSError:
                    continue
                with self._lock:
                    self._pending.pop(key, None)
                    after = self._after.pop(key, [])
            _call(after)
            written += 1
        left = len(self)
        if written:
            log.info("%d history write(s) that had failed are written now; %d still wait",
                     written, left)
        return left


def _call(callbacks: list[Callable[[], None]]) -> None:
    for callback in callbacks:
        try:
            callback()
        except Exception:  # (removing a record: never worth stopping the writes for)
            log.exception("an action after a history write failed")


class History:
    """The history file of one workflow."""

    def __init__(self, folder: Path, *, retention_days: float, backlog: PendingWrites,
                 on_corrupt: CorruptReporter | None = None, cap: int | None = None) -> None:
        """``backlog``: where a failed write waits (the root's); ``cap``: keep at most that
        many entries (the newest), as product histories do."""
        self.backlog = backlog
        self.file = JsonFile(folder / HISTORY, on_corrupt=on_corrupt, indent=None, cache=True)
        self.retention_days = retention_days
        self.cap = cap

    def entries(self) -> list[Any]:
        """Every entry; OSError (JsonFileUnreadable) when the file is there but cannot
        be read now (it is left alone)."""
        if not self.file.path.exists():  # the common case at start: no lock file made
            return []
        return self.file.read([], expect=list)

    def entries_to_seed(self) -> list[Any]:
        """The entries a job's counts start from; none (said once per read) when the
        file cannot be read now: the job runs on, its counts from nothing, and the file
        is left as it is (a write that follows fails the same way and says so)."""
        try:
            return self.entries()
        except OSError as exc:
            log.warning("%s; the jobs it records start their counts from nothing", exc)
            return []

    def _update(self, mutate: Callable[[list[Any]], Any]) -> list[Any]:
        def apply(entries: list[Any]) -> list[Any]:
            mutate(entries)
            return entries
        return self.file.update(apply, [], expect=list)

    def record_start(self, entry: HistoryEntry, now: datetime) -> None:
        """Add a new (running) entry at the top, pruning what the retention drops."""
        def add(entries: list[Any]) -> None:
            entries[:] = [entry, *prune(entries, now, self.retention_days)]
            if self.cap is not None:
                del entries[self.cap:]
        self._update(add)

    def update_entry(self, entry_id: str, fields: HistoryEntry,
                     after: Callable[[], None] | None = None) -> bool:
        """Merge ``fields`` into the entry ``entry_id``; a write that fails is kept in
        the backlog and written later (never raised: the session goes on). True when
        it landed now. ``after()`` is called once it has landed, now or later (never, if
        the process ends first: what it would undo then stays for the next start)."""
        with self.backlog.file_lock(self.file.path):
            try:
                self.write_entry(entry_id, fields)
            except OSError as exc:
                self.backlog.keep(self, entry_id, fields, exc, after)
                return False
            waited = self.backlog.forget(self, entry_id)
        _call([*waited, *([after] if after is not None else [])])
        return True

    def write_entry(self, entry_id: str, fields: HistoryEntry) -> None:
        """Merge ``fields`` into the entry ``entry_id``; re-add it if someone removed it."""
        def merge(entries: list[Any]) -> None:
            for index, entry in enumerate(entries):
                if isinstance(entry, dict) and entry.get("id") == entry_id:
                    entries[index] = {**entry, **fields}  # replaced, never mutated in place
                    return
            entries.insert(0, {"id": entry_id, **fields})
        self._update(merge)

    def entry(self, entry_id: str) -> HistoryEntry | None:
        """The entry with id ``entry_id`` (None: not in the file)."""
        return next((e for e in self.entries()
                     if isinstance(e, dict) and e.get("id") == entry_id), None)

    def repair_after_restart(self, now: datetime) -> tuple[list[Any], list[str]]:
        """At start: entries a dead daemon left ``running`` become ``error``.

        Returns the entries (after the repair) and the ids of those repaired; the
        file is read once and written only when something was left running.
        """
        entries = self.entries_to_seed()
        if not any(left_running(e) for e in entries):
            return entries, []
        repaired: list[str] = []

        def fix(current: list[Any]) -> None:
            repaired[:] = [str(e.get("id")) for e in current if left_running(e)]
            interrupt(current, now, RESTART_ERROR)
        try:
            return self._update(fix), repaired
        except OSError as exc:  # (the entries stay running until a start can write them)
            log.warning("%s; the sessions it shows running are not marked interrupted", exc)
            return entries, []


def latest_by_schedule(entries: Iterable[Any]) -> dict[str, list[HistoryEntry]]:
    """Entries grouped by schedule id, newest first (the file's order)."""
    grouped: dict[str, list[dict[str, Any]]] = {}
    for entry in entries:
        if isinstance(entry, dict) and isinstance(entry.get("schedule_id"), str):
            grouped.setdefault(entry["schedule_id"], []).append(entry)
    return grouped
