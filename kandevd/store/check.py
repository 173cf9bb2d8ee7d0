"""Opening the database safely, and the checks an operator runs on it.

The daemon must never paper over a broken database: a file that is not a
SQLite database, one that fails SQLite's own consistency check, a directory
where the file should be, a read-only file or a full disk each stop the start
with one line naming the file, what is wrong and what to do (exit 74,
EX_IOERR). The file is never rewritten: in particular a zero-byte file
(SQLite would silently start a new, empty database in it) is reported, not
initialised over.

``kandevd db check`` runs ``PRAGMA quick_check`` and ``PRAGMA
integrity_check``; ``kandevd db backup FILE`` copies the database with
SQLite's online backup API, which gives a consistent copy while the daemon
keeps writing.
"""

from __future__ import annotations

import errno
import os
import sqlite3
from pathlib import Path

from kandevd.store.open import open_store
from kandevd.store.sqlite import Store

RECOVER_HINT = ("restore a backup (`kandevd db backup` makes one), or recover what is left "
                "with `sqlite3 {path} .recover | sqlite3 recovered.db`")


class DatabaseUnusable(Exception):
    """The database cannot be used; the message says which file, why and what to do."""


def _problem(path: Path, what: str, hint: str | None = None) -> DatabaseUnusable:
    return DatabaseUnusable(f"database {path}: {what}; "
                            + (hint or RECOVER_HINT.format(path=path)))


def open_checked(path: Path) -> Store:
    """Open (and migrate) the daemon's database, or raise :class:`DatabaseUnusable`."""
    path = Path(path)
    if path.is_dir():
        raise _problem(path, "is a directory, not a database file",
                       "move it away or point --home elsewhere")
    if path.exists() and path.stat().st_size == 0:
        raise _problem(path, "is empty (0 bytes), so it holds no kandevd data",
                       "if that is expected, remove it to start with a new database; "
                       "otherwise restore a backup")
    if path.exists() and not os.access(path, os.W_OK):
        raise _problem(path, "is read-only", "make it writable by the daemon's user")
    try:
        store = open_store(path)
    except sqlite3.DatabaseError as exc:
        raise _classify(path, exc) from None
    try:
        problems = quick_check(store)
    except sqlite3.DatabaseError as exc:
        store.close()
        raise _classify(path, exc) from None
    if problems:
        store.close()
        raise _problem(path, "failed its consistency check (" + "; ".join(problems[:3]) + ")")
    return store


def _classify(path: Path, exc: sqlite3.DatabaseError) -> DatabaseUnusable:
    text = str(exc)
    lowered = text.lower()
    if "full" in lowered:
        return _problem(path, f"cannot be written: {text}", "free disk space and start again")
    if "readonly" in lowered or "read-only" in lowered:
        return _problem(path, f"cannot be written: {text}",
                        "make it (and its folder) writable by the daemon's user")
    if "unable to open" in lowered:
        return _problem(path, f"cannot be opened: {text}",
                        "check that its folder exists and is writable")
    if "not a database" in lowered or "malformed" in lowered or "corrupt" in lowered:
        return _problem(path, f"is damaged or not a SQLite database ({text})")
    if "newer than this kandevd" in lowered:
        return _problem(path, text, "run a kandevd at least as new as the one that wrote it")
    return _problem(path, f"cannot be used: {text}")


def quick_check(store: Store) -> list[str]:
    """SQLite's ``quick_check``: [] when the database is consistent, else the problems."""
    return _pragma_problems(store, "PRAGMA quick_check")


def _pragma_problems(store: Store, pragma: str) -> list[str]:
    rows = store.query(pragma)
    messages = [str(row[0]) for row in rows]
    return [] if messages == ["ok"] else messages


def check_file(path: Path) -> dict[str, list[str]]:
    """``{"quick_check": [...], "integrity_check": [...]}`` of a database file, read-only.

    Safe while the daemon runs (a read transaction on the WAL database). An
    empty list means the check passed.
    """
    path = Path(path)
    if not path.is_file():
        raise DatabaseUnusable(f"database {path}: no such file")
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)
    try:
        return {name: _rows_problems(conn, f"PRAGMA {name}")
                for name in ("quick_check", "integrity_check")}
    except sqlite3.DatabaseError as exc:
        raise _classify(path, exc) from None
    finally:
        conn.close()


def _rows_problems(conn: sqlite3.Connection, pragma: str) -> list[str]:
    messages = [str(row[0]) for row in conn.execute(pragma).fetchall()]
    return [] if messages == ["ok"] else messages


def backup(source: Path, target: Path) -> int:
    """Copy ``source`` to ``target`` with SQLite's online backup; the pages copied.

    Consistent while the daemon writes: the backup API restarts a step that a
    concurrent write invalidated. ``target`` must not exist (nothing is
    overwritten); it is created 0600, like the database.
    """
    source, target = Path(source), Path(target)
    if not source.is_file():
        raise DatabaseUnusable(f"database {source}: no such file")
    if target.exists():  # (the output cannot be made: the CLI exits 73, not 74)
        raise FileExistsError(errno.EEXIST, "already exists; choose a new file name",
                              str(target))
    src = sqlite3.connect(f"file:{source}?mode=ro", uri=True, timeout=10)
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.close(fd)
    dst = sqlite3.connect(target)
    try:
        src.backup(dst, pages=1024)
        pages = dst.execute("PRAGMA page_count").fetchone()[0]
    except BaseException:
        dst.close()
        target.unlink(missing_ok=True)
        raise
    finally:
        src.close()
    dst.close()
    return int(pages)
