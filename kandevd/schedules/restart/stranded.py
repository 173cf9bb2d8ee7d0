"""What a crashed daemon's scheduled turns left, settled once at start.

A turn runs under the shim like every agent execution, with an execution
record in ``<home>/turns/<key>/`` (its shim's pid, its exit status, its
stdout) until the turn's outcome is on its history entry. When the daemon dies
first (or stops leaving its agents running, or stops while a full disk keeps
the entry's writes in memory), the next start marks the session ``error:
interrupted: server restarted`` (stale until shown otherwise), adopts the
turns still running (:mod:`kandevd.schedules.restart.adopted`, which takes their
entries off the list here) and stops the agents it does not adopt. Then, on
the cron loop's first tick (after those agents were stopped, so their shims
have written their exit status), each turn of the other entries is settled
here: its real outcome (the exit code, the agent's summary line as
``output``, its cost and evaluation) is recorded on the entry (turns the file
never had are brought back from their records), its stdout is appended to its
log, and its record is removed once that is written. A run whose turns all
have a recorded end then ends with their outcome (``success`` included), told
to the job as any run's end; only one whose turn has none stays interrupted.
(Versions before the record folder kept those files beside the log,
``NN-<kind>.log.exit-<token>`` and ``.stdout-<token>``; they are settled too.)
"""

from __future__ import annotations

import glob
import json
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from kandevd.runtime import shim
from kandevd.runtime.attempts import SPENT_SUFFIX
from kandevd.runtime.output import collect_stdout
from kandevd.runtime.records import collect_output, outcome_from_record, read_record
from kandevd.schedules import history as hist
from kandevd.schedules.history import HistoryEntry, TurnRecord
from kandevd.schedules.sessions.session import remove_turn_record, turn_key
from kandevd.timeutil import rfc3339

log = logging.getLogger("kandevd.scheduler")


@dataclass(frozen=True)
class Stranded:
    """An entry repaired at start: where it is, and the job it is a run of."""

    history: hist.History
    entry_id: str
    job_key: str | None


class StrandedTurns:
    """The entries repaired at start whose turns may have left files (the registry's)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: list[Stranded] = []

    def add(self, entries: list[Stranded]) -> None:
        with self._lock:
            self._entries += entries

    def mark(self, history: hist.History, now: datetime,
             job_key: Callable[[HistoryEntry], str | None]) -> list[Any]:
        """The history's entries once the runs a dead daemon left ``running`` are
        ``error`` (logged), their turns noted here to be adopted or settled
        (``job_key(entry)``: the key of the job the entry is a run of)."""
        entries, repaired = history.repair_after_restart(now)
        if repaired:
            log.warning("%s: %d run(s) left running by a previous daemon marked 'error' "
                        "(%s)", history.file.path, len(repaired), hist.RESTART_ERROR)
            by_id = {e.get("id"): e for e in entries if isinstance(e, dict)}
            self.add([Stranded(history, entry_id, job_key(by_id.get(entry_id, {})))
                      for entry_id in repaired])
        return entries

    def pending(self) -> list[Stranded]:
        """The entries not settled yet (adoption looks at them first)."""
        with self._lock:
            return list(self._entries)

    def discard(self, entry_id: str) -> None:
        """An entry whose turn was adopted: its end is recorded by the adopter."""
        with self._lock:
            self._entries = [e for e in self._entries if e.entry_id != entry_id]

    def settle(self, turns_folder: Path | None = None, *,
               live: Callable[[str], bool] = lambda key: False,
               ended: Callable[[Stranded, HistoryEntry], None] | None = None,
               release: Release | None = None) -> int:
        """Settle every entry added so far, then every other record left in
        ``turns_folder`` (but the ``live`` ones: adopted); how many turns had files left.
        ``ended(item, entry)``: an entry that ends with its turns' real outcome.
        ``release(names)``: the keeper may forget the exits of these turns (recorded)."""
        with self._lock:
            entries, self._entries = self._entries, []
        settled = 0
        for item in entries:
            history, entry_id = item.history, item.entry_id
            try:
                count, final = settle_entry(history, entry_id, turns_folder, release)
            except OSError as exc:  # a log that cannot be written: said, not fatal
                log.warning("%s: the turns of run %s left by the previous daemon could not "
                            "be settled: %s", history.file.path, entry_id, exc)
                continue
            settled += count
            if final is None:
                continue
            log.info("%s: run %s left running by the previous daemon ended %s (its turns' "
                     "records tell)", item.job_key, entry_id, final["status"])
            if ended is not None and item.job_key is not None:
                try:
                    ended(item, final)
                except Exception:  # one job's bookkeeping must not stop the others
                    log.exception("%s: the end of run %s could not be told", item.job_key,
                                  entry_id)
        if turns_folder is not None:
            # (the records of those entries are theirs: gone once their outcome is written)
            prefixes = tuple(f"turn-{item.entry_id}-" for item in entries)
            settled += sweep_records(turns_folder,
                                     lambda name: live(name) or name.startswith(prefixes),
                                     release)
        if settled:
            log.info("settled %d scheduled turn(s) a previous daemon left running: their "
                     "outcome and output are on their runs", settled)
        return settled

    def keep_this_homes(self, turns_folder: Path) -> None:
        """Several daemons: of the runs marked at start, keep those whose turns left a
        record in this home (``turns_folder``): this home's earlier instance ran them,
        so their end is this home's to record. The others may be another daemon's runs,
        which that daemon's next write puts right."""
        try:
            names = [n for n in os.listdir(turns_folder) if n.startswith("turn-")]
        except OSError:
            names = []
        with self._lock:
            self._entries = [item for item in self._entries
                             if any(n.startswith(f"turn-{item.entry_id}-") for n in names)]


