"""The stores: :class:`BaseStore` (what every backend shares) and SQLite's :class:`Store`.

SQLite in the home is the default store: one database file, one guarded
writer connection, read connections. PostgreSQL (``store.url``) is
:class:`kandevd.store.pg.PgStore`, on the same base. What follows is said of
SQLite; the base's locking, nesting and reader pool are the same for both.

Threading model: the daemon opens one writer ``sqlite3.Connection``
(``check_same_thread=False``) and serialises every use of it with a
re-entrant lock. SQLite allows one writer at a time anyway, our statements
are short, and a single writer makes ``close()`` simple: it takes the same
lock, so it waits for whatever statement is running, and after it every use
raises :class:`StoreClosedError` with a message that says this is a
shutdown-order bug. Other processes (tests, the CLI, a second reader) may
open the same file; WAL mode lets them read while the daemon writes.

Read connections: inside :meth:`Store.reading` the calling thread's
:meth:`~Store.query`, :meth:`~Store.query_one` and :meth:`~Store.connection`
run on a read-only connection (``mode=ro``) instead of the writer, without
the writer's lock, so a read (``runs.list``, ``daemon.status``) never waits
for a write transaction and never holds one up; WAL gives each statement the
latest committed snapshot. The first use in a ``reading()`` block checks a
connection out of a small pool; the block's end gives it back (so a thread
per client connection does not leave a connection per thread behind). A
thread inside a writer :meth:`~Store.transaction` keeps reading from the
writer (it must see its own uncommitted writes); ``transaction()`` is always
the writer. Each read connection has its own lock, which ``close()`` takes
before closing it: a read in progress finishes first, and any later use
raises :class:`StoreClosedError`. A ``:memory:`` store has no second
connection to the same database: there ``reading()`` falls back to the writer.

``transaction()`` is ``BEGIN IMMEDIATE``: the write lock is taken up front,
so a read-then-update (a claim) can never be interleaved with another writer.
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
from pathlib import Path
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
        self._after_commit: list[Callable[[], None]] = []
        self.degraded: str | None = None  # why the database is damaged (see _note_failure)
        self._trace_file = None
        trace_path = os.environ.get("KANDEVD_TRACE_SQL")
        if trace_path:
            # Debug aid (and what the Office gating tests read): every statement, one per line.
            self._trace_file = open(trace_path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115

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


class Store(BaseStore):
    """The SQLite store in the home: one file, WAL, ``BEGIN IMMEDIATE`` writes."""

    #: The class of every connection the store opens (a test may record statements).
    connection_factory: type[sqlite3.Connection] = sqlite3.Connection

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
        conn.set_trace_callback(self._trace_writer)
        self._conn = conn
        if self.path != ":memory:" and os.path.exists(self.path):
            os.chmod(self.path, 0o600)

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
            conn.set_trace_callback(self._trace)
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
        from kandevd.store.retention import db_size_bytes

        return db_size_bytes(self.path)

    def _close_writer(self) -> None:
        try:
            self._conn.execute("PRAGMA optimize")
        except sqlite3.Error:
            pass
        self._conn.close()


def open_store(path: Path | str, **kwargs: Any) -> BaseStore:
    """Open the store and bring its schema up to date.

    ``path``: a SQLite file, or a ``postgresql://`` URL (the shared store).
    """
    from kandevd.store.migrations import migrate

    store: BaseStore
    if isinstance(path, str) and path.startswith(("postgresql://", "postgres://")):
        from kandevd.store.pg import PgStore

        store = PgStore(path)
    else:
        store = Store(path, **kwargs)
    try:
        migrate(store)
    except BaseException:
        store.close()
        raise
    return store
