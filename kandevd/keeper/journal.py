"""The keeper's journal: every spawn and every exit, on disk before anyone hears of it.

One file, ``<home>/keeper/journal``, a JSON object per line, appended with one
``write`` each (no fsync: the journal matters across a crash of the daemon or
the keeper, not of the machine, which ends the agents anyway)::

    {"t": "spawn", "id", "pid", "start", "deadline", "grace", "meta"}
    {"t": "exit",  "id", "code", "by", "killed", "at"}
    {"t": "ack",   "ids": [...]}

``start`` is the agent's start time in ``/proc`` (a pid reused later has
another), ``deadline`` a wall-clock time (a keeper started later enforces it
too), ``meta`` what the daemon said of the execution (its run, its log, its
files; the keeper never reads it). ``code`` follows the runtime's convention
(``-N`` for a signal, null when the exit could not be learnt), ``by`` the
termination the keeper carried out (``timed_out``, ``stopped``,
``interrupted``) or null. An ``ack`` says the daemon has recorded those
exits: their lines may go. A keeper reading the journal at its start keeps
what is not acknowledged and rewrites the file with just that (temporary
file, rename); a running keeper does so whenever the acknowledged lines pile
up. A last line cut short by a crash is skipped.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kandevd.keeper.protocol import COMPACT

log = logging.getLogger("kandevd.keeper")

#: Acknowledged executions after which the running keeper rewrites the journal.
COMPACT_AFTER = 2000


@dataclass
class Entry:
    """One execution as the journal tells it."""

    id: str
    pid: int
    start: int
    deadline: float
    grace: float
    meta: dict[str, Any] = field(default_factory=dict)
    #: How it ended (the ``exit`` line without ``t`` and ``id``), or None while it runs.
    exit: dict[str, Any] | None = None

    def spawn_line(self) -> dict[str, Any]:
        return {"t": "spawn", "id": self.id, "pid": self.pid, "start": self.start,
                "deadline": self.deadline, "grace": self.grace, "meta": self.meta}

    def exit_line(self) -> dict[str, Any] | None:
        return None if self.exit is None else {"t": "exit", "id": self.id, **self.exit}


def read(path: Path) -> dict[str, Entry]:
    """The executions the journal at ``path`` holds that are not acknowledged."""
    entries: dict[str, Entry] = {}
    try:
        with open(path, "rb") as handle:
            lines = handle.read().split(b"\n")
    except FileNotFoundError:
        return entries
    for raw in lines:
        if not raw.strip():
            continue
        try:
            line = json.loads(raw)
            kind = line["t"]
            if kind == "spawn":
                entries[str(line["id"])] = Entry(
                    id=str(line["id"]), pid=int(line["pid"]), start=int(line["start"]),
                    deadline=float(line["deadline"]), grace=float(line["grace"]),
                    meta=dict(line.get("meta") or {}))
            elif kind == "exit" and str(line["id"]) in entries:
                entries[str(line["id"])].exit = {k: v for k, v in line.items()
                                                 if k not in ("t", "id")}
            elif kind == "ack":
                for acked in line["ids"]:
                    entries.pop(str(acked), None)
        except (ValueError, KeyError, TypeError):
            log.warning("keeper journal %s: a line that does not parse was skipped", path)
    return entries


class Journal:
    """The journal open for appending (the keeper's only writer)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC,
                           0o600)
        self.acked_since_compaction = 0

    def append(self, line: dict[str, Any]) -> None:
        """One line, one write (an error is logged: the daemon still hears the event)."""
        data = COMPACT.encode(line).encode("utf-8") + b"\n"
        try:
            _write_all(self._fd, data)
        except OSError as exc:
            log.error("keeper journal %s: cannot append (%s); an execution may be "
                      "unknown after a restart", self.path, exc)

    def acknowledge(self, ids: list[str]) -> None:
        self.append({"t": "ack", "ids": ids})
        self.acked_since_compaction += len(ids)

    def rewrite(self, entries: list[Entry]) -> None:
        """Replace the file by just ``entries`` (what is not acknowledged)."""
        spare = self.path.with_name(self.path.name + ".new")
        lines = []
        for entry in entries:
            lines.append(entry.spawn_line())
            if (ended := entry.exit_line()) is not None:
                lines.append(ended)
        data = b"".join(COMPACT.encode(line).encode() + b"\n"
                        for line in lines)
        try:
            fd = os.open(spare, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                _write_all(fd, data)
            finally:
                os.close(fd)
            os.replace(spare, self.path)
        except OSError as exc:
            log.warning("keeper journal %s: not compacted (%s)", self.path, exc)
            return
        old, self._fd = self._fd, os.open(
            self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        os.close(old)
        self.acked_since_compaction = 0

    def close(self) -> None:
        os.close(self._fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