#: ``release(names)``: the keeper may forget the exits of these turns (their outcome is
#: recorded); see :meth:`kandevd.runtime.pool.AgentRuntime.settle_ids`.
Release = Callable[[list[str]], None]

def settle_entry(history: hist.History, entry_id: str, turns_folder: Path | None = None,
                 release: Release | None = None) -> tuple[int, HistoryEntry | None]:
    """Record the real outcome of ``entry_id``'s turns that left files: how many, and the
    entry when that outcome ends it (None: it stays as the start marked it). Their
    records go once that is written (a full disk keeps them for the next start)."""
    entry = history.entry(entry_id)
    if entry is None or not isinstance(entry.get("turns"), list):
        return 0, None
    turns = [dict(t) if isinstance(t, dict) else t for t in entry["turns"]]
    done: list[Path] = []
    settled = 0
    for index, turn in enumerate(turns):
        if not isinstance(turn, dict):
            continue
        position = turn.get("index", index)
        record_dir = turns_folder / turn_key(entry_id, position) \
            if turns_folder is not None and isinstance(position, int) else None
        if _settle_turn(turn, record_dir):
            settled += 1
            if record_dir is not None and record_dir.is_dir():
                done.append(record_dir)
    if turns_folder is not None:  # turns whose start never reached the file (a full disk)
        found = _unlisted_turns(entry_id, len(turns), turns_folder)
        turns += [turn for turn, _ in found]
        done += [folder for _, folder in found]
        settled += len(found)
    changed = {**entry, "turns": turns,
               "cost_cents": sum(t.get("cost_cents") or 0 for t in turns
                                 if isinstance(t, dict))}
    outcome = hist.outcome_after_restart(changed)
    final = None
    if entry.get("error") == hist.RESTART_ERROR and outcome is not None \
            and outcome != (hist.ERROR, hist.RESTART_ERROR):
        changed["status"], changed["error"] = outcome  # not stale: its turns ended
        final = changed
    if settled:
        history.update_entry(entry_id, changed,
                             after=lambda: [remove_turn_record(d, release) for d in done])
    return settled, final


def _unlisted_turns(entry_id: str, start: int, turns_folder: Path
                    ) -> list[tuple[TurnRecord, Path]]:
    """Turns from ``start`` on that left a record but never reached the entry (their
    start, or the entry's every write since, failed and was lost with the daemon): each
    as the entry would have had it, from its record and its input file."""
    found = []
    for index in range(start, start + 1000):
        folder = turns_folder / turn_key(entry_id, index)
        record = read_record(folder) if folder.is_dir() else None
        if record is None or record.run_id != entry_id:
            break
        try:
            stdin = json.loads(record.input_path.read_text("utf-8"))
        except (OSError, ValueError):
            stdin = {}
        stdin = stdin if isinstance(stdin, dict) else {}
        about = stdin.get("turn") if isinstance(stdin.get("turn"), dict) else {}
        turn: TurnRecord = {
            "index": index, "kind": about.get("kind"), "message": stdin.get("message"),
            "workshop_mode": stdin.get("workshop_mode"), "status": hist.ERROR,
            "started_at": rfc3339(record.started_at), "duration_ms": None,
            "log_path": str(record.log_path), "cost_cents": 0, "error": hist.RESTART_ERROR}
        _settle_record(turn, folder, record.log_path)
        found.append((turn, folder))
    return found


