"""Reading logs for the console: only files under the home's ``logs/`` folder, and the
standard output of an execution that still runs.

A history entry names its turns' logs, and a workflow root's files can be
edited by anyone who can write them: a path outside the logs folder is never
opened, whatever the entry says.

While an execution runs, its log holds what the agent writes to stderr (and
the daemon's frames); its stdout goes to the execution's own file
(``<home>/turns/turn-<entry>-<index>.stdout`` for a scheduled turn,
``<home>/attempts/<run id>.<token>.stdout`` for a run's attempt; an agent an
older daemon started wrote ``stdout`` inside those folders) and joins
the end of the log when it ends. A live view shows that file after the log,
which is where it lands. Its path is made here from ids of plain
characters and must resolve inside its folder.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Any

from kandevd.paths import HomeLayout, inside

#: The end of a log shown on a page (the live view streams the rest).
TAIL_BYTES = 64 * 1024


def log_root(console: Any) -> Path:
    return Path(console.home) / "logs"


def safe_log_path(console: Any, raw: Any) -> Path | None:
    return inside(raw, log_root(console))


def run_log_path(console: Any, run: dict[str, Any]) -> str:
    """A run's log: the one the run names, else where a run's log is written (a run
    names it only once it has ended)."""
    return str(run.get("log_path") or log_root(console) / "runs" / f"{run.get('id')}.log")


def readable_log(console: Any, raw: Any, limit: int = TAIL_BYTES) -> dict[str, Any]:
    """``{text, size, truncated, state, path}`` of a log's end. ``state`` says why there
    is no text when there is none: ``none`` (no log named), ``refused`` (named outside
    the logs folder: not opened), ``missing`` (no such file, or unreadable), ``empty``;
    else ``ok``. ``refused`` is also a key of its own."""
    path = safe_log_path(console, raw)
    shown = str(raw) if isinstance(raw, str) else ""
    if path is None:
        state = "refused" if raw else "none"
        return {"text": "", "size": 0, "truncated": False, "refused": bool(raw),
                "state": state, "path": shown}
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            start = max(0, size - limit)
            handle.seek(start)
            data = handle.read(limit)
    except OSError:
        return {"text": "", "size": 0, "truncated": False, "refused": False,
                "state": "missing", "path": shown}
    return {"text": data.decode("utf-8", "replace"), "size": size, "truncated": start > 0,
            "refused": False, "state": "ok" if size else "empty", "path": shown}


#: Ids a stdout file's path is made of: nothing that could climb out of its folder.
_PLAIN_ID = re.compile(r"[A-Za-z0-9_-]{1,200}")
STDOUT_FILE = "stdout"
#: The keeper's stdout file of an execution: beside its record folder, this suffix added.
KEPT_SUFFIX = ".stdout"


def _inside(path: Path, folder: Path) -> Path | None:
    try:
        real, root = Path(os.path.realpath(path)), Path(os.path.realpath(folder))
    except (OSError, ValueError):
        return None
    return real if root in real.parents else None


def turn_stdout_path(console: Any, entry_id: Any, index: int) -> Path | None:
    """Where a running turn's stdout is (None for an id that is not plain)."""
    if not isinstance(entry_id, str) or not _PLAIN_ID.fullmatch(entry_id):
        return None
    turns = HomeLayout(Path(console.home)).turns
    name = f"turn-{entry_id}-{int(index)}"
    return _newest([turns / f"{name}{KEPT_SUFFIX}", turns / name / STDOUT_FILE], turns)


def run_stdout_path(console: Any, run_id: Any) -> Path | None:
    """Where the stdout of a run's current attempt is: the newest stdout file of its
    attempts (None when there is none)."""
    if not isinstance(run_id, str) or not _PLAIN_ID.fullmatch(run_id):
        return None
    attempts = HomeLayout(Path(console.home)).attempts
    candidates: list[Path] = []
    try:
        with os.scandir(attempts) as entries:
            for entry in entries:
                if not entry.name.startswith(run_id + "."):
                    continue
                if entry.name.endswith(KEPT_SUFFIX):
                    candidates.append(Path(entry.path))
                elif entry.is_dir(follow_symlinks=False):
                    candidates.append(Path(entry.path) / STDOUT_FILE)
    except OSError:
        return None
    return _newest(candidates, attempts)


def _newest(candidates: list[Path], folder: Path) -> Path | None:
    """The most recently written of the regular files among ``candidates`` inside
    ``folder``."""
    found: list[tuple[float, Path]] = []
    for path in candidates:
        try:
            info = os.stat(path)
        except OSError:
            continue
        if stat.S_ISREG(info.st_mode):
            found.append((info.st_mtime, path))
    if not found:
        return None
    return _inside(max(found)[1], folder)


def tail(path: Path | None, limit: int = TAIL_BYTES) -> dict[str, Any]:
    """``{text, size}`` of the end of ``path`` (empty when there is none)."""
    if path is None:
        return {"text": "", "size": 0}
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            handle.seek(max(0, size - limit))
            data = handle.read(limit)
    except OSError:
        return {"text": "", "size": 0}
    return {"text": data.decode("utf-8", "replace"), "size": size}


def with_output(log: dict[str, Any], stdout: Path | None) -> dict[str, Any]:
    """A running execution's log with its stdout so far (``out_text``, ``out_size``)."""
    out = tail(stdout)
    shown = {**log, "out_text": out["text"], "out_size": out["size"]}
    if out["text"] and log["state"] in ("none", "missing", "empty"):
        shown["state"] = "ok"
    return shown
