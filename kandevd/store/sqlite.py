"""The SQLite store in the home: one database file, WAL, one guarded writer connection.

``transaction()`` is ``BEGIN IMMEDIATE``: the write lock is taken up front,
so a read-then-update (a claim) can never be interleaved with another writer.
Read connections (``mode=ro``) let reads run beside a write transaction; a
``:memory:`` store has none and reads from the writer.
"""

from __future__ import annotations

import logging
import os
import sqlite3
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from kandevd.store.base import BUSY_TIMEOUT_MS, BaseStore

log = logging.getLogger("kandevd.store")


def db_size_bytes(path: str | os.PathLike[str]) -> int:
    """Size of the database file plus its write-ahead log (absent files count 0)."""
    total = 0
    for name in (os.fspath(path), os.fspath(path) + "-wal"):
        try:
            total += os.stat(name).st_size
        except OSError:
            pass
    return total


class CountedConnection(sqlite3.Connection):
    """A connection that counts the statements sent through it (``store.statements``).

    Not a trace callback: SQLite calls that from inside each statement, which then
    takes the interpreter lock in mid-statement (and formats the statement with its
    values), a cost on every statement of the run path. An ``executemany`` or
    ``executescript`` counts as one.
    """

    count: Callable[[], None] = staticmethod(lambda: None)

    def execute(self, sql: str, parameters: Any = (), /) -> sqlite3.Cursor:
        self.count()
        return super().execute(sql, parameters)

    def executemany(self, sql: str, parameters: Iterable[Any], /) -> sqlite3.Cursor:
        self.count()
        return super().executemany(sql, parameters)

    def executescript(self, script: str, /) -> sqlite3.Cursor:
        self.count()
        return super().executescript(script)


class Store(BaseStore):
    """The SQLite store in the home: one file, WAL, ``BEGIN IMMEDIATE`` writes."""

    #: The class of every connection the store opens (a test may record statements).
    connection_factory: type[sqlite3.Connection] = CountedConnection

    def __init__(self, path: Path | str, *, synchronous: str = "FULL") -> None:
        self.path = str(path)
        self._init_common()
        self._memory = self.path == ":memory:" or self.path.startswith("file::memory:") \
            or "mode=memory" in self.path
        conn = sqlite3.connect(
            self.path, check_same_thread=False, isolation_level=None,
            timeout=BUSY_TIMEOUT_MS / 1000, factory=self.connection_factory,
        )
        conn.row_factory = sqlite3.Row
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        conn.execute("PRAGMA foreign_keys=ON")
        conn.execute(f"PRAGMA synchronous={synchronous}")
        self._last_written: str | None = None
        self._count_on(conn, self._trace_writer)
        self._conn = conn
        if self.path != ":memory:" and os.path.exists(self.path):
            os.chmod(self.path, 0o600)

    def _count_on(self, conn: sqlite3.Connection, trace: Callable[[str], None]) -> None:
        """Count ``conn``'s statements: by the connection itself, or by a trace callback
        when each statement is written to the trace file (``KANDEVD_TRACE_SQL``) or the
        connection is another class (a test's)."""
        if self._trace_file is None and isinstance(conn, CountedConnection):
            conn.count = self._count
        else:
            conn.set_trace_callback(trace)

    def _trace_writer(self, statement: str) -> None:
        """The writer's trace: each statement once, not once more per trigger it fires.

        SQLite reports the start of every trigger program (the run counts of
        migration 6 fire on each run written) as the statement that fired it,
        and Python passes the same text again; a repeat of the text just seen
        on this connection is that. (Running the very same statement, values
        included, twice in a row is then counted once: a diagnostic counter.)
        """
        if statement == self._last_written:
            return
        self._last_written = statement
        self._trace(statement)

    def _open_reader_connection(self) -> sqlite3.Connection:
        uri = Path(self.path).absolute().as_uri() + "?mode=ro"
        try:
            conn = sqlite3.connect(uri, uri=True, check_same_thread=False,
                                   isolation_level=None, timeout=BUSY_TIMEOUT_MS / 1000,
                                   factory=self.connection_factory)
        except sqlite3.DatabaseError as exc:
            self._note_failure(exc)
            raise
        try:
            conn.row_factory = sqlite3.Row
            conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            conn.execute("PRAGMA journal_mode")  # WAL: set by the writer, persistent
            self._count_on(conn, self._trace)
        except sqlite3.DatabaseError as exc:
            conn.close()
            self._note_failure(exc)
            raise
        return conn

    def _begin(self, conn: sqlite3.Connection, exclusive: bool) -> None:
        conn.execute("BEGIN IMMEDIATE")  # SQLite has one writer at a time either way

    def _in_transaction(self, conn: sqlite3.Connection) -> bool:
        return conn.in_transaction

    def _note_failure(self, exc: BaseException) -> None:
        """A damaged database (corruption, I/O error) is reported once, then degraded.

        A full disk, a busy database or a constraint violation passes and is
        not damage. Corruption or an I/O error means the file cannot be
        trusted: ``daemon.status`` says ``degraded`` with the reason, and one
        error line tells the operator what to do, instead of a traceback per use.
        """
        # Corruption ("malformed", "not a database") is a plain DatabaseError; a
        # constraint violation (IntegrityError) or a full disk is not damage.
        # Bytes that are not the text that was stored are damage too.
        damaged = type(exc) in (sqlite3.DatabaseError, sqlite3.InternalError) or (
            isinstance(exc, sqlite3.OperationalError)
            and ("disk I/O" in str(exc) or "Could not decode" in str(exc)))
        if damaged and self.degraded is None:
            self.degraded = str(exc)
            log.error("database %s is damaged (%s): requests that need it answer "
                      "'unavailable'; stop the daemon, run `kandevd db check`, and "
                      "restore a backup or recover it", self.path, exc)

    def size_bytes(self) -> int:
        """The database file plus its write-ahead log, in bytes."""
        return db_size_bytes(self.path)

    def change_marker(self) -> tuple[int, int, int] | None:
        """Changes when any transaction committed: this store's own, or another process's
        (the write-ahead log's size or time moves)."""
        try:
            wal = os.stat(self.path + "-wal")
            return (self.commits, wal.st_size, wal.st_mtime_ns)
        except OSError:
            return (self.commits, -1, -1)

    def _close_writer(self) -> None:
        try:
            self._conn.execute("PRAGMA optimize")
        except sqlite3.Error:
            pass
        self._conn.close()
