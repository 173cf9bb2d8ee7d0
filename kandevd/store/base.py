"""What every store shares: the guarded writer, the reader pool, nested transactions.

A backend (:mod:`kandevd.store.sqlite`, :mod:`kandevd.store.postgres`) gives
the connections; the locking, the nesting of transactions, the after-commit
callbacks and the routing of reads are the same for every database, so the
code above the store runs on either. The store's errors are the DB-API
classes of :mod:`sqlite3` whatever the backend. See docs/architecture.md
("The store") for the threading model.
"""

from __future__ import annotations

import abc
import logging
import os
import re
import sqlite3
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

log = logging.getLogger("kandevd.store")

BUSY_TIMEOUT_MS = 10_000

#: SQLite errors that say the disk or the database is unavailable for now.
_ENVIRONMENTAL = re.compile(r"full|locked|busy|disk I/O|readonly", re.IGNORECASE)


class StoreUnavailable(sqlite3.OperationalError):
    """The database server cannot be reached now (a network store); it passes.

    The store's errors are the DB-API classes of :mod:`sqlite3` whatever the
    backend, so the code above the store catches one family of exceptions.
    """


def is_environmental(exc: BaseException) -> bool:
    """A full disk, a busy database or an unreachable server: the environment; it passes."""
    return isinstance(exc, StoreUnavailable) or (
        isinstance(exc, sqlite3.OperationalError) and bool(_ENVIRONMENTAL.search(str(exc))))


def is_disconnected(exc: BaseException) -> bool:
    """Did the connection itself break (only a network store's can)?"""
    return isinstance(exc, StoreUnavailable)


class StoreError(RuntimeError):
    """Misuse of the store (a bug in the caller, not a database problem)."""


class StoreClosedError(StoreError):
    def __init__(self) -> None:
        super().__init__(
            "the store was used after Store.close(); every user of the store must be "
            "stopped and joined before it is closed"
        )


#: Idle read connections kept for the next ``reading()`` block; more are closed.
MAX_IDLE_READERS = 4


class _Reader:
    """One read-only connection; ``lock`` is held while it is used, and by close.

    Re-entrant, like the writer's: a read may nest ``connection()`` uses.
    """

    __slots__ = ("closed", "conn", "lock")

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.lock = threading.RLock()
        self.closed = False

    def close(self) -> None:
        with self.lock:  # waits for the statement in progress
            if not self.closed:
                self.closed = True
                self.conn.close()


