"""What a crashed daemon's scheduled turns left beside their logs, settled once at start.

A turn runs under the shim like every agent execution; its exit status and its
stdout go to files beside the turn's log (``NN-<kind>.log.exit-<token>``,
``.stdout-<token>``) until the turn's end is handled. When the daemon dies
first, the next start marks the session ``error: interrupted: server
restarted`` (as the specification says) and stops the agents it does not
adopt. Then, on the cron loop's first tick (after those agents were stopped,
so their shims have written their exit status), each turn of those entries is
settled here: its real outcome (the exit code, the agent's summary line as
``output``, its cost and evaluation) is recorded on the entry, its stdout is
appended to its log, and both files are removed: nothing is left beside the
logs.
"""

from __future__ import annotations

import glob
import logging
import threading
from datetime import datetime
from pathlib import Path
from typing import Any

from kandevd.runtime import shim
from kandevd.runtime.output import collect_stdout
from kandevd.schedules import history as hist

log = logging.getLogger("kandevd.scheduler")


class StrandedTurns:
    """The entries repaired at start whose turns may have left files (process-wide)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: list[tuple[hist.History, str]] = []

    def add(self, history: hist.History, entry_ids: list[str]) -> None:
        with self._lock:
            self._entries += [(history, entry_id) for entry_id in entry_ids]

    def settle(self) -> int:
        """Settle every entry added so far; how many turns had files left."""
        with self._lock:
            entries, self._entries = self._entries, []
        settled = 0
        for history, entry_id in entries:
            try:
                settled += settle_entry(history, entry_id)
            except OSError as exc:  # a log that cannot be written: said, not fatal
                log.warning("%s: the turns of run %s left by the previous daemon could not "
                            "be settled: %s", history.file.path, entry_id, exc)
        if settled:
            log.info("settled %d scheduled turn(s) a previous daemon left running: their "
                     "outcome and output are on their runs", settled)
        return settled


#: Filled when histories are repaired at start; settled by the cron loop's first tick.
STRANDED = StrandedTurns()


def repair_at_start(history: hist.History, now: datetime) -> list[Any]:
    """The history's entries once the runs a dead daemon left ``running`` are ``error``
    (logged), their turns noted to be settled on the first tick."""
    entries, repaired = history.repair_after_restart(now)
    if repaired:
        log.warning("%s: %d run(s) left running by a previous daemon marked 'error' (%s)",
                    history.file.path, len(repaired), hist.RESTART_ERROR)
        STRANDED.add(history, repaired)
    return entries


def settle_entry(history: hist.History, entry_id: str) -> int:
    """Record the real outcome of ``entry_id``'s turns that left files; how many."""
    entry = next((e for e in history.entries()
                  if isinstance(e, dict) and e.get("id") == entry_id), None)
    if entry is None or not isinstance(entry.get("turns"), list):
        return 0
    turns = [dict(t) if isinstance(t, dict) else t for t in entry["turns"]]
    settled = sum(_settle_turn(turn) for turn in turns if isinstance(turn, dict))
    if settled:
        cost = sum(t.get("cost_cents") or 0 for t in turns if isinstance(t, dict))
        history.update_entry(entry_id, {**entry, "turns": turns, "cost_cents": cost})
    return settled


def _settle_turn(turn: dict[str, Any]) -> bool:
    log_path = turn.get("log_path")
    if not isinstance(log_path, str) or not log_path:
        return False
    path = Path(log_path)
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
        if report.summary is not None:
            turn["output"] = report.summary
        if report.cost_cents is not None:
            turn["cost_cents"] = report.cost_cents
        if report.evaluation is not None:
            turn["evaluation"] = report.evaluation
    return True
