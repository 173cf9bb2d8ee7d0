"""``kandevd jobs logs JOB [ENTRY_ID] [--follow]``: a scheduled run's turns and their logs.

A scheduled run (one history entry) is a sequence of turns, each an agent
execution with its own log file. They are printed in order, each between
separator lines as ``runs logs`` frames attempts::

    [kandevd] ==== turn 1/3 message started 2026-12-05T09:00:00.1Z ====
    ...the turn's log...
    [kandevd] ==== turn 1/3 message ended: success (1.2s) ====

Without ENTRY_ID, the newest entry; ENTRY_ID may also be the session id a
run was started with (``jobs trigger`` prints it). The logs are files under
the home, read here as ``runs logs`` reads a run's.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import click

from kandevd import exits
from kandevd.cli.common import client_options, invoke, user_option
from kandevd.cli.format import duration, print_file_from, printable
from kandevd.paths import HomeLayout, inside, resolve_home

#: How often ``--follow`` looks for more (the history entry and the logs are files).
FOLLOW_POLL_S = 0.5
#: How far back an ENTRY_ID is looked for.
HISTORY_PAGE = 500
TERMINAL = ("success", "error", "stopped")


@click.command("logs")
@click.argument("job_id")
@click.argument("entry_id", required=False)
@user_option
@click.option("--follow", "-f", is_flag=True,
              help="Keep printing the turns as they run until the run ends.")
@client_options
def job_logs(job_id: str, entry_id: str | None, user_id: str | None, follow: bool,
             home: str | None, socket_path: str | None) -> None:
    """Print a scheduled run's turns with their logs (the newest run by default)."""
    ref = {"id": job_id, **({"user_id": user_id} if user_id else {})}
    # The job as the daemon names it (a bare schedule id given here is not its id).
    job = invoke(home, socket_path, "scheduler.jobs.get", ref)
    name = str(job.get("id")) + (f" (user {job['user_id']})" if job.get("user_id") else "")

    def fetch() -> dict[str, Any]:
        page = invoke(home, socket_path, "scheduler.jobs.runs", {**ref, "limit": HISTORY_PAGE})
        entry = _pick(page["items"], entry_id)
        if entry is None:
            what = f"no run {entry_id!r} of {name}" if entry_id else f"{name} has no run yet"
            click.echo(f"kandevd: {what} (see `kandevd jobs runs {job_id}`)", err=True)
            sys.exit(exits.ERROR)
        return entry

    entry = fetch()
    entry_id = entry.get("id")
    click.echo(f"[kandevd] run {entry.get('id')} of {name}: {entry.get('trigger_source')}, "
               f"session {entry.get('session_id')}, started {entry.get('started_at')}")
    # (the daemon's home: the one given here may be another, when only --socket is)
    served = invoke(home, socket_path, "daemon.status").get("home")
    printer = _TurnPrinter(HomeLayout(Path(served) if served else resolve_home(home)).logs)
    while True:
        printer.show(entry)
        if not follow or entry.get("status") in TERMINAL:
            break
        time.sleep(FOLLOW_POLL_S)
        entry = fetch()
    printer.show(entry)  # what the last turn wrote as it ended
    error = f": {entry['error']}" if entry.get("error") else ""
    click.echo(f"[kandevd] run {entry.get('id')} {entry.get('status')}{error}")


def _pick(items: list[dict[str, Any]], wanted: str | None) -> dict[str, Any] | None:
    if wanted is None:
        return items[0] if items else None
    return next((e for e in items if wanted in (e.get("id"), e.get("session_id"))), None)


class _TurnPrinter:
    """Prints each turn's separator, then its log from where it stopped last time."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs  # (the home's logs folder: the only place logs are read from)
        self.offsets: dict[int, int] = {}
        self.closed: set[int] = set()
        self.refused: set[int] = set()

    def show(self, entry: dict[str, Any]) -> None:
        turns = [t for t in entry.get("turns") or [] if isinstance(t, dict)]
        for number, turn in enumerate(turns, start=1):
            if number in self.closed:
                continue
            label = f"turn {number}/{len(turns)} {turn.get('kind')}"
            if number not in self.offsets:
                click.echo(f"[kandevd] ==== {label} started {turn.get('started_at') or ''}"
                           .rstrip() + " ====")
                if turn.get("message"):
                    click.echo(f"[kandevd] message: {turn['message']}")
                self.offsets[number] = 0
            raw = turn.get("log_path")
            path = inside(raw, self.logs)
            if path is not None:
                self.offsets[number] = print_file_from(path, self.offsets[number])
            elif raw and number not in self.refused:
                self.refused.add(number)
                click.echo(f"kandevd: the log of turn {number} is not shown: its path "
                           f"({printable(str(raw))}) is outside {self.logs}, the "
                           "only place logs are read from", err=True)
            if turn.get("status") in TERMINAL:
                took = f" ({duration(turn.get('duration_ms'))})" \
                    if turn.get("duration_ms") is not None else ""
                error = f": {turn['error']}" if turn.get("error") else ""
                click.echo(f"[kandevd] ==== {label} ended: {turn['status']}{took}{error} ====")
                if turn.get("output"):
                    click.echo(f"[kandevd] output: {turn['output']}")
                self.closed.add(number)
