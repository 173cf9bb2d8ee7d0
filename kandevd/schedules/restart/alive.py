"""When a daemon last watched this workflow root: ``config/scheduler.alive``.

A fire is "missed while the daemon was down" only if its time fell after the
last moment a daemon looked at the clock for this root. The cron loop sets
the file's modification time to each tick's ``now`` (one ``utime``, no
write), and it ticks at every fire time and at least once a minute, so every
fire a running daemon handled lies at or before that mark: a skip while
paused or a held occurrence is never taken for a missed one after a restart.
"""

from __future__ import annotations

import logging
import os
from datetime import UTC, datetime
from pathlib import Path

from kandevd.fsutil import ensure_dir

log = logging.getLogger("kandevd.scheduler")

ALIVE_FILE = Path("config") / "scheduler.alive"


class AliveMark:
    def __init__(self, root: Path) -> None:
        self.path = root / ALIVE_FILE
        self._warned = False

    def last_seen(self) -> datetime | None:
        """When the last daemon last ticked for this root (None: never, as far as known)."""
        try:
            return datetime.fromtimestamp(self.path.stat().st_mtime, UTC)
        except (OSError, ValueError, OverflowError):
            return None

    def touch(self, now: datetime) -> None:
        """Mark ``now`` as watched; a failure is logged once (the mark is a hint only)."""
        stamp = now.timestamp()
        try:
            try:
                os.utime(self.path, (stamp, stamp))
            except FileNotFoundError:
                ensure_dir(self.path.parent)
                self.path.touch(mode=0o600)
                os.utime(self.path, (stamp, stamp))
        except OSError as exc:
            if not self._warned:
                log.warning("cannot mark %s (%s): fires missed while the daemon was down "
                            "are counted from the last run instead", self.path, exc)
                self._warned = True
            return
        self._warned = False