class BaseStore(abc.ABC):
    """What every store shares: the guarded writer, the reader pool, transactions.

    A backend gives :meth:`_open_reader_connection`, :meth:`_begin`,
    :meth:`_in_transaction`, :meth:`_note_failure` and :meth:`_close_writer`;
    the locking, the nesting of transactions, the after-commit callbacks and
    the routing of reads are the same for every database.
    """

    #: Which SQL dialect the store speaks (``sqlite`` or ``postgresql``).
    dialect = "sqlite"
    #: Several daemons may share this database (each prunes only its own home's files,
    #: and they form a cluster).
    shared = False

    def _init_common(self) -> None:
        self._lock = threading.RLock()
        self._closed = False
        self.statements = 0
        #: Transactions committed by this store (the writer is the only one that writes
        #: while the daemon runs): a reader can tell that nothing changed since it looked.
        self.commits = 0
        self._count_lock = threading.Lock()
        self._local = threading.local()  # reading depth, writer depth, checked-out reader
        self._readers_lock = threading.Lock()
        self._readers: set[_Reader] = set()  # every open read connection
        self._idle_readers: list[_Reader] = []
        self._memory = False
        #: Several daemons: the cluster's word on whether the database is in reach
        #: (:meth:`out_of_reach`).
        self.reach_check: Callable[[], str | None] | None = None
        self._after_commit: list[Callable[[], None]] = []
        self.degraded: str | None = None  # why the database is damaged (see _note_failure)
        self._trace_file = None
        trace_path = os.environ.get("KANDEVD_TRACE_SQL")
        if trace_path:
            # Debug aid (and what the Office gating tests read): every statement, one per line.
            self._trace_file = open(trace_path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115

    def _count(self) -> None:
        with self._count_lock:  # readers count from their own threads
            self.statements += 1

    def _trace(self, statement: str) -> None:
        with self._count_lock:  # readers trace from their own threads
            self.statements += 1
            if self._trace_file is not None:
                self._trace_file.write(" ".join(statement.split()) + "\n")

    # -- backend hooks ------------------------------------------------------------
    def _writer(self) -> Any:
        """The writer connection (a backend may reopen a broken one here)."""
        return self._conn

    @abc.abstractmethod
    def _open_reader_connection(self) -> Any:
        """A new read connection."""

    def _usable(self, conn: Any) -> bool:
        """Can an idle connection still be used? (A server may have ended it meanwhile.)"""
        return True

    @abc.abstractmethod
    def _begin(self, conn: Any, exclusive: bool) -> None:
        """Begin a write transaction on ``conn`` (``exclusive``: take the writer lock)."""

    @abc.abstractmethod
    def _in_transaction(self, conn: Any) -> bool:
        """Is ``conn`` inside a transaction?"""

    @abc.abstractmethod
    def _note_failure(self, exc: BaseException) -> None:
        """Note a database error (a backend may mark the store degraded)."""

    @abc.abstractmethod
    def _close_writer(self) -> None:
        """Close the writer connection (under the store lock)."""

    @abc.abstractmethod
    def size_bytes(self) -> int:
        """How much room the database takes, in bytes."""

    def out_of_reach(self) -> str | None:
        """Why the database is taken for out of reach now (several daemons: the cluster's
        heartbeats stopped completing), or None. What only reports (``daemon.status``,
        metrics, a job's state) answers from what it knew instead of waiting for the
        network's timeouts."""
        check = self.reach_check
        return check() if check is not None else None

    def change_marker(self) -> object | None:
        """A value that changes whenever anything committed, or None when nothing cheap
        tells (several daemons write): then every reader must read again."""
        return None

    # -- read connections ---------------------------------------------------------
    @contextmanager
    def reading(self) -> Iterator[None]:
        """Route this thread's reads to a read-only connection for the block.

        Nests; writes (``transaction()``, ``execute()``) still go to the writer,
        and so do reads inside a writer transaction of this thread. A
        ``:memory:`` store reads from the writer (there is no second connection
        to an in-memory database).
        """
        local = self._local
        local.reading = getattr(local, "reading", 0) + 1
        try:
            yield
        finally:
            local.reading -= 1
            if local.reading == 0:
                reader = getattr(local, "reader", None)
                local.reader = None
                if reader is not None:
                    self._release_reader(reader)

    @property
    def writing(self) -> bool:
        """Is the calling thread inside :meth:`transaction`?"""
        return getattr(self._local, "writing", 0) > 0

    def _reads_on_reader(self) -> bool:
        local = self._local
        return (not self._memory and getattr(local, "reading", 0) > 0
                and getattr(local, "writing", 0) == 0)

    def _checkout_reader(self) -> _Reader:
        local = self._local
        reader: _Reader | None = getattr(local, "reader", None)
        if reader is not None:
            return reader
        with self._readers_lock:
            if self._closed:
                raise StoreClosedError()
            reader = self._idle_readers.pop() if self._idle_readers else None
        if reader is not None and not self._usable(reader.conn):
            self._discard_reader(reader)
            reader = None
        if reader is None:
            reader = _Reader(self._open_reader_connection())
            with self._readers_lock:
                if self._closed:
                    reader.close()
                    raise StoreClosedError()
                self._readers.add(reader)
        local.reader = reader
        return reader

    def _release_reader(self, reader: _Reader) -> None:
        with self._readers_lock:
            if reader.closed:
                self._readers.discard(reader)
                return
            if not self._closed and len(self._idle_readers) < MAX_IDLE_READERS:
                self._idle_readers.append(reader)
                return
            self._readers.discard(reader)
        reader.close()

    def _discard_reader(self, reader: _Reader) -> None:
        """A reader whose connection broke: closed, never handed out again."""
        with self._readers_lock:
            self._readers.discard(reader)
            if reader in self._idle_readers:
                self._idle_readers.remove(reader)
        try:
            reader.close()
        except Exception:  # a broken connection may fail to close too
            pass
        if getattr(self._local, "reader", None) is reader:
            self._local.reader = None

    @property
    def readers_open(self) -> int:
        """How many read connections are open (checked out or idle)."""
        with self._readers_lock:
            return len(self._readers)

    # -- access -----------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    @contextmanager
    def connection(self) -> Iterator[Any]:
        """The raw connection under the store lock (autocommit per statement).

        Inside :meth:`reading` (and outside a writer transaction of this
        thread): this thread's read-only connection, under its own lock.
        """
        reader = self._checkout_reader() if self._reads_on_reader() else None
        lock = reader.lock if reader is not None else self._lock
        with lock:
            if self._closed or (reader is not None and reader.closed):
                raise StoreClosedError()
            try:
                yield reader.conn if reader is not None else self._writer()
            except sqlite3.DatabaseError as exc:
                self._note_failure(exc)
                if reader is not None and is_disconnected(exc):
                    self._discard_reader(reader)
                raise

    @contextmanager
    def transaction(self, *, exclusive: bool = True) -> Iterator[Any]:
        """Begin (the write lock taken up front) ... ``COMMIT``; ``ROLLBACK`` on any exception.

        A nested use joins the outer transaction; callbacks registered with
        :meth:`after_commit` run once the outermost one has committed.
        ``exclusive=False`` is for a writer that guards itself with row locks
        (a claim on PostgreSQL): it does not take the store-wide writer lock
        where the database has one to spare (SQLite always writes alone).
        """
        with self._lock:
            if self._closed:
                raise StoreClosedError()
            conn = self._writer()
            local = self._local
            if self._in_transaction(conn):
                if getattr(local, "writing", 0) > 0:  # nested use joins the outer one
                    yield conn
                    return
                # Left open by a begin that failed half-way (PostgreSQL: BEGIN done, the
                # writer lock timed out): never join it, or every later write would fail.
                conn.execute("ROLLBACK")
            try:
                self._begin(conn, exclusive)
            except sqlite3.DatabaseError as exc:
                self._note_failure(exc)
                if self._in_transaction(conn) and not is_disconnected(exc):
                    conn.execute("ROLLBACK")
                raise
            # This thread's reads see its own writes: on the writer until COMMIT.
            local.writing = getattr(local, "writing", 0) + 1
            try:
                yield conn
                conn.execute("COMMIT")
                self.commits += 1
            except BaseException as exc:
                if isinstance(exc, sqlite3.DatabaseError):
                    self._note_failure(exc)
                self._after_commit.clear()  # what they announce never happened
                # Also when COMMIT itself failed: never leave a transaction open, or every
                # later transaction() would silently "join" it. SQLite may already have
                # rolled back on its own (e.g. SQLITE_FULL); a second ROLLBACK would then
                # raise and hide the real error.
                if self._in_transaction(conn):
                    try:
                        conn.execute("ROLLBACK")
                    except sqlite3.DatabaseError:
                        if not is_disconnected(exc):
                            raise
                raise
            finally:
                local.writing -= 1
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
            if self._in_transaction(self._conn):
                self._after_commit.append(callback)
                return
        callback()

    def query(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> list[Any]:
        with self.connection() as conn:
            return conn.execute(sql, params).fetchall()

    def query_one(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> Any | None:
        with self.connection() as conn:
            return conn.execute(sql, params).fetchone()

    def execute(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> int:
        """Run one write statement in its own transaction; return rows changed."""
        with self.transaction() as conn:
            return conn.execute(sql, params).rowcount

    # -- lifecycle --------------------------------------------------------------
    def close(self) -> None:
        """Close every connection; waits for the statements in progress. Idempotent."""
        with self._lock:
            if self._closed:
                return
            if self.writing:
                # Only this thread can be inside a transaction now (we hold the lock):
                # closing under it would break the transaction's own COMMIT.
                raise StoreError("Store.close() called inside an open transaction")
            with self._readers_lock:
                self._closed = True
                readers = list(self._readers)
                self._readers.clear()
                self._idle_readers.clear()
            for reader in readers:  # each waits for its read in progress
                reader.close()
            self._close_writer()
            if self._trace_file is not None:
                self._trace_file.close()
        log.debug("store closed")