def sweep_records(turns_folder: Path, live: Callable[[str], bool],
                  release: Release | None = None) -> int:
    """Records no entry led to (its run not loaded, its file gone, another daemon's
    entry): the agent's output is merged into the log its record names, the record
    removed. Nothing is left in ``<home>/turns/`` but the live turns' records."""
    try:
        names = sorted(p.name for p in turns_folder.iterdir())
    except OSError:
        return 0
    swept = 0
    for name in names:
        folder = turns_folder / name
        if live(name) or not folder.is_dir() or not name.startswith("turn-"):
            if name.endswith(SPENT_SUFFIX) and not live(name[:-len(SPENT_SUFFIX)]):
                folder.unlink(missing_ok=True)
            continue
        record = read_record(folder)
        if record is not None:
            try:
                collect_output(record)
            except OSError as exc:
                log.warning("%s: the output of a turn left by a previous daemon could not "
                            "be merged into %s: %s", folder, record.log_path, exc)
        log.warning("%s: a turn's record no history entry claims was removed", folder)
        remove_turn_record(folder, release)
        swept += 1
    return swept


def _settle_turn(turn: TurnRecord, record_dir: Path | None) -> bool:
    log_path = turn.get("log_path")
    if not isinstance(log_path, str) or not log_path:
        return False
    path = Path(log_path)
    if record_dir is not None and record_dir.is_dir():
        _settle_record(turn, record_dir, path)
        return True
    return _settle_beside_log(turn, path)


def _settle_record(turn: TurnRecord, record_dir: Path, log_path: Path) -> None:
    """A turn's record folder: its exit status and output recorded (the caller removes
    the folder once that is written)."""
    record = read_record(record_dir)
    result = outcome_from_record(record, record_dir, log_path) if record is not None else None
    if result is None and record is not None:  # no exit status: its output is kept anyway
        report = collect_output(record, record_dir, log_path)
        _report(turn, report.summary, report.cost_cents, report.evaluation)
    if result is not None:
        turn["exit_code"] = result.exit_code
        if turn.get("duration_ms") is None:
            turn["duration_ms"] = int(result.duration_s * 1000)
        if result.succeeded:
            turn["status"], turn["error"] = hist.SUCCESS, None
        else:
            turn["status"] = hist.ERROR
            turn["error"] = f"exit code {result.exit_code} (the daemon had restarted)"
        _report(turn, result.summary, result.cost_cents, result.evaluation)


def _report(turn: TurnRecord, summary: Any, cost: int | None, evaluation: Any) -> None:
    if summary is not None:
        turn["output"] = summary
    if cost is not None:
        turn["cost_cents"] = cost
    if evaluation is not None:
        turn["evaluation"] = evaluation


def _settle_beside_log(turn: TurnRecord, path: Path) -> bool:
    pattern = glob.escape(path.name)
    exits = sorted(path.parent.glob(f"{pattern}.exit-*"))
    stdouts = sorted(path.parent.glob(f"{pattern}.stdout-*"))
    if not exits and not stdouts:
        return False
    code = next((c for c in (shim.read_exit_file(p) for p in reversed(exits))
                 if c is not None), None)
    report = None
    for stdout in stdouts:  # (one per token; the last one is the turn's report)
        report = collect_stdout(stdout, path)
    for leftover in exits:
        leftover.unlink(missing_ok=True)
    if code is not None:
        turn["exit_code"] = code
        if code == 0:
            turn["status"], turn["error"] = hist.SUCCESS, None
        else:
            turn["status"] = hist.ERROR
            turn["error"] = f"exit code {code} (the daemon had restarted)"
    if report is not None:
        _report(turn, report.summary, report.cost_cents, report.evaluation)
    return True
