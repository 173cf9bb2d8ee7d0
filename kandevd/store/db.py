"""The SQLite store: one database file, one guarded connection.

Threading model: the daemon opens exactly one ``sqlite3.Connection``
(``check_same_thread=False``) and serialises every use of it with a
re-entrant lock. SQLite allows one writer at a time anyway, our statements
are short, and a single connection makes ``close()`` trivially correct: it
takes the same lock, so it waits for whatever statement is running, and after
it every use raises :class:`StoreClosedError` with a message that says this
is a shutdown-order bug. Other processes (tests, the CLI, a second reader)
may open the same file; WAL mode lets them read while the daemon writes.

``transaction()`` is ``BEGIN IMMEDIATE``: the write lock is taken up front,
so a read-then-update (a claim) can never be interleaved with another writer.
"""

from __future__ import annotations

import logging
import os
import re
import sqlite3
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

log = logging.getLogger("kandevd.store")

BUSY_TIMEOUT_MS = 10_000

#: SQLite errors that say the disk or the database is unavailable for now.
_ENVIRONMENTAL = re.compile(r"full|locked|busy|disk I/O|readonly", re.IGNORECASE)


def is_environmental(exc: BaseException) -> bool:
    """A full disk or a busy database: the environment, not a bug; it passes."""
    return isinstance(exc, sqlite3.OperationalError) and bool(_ENVIRONMENTAL.search(str(exc)))


class StoreError(RuntimeError):
    """Misuse of the store (a bug in the caller, not a database problem)."""


class StoreClosedError(StoreError):
    def __init__(self) -> None:
        super().__init__(
            "the store was used after Store.close(); every user of the store must be "
            "stopped and joined before it is closed"
        )


class Store:
    def __init__(self, path: Path | str, *, synchronous: str = "FULL") -> None:
        self.path = str(path)
        self._lock = threading.RLock()
        self._closed = False
        self.statements = 0
        self._after_commit: list[Callable[[], None]] = []
        self.degraded: str | None = None  # why the database is damaged (see _note_failure)
        conn = sqlite3.connect(
            self.path, check_same_thread=False, isolation_level=None,
            timeout=BUSY_TIMEOUT_MS / 1000,
        )
        conn.row_factory = sqlite3.Row
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        conn.execute("PRAGMA foreign_keys=ON")
        conn.execute(f"PRAGMA synchronous={synchronous}")
        conn.set_trace_callback(self._trace)
        self._trace_file = None
        trace_path = os.environ.get("KANDEVD_TRACE_SQL")
        if trace_path:
            # Debug aid (and what the Office gating tests read): every statement, one per line.
            self._trace_file = open(trace_path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115
        self._conn = conn
        if self.path != ":memory:" and os.path.exists(self.path):
            os.chmod(self.path, 0o600)

    def _trace(self, statement: str) -> None:
        self.statements += 1
        if self._trace_file is not None:
            self._trace_file.write(" ".join(statement.split()) + "\n")

    # -- access -----------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    @contextmanager
    def connection(self) -> Iterator[sqlite3.Connection]:
        """The raw connection under the store lock (autocommit per statement)."""
        with self._lock:
            if self._closed:
                raise StoreClosedError()
            try:
                yield self._conn
            except sqlite3.DatabaseError as exc:
                self._note_failure(exc)
                raise

    def _note_failure(self, exc: sqlite3.DatabaseError) -> None:
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

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """``BEGIN IMMEDIATE`` ... ``COMMIT`` (``ROLLBACK`` on any exception).

        A nested use joins the outer transaction; callbacks registered with
        :meth:`after_commit` run once the outermost one has committed.
        """
        with self._lock:
            if self._closed:
                raise StoreClosedError()
            conn = self._conn
            if conn.in_transaction:  # nested use joins the outer transaction
                yield conn
                return
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
                conn.execute("COMMIT")
            except BaseException as exc:
                if isinstance(exc, sqlite3.DatabaseError):
                    self._note_failure(exc)
                self._after_commit.clear()  # what they announce never happened
                # Also when COMMIT itself failed: never leave a transaction open, or every
                # later transaction() would silently "join" it. SQLite may already have
                # rolled back on its own (e.g. SQLITE_FULL); a second ROLLBACK would then
                # raise and hide the real error.
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
            callbacks, self._after_commit = self._after_commit, []
        for callback in callbacks:
            try:
                callback()
            except Exception:
                log.exception("after-commit callback %r raised; ignored", callback)

    def after_commit(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once the current transaction commits (now, outside one).

        Events and wake-ups about a write must not be seen before the write is:
        a caller nested in someone else's transaction cannot know when that
        commits, so it defers its announcement here. A rollback drops it.
        """
        with self._lock:
            if self._conn.in_transaction:
                self._after_commit.append(callback)
                return
        callback()

    def query(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> list[sqlite3.Row]:
        with self.connection() as conn:
            return conn.execute(sql, params).fetchall()

    def query_one(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()
                  ) -> sqlite3.Row | None:
        with self.connection() as conn:
            return conn.execute(sql, params).fetchone()

    def execute(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> int:
        """Run one write statement in its own transaction; return rows changed."""
        with self.transaction() as conn:
            return conn.execute(sql, params).rowcount

    # -- lifecycle --------------------------------------------------------------
    def close(self) -> None:
        """Close the connection; waits for the statement in progress. Idempotent."""
        with self._lock:
            if self._closed:
                return
            if self._conn.in_transaction:
                # Only this thread can be inside a transaction now (we hold the lock):
                # closing under it would break the transaction's own COMMIT.
                raise StoreError("Store.close() called inside an open transaction")
            self._closed = True
            try:
                self._conn.execute("PRAGMA optimize")
            except sqlite3.Error:
                pass
            self._conn.close()
            if self._trace_file is not None:
                self._trace_file.close()
        log.debug("store closed")


def open_store(path: Path | str, **kwargs: Any) -> Store:
    """Open the store and bring its schema up to date."""
    from kandevd.store.migrations import migrate

    store = Store(path, **kwargs)
    try:
        migrate(store)
    except BaseException:
        store.close()
        raise
    return store
