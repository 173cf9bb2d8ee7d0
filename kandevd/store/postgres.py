"""The PostgreSQL store: the shared database several daemons use (``store.url``).

It offers exactly what the SQLite :class:`~kandevd.store.base.Store` offers (the
same :class:`~kandevd.store.base.BaseStore`: one guarded writer connection, a
pool of read connections, nested transactions, after-commit callbacks), so
the repositories, the queue, Office and the control methods run on either
without knowing which.

SQL: the code above the store writes SQL both databases understand, with
SQLite's placeholders (``?`` and ``:name``). :func:`translate` turns a
statement into psycopg's form once (cached) and rewrites the few SQLite
spellings that have no common form: ``x IS ?`` (``IS NOT DISTINCT FROM``),
``json_extract(col, '$.key')`` (``col::jsonb ->> 'key'``) and SQLite's
``INDEXED BY`` hint (dropped: PostgreSQL plans by itself).

Writes: a write transaction takes one transaction-scoped advisory lock
(:data:`WRITER_LOCK`) right after ``BEGIN``, the analogue of SQLite's
``BEGIN IMMEDIATE``. So a read-then-write (a coalescing enqueue, an
idempotency key, an outcome with its cooldown) is atomic across every daemon
sharing the database, exactly as it is inside one SQLite file. Claims, the
hot path of every daemon, do not take it: a claim locks the agents it claims
for (``FOR UPDATE SKIP LOCKED``, see
:meth:`~kandevd.store.runs.claims.Claims.claim_batch`), so daemons claim for
different agents at the same time, and the one-claim-per-agent rule is still
enforced by the database itself (a partial unique index). Transactions are
short (the longest is a batch of 1,000 enqueues), and ``lock_timeout``
bounds a wait as SQLite's busy timeout does.

Errors: psycopg's exceptions are raised as the DB-API classes of
:mod:`sqlite3` (``IntegrityError``, ``OperationalError``), the store's one
error vocabulary; a connection that broke (the server restarted, the network
failed) is :class:`~kandevd.store.base.StoreUnavailable`, which passes like a
busy SQLite file, and the next use opens a new connection.
"""

from __future__ import annotations

import functools
import logging
import re
import select
import sqlite3
import time
from collections.abc import Iterator, Sequence
from typing import Any

import psycopg
from psycopg import errors as pg_errors
from psycopg.pq import TransactionStatus

from kandevd.net.urls import redact_url, scrub_secrets
from kandevd.store.base import BUSY_TIMEOUT_MS, BaseStore, StoreUnavailable

log = logging.getLogger("kandevd.store.pg")

#: The advisory lock namespace of kandevd (``'kand'``) and its locks in it.
LOCK_NAMESPACE = 0x6B616E64
WRITER_LOCK = 1

# A quoted string or identifier or a comment (kept), a ``::`` cast, a placeholder,
# a literal percent sign, or the SQLite spellings rewritten for PostgreSQL.
_TOKEN = re.compile(
    r"""('(?:[^']|'')*'|"(?:[^"]|"")*"|/\*.*?\*/|--[^\n]*)"""  # 1 quoted, or a comment
    r"|(::)"                                          # 2 cast
    r"|(\bIS\s+(?=\?|:[A-Za-z_]))"                    # 3 IS before a placeholder
    r"|(\?)"                                          # 4 positional
    r"|:([A-Za-z_][A-Za-z0-9_]*)"                     # 5 named
    r"|(%)"                                           # 6 percent
    r"|\bjson_extract\(\s*([A-Za-z_.]+)\s*,\s*'\$\.([A-Za-z_][A-Za-z0-9_]*)'\s*\)"  # 7, 8
    r"|(\s+INDEXED\s+BY\s+[A-Za-z_][A-Za-z0-9_]*)",   # 9
    re.IGNORECASE | re.DOTALL,
)


@functools.lru_cache(maxsize=1024)
def translate(sql: str) -> str:
    """``sql`` written for SQLite, in the form psycopg sends to PostgreSQL."""

    def replace(match: re.Match[str]) -> str:
        quoted, cast, is_, positional, named, percent, json_col, json_key, hint = \
            match.groups()
        if quoted is not None:  # psycopg reads placeholders inside quotes and comments too
            return quoted.replace("%", "%%")
        if cast is not None:
            return cast
        if is_ is not None:
            return "IS NOT DISTINCT FROM "
        if positional is not None:
            return "%s"
        if named is not None:
            return f"%({named})s"
        if percent is not None:
            return "%%"
        if json_col is not None:
            return f"({json_col}::jsonb ->> '{json_key}')"
        assert hint is not None
        return ""

    return _TOKEN.sub(replace, sql)


class Row:
    """A result row read like :class:`sqlite3.Row`: by position, by name, ``keys()``."""

    __slots__ = ("_index", "_values")

    def __init__(self, index: dict[str, int], values: Sequence[Any]) -> None:
        self._index = index
        self._values = tuple(values)

    def __getitem__(self, key: int | str) -> Any:
        if isinstance(key, str):
            return self._values[self._index[key]]
        return self._values[key]

    def keys(self) -> list[str]:
        return list(self._index)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Row) and self._values == other._values

    def __hash__(self) -> int:
        return hash(self._values)

    def __repr__(self) -> str:
        return f"Row({dict(zip(self._index, self._values, strict=True))!r})"


#: Column-name index of each result shape seen (a few dozen statements, bounded anyway).
_INDEXES: dict[tuple[bytes, ...], dict[str, int]] = {}
_INDEXES_MAX = 512


def _row_factory(cursor: psycopg.Cursor[Any]) -> Any:
    """Rows as :class:`Row`, their column index built once per result shape.

    Read from the result's field names, not ``cursor.description``, which
    builds a Column object per column on every statement (a third of what a
    statement cost the daemon).
    """
    result = cursor.pgresult
    count = result.nfields if result is not None else 0
    names = tuple(result.fname(i) or b"" for i in range(count)) if result is not None else ()
    index = _INDEXES.get(names)
    if index is None:
        index = {name.decode("utf-8"): i for i, name in enumerate(names)}
        if len(_INDEXES) < _INDEXES_MAX:
            _INDEXES[names] = index
    return functools.partial(Row, index)


def _as_sqlite_error(exc: psycopg.Error, url: str | None = None) -> sqlite3.Error:
    """The DB-API class of :mod:`sqlite3` for a psycopg error (the message kept).

    With ``url`` (a connection attempt), the message is scrubbed of the URL's
    secrets: libpq quotes parts of a URL it cannot use.
    """
    text = str(exc).strip() or type(exc).__name__
    if url is not None:
        text = scrub_secrets(text, url)
    if isinstance(exc, pg_errors.IntegrityError):
        return sqlite3.IntegrityError(text)
    if isinstance(exc, pg_errors.DiskFull):
        return sqlite3.OperationalError(f"database or disk is full: {text}")
    if isinstance(exc, pg_errors.LockNotAvailable | pg_errors.TransactionRollback):
        # A lock wait that timed out, a deadlock the server broke, a serialization
        # failure: busy, like a locked SQLite file; the connection itself is fine.
        return sqlite3.OperationalError(f"database is locked: {text}")
    if isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError):
        return StoreUnavailable(f"PostgreSQL unavailable: {text}")
    return sqlite3.OperationalError(text)


class Connection:
    """A psycopg connection that takes SQLite's placeholders and raises sqlite3's errors.

    ``BEGIN`` costs no round trip of its own: :meth:`begin` holds it back and
    sends it with the transaction's first statement, in one pipeline (one
    network round trip for both); a transaction that ends before any
    statement sends nothing at all. On a database across a network every
    transaction of the queue (a claim, an outcome) is a round trip shorter.
    """

    def __init__(self, raw: psycopg.Connection[Any], trace: Any) -> None:
        self.raw = raw
        self._trace = trace
        self._begin_pending = False
        self._pipelines = psycopg.Pipeline.is_supported()  # libpq >= 14

    def begin(self, *first: tuple[str, Sequence[Any]]) -> None:
        """Start a transaction: ``BEGIN`` with the ``first`` statements (sent at once,
        their results discarded), or, without any, with the next :meth:`execute`."""
        if not self._pipelines:
            self.execute("BEGIN")
            for sql, params in first:
                self.execute(sql, params)
            return
        self._begin_pending = True
        if first:
            self.pipelined(first)

    def execute(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> Any:
        if self._begin_pending:
            if sql in ("COMMIT", "ROLLBACK"):
                self._begin_pending = False
                return None  # nothing was sent: nothing to end
            return self.pipelined([(sql, params)])[0]  # with the BEGIN held back
        self._trace(sql)
        try:
            return self.raw.execute(translate(sql), params)  # type: ignore[arg-type]
        except psycopg.Error as exc:
            raise _as_sqlite_error(exc) from exc

    def pipelined(self, statements: Sequence[tuple[str, Sequence[Any] | dict[str, Any]]]
                  ) -> list[Any]:
        """Run ``statements`` in order, sent together: one round trip for all of them
        (and for a ``BEGIN`` held back). Each is a statement of its own, with a fresh
        snapshot that sees the ones before. Returns their cursors; the first error
        raises (the transaction is then failed, and the statements after it not run)."""
        if not self._pipelines:
            return [self.execute(sql, params) for sql, params in statements]
        begin, self._begin_pending = self._begin_pending, False
        if begin:
            self._trace("BEGIN")
        for sql, _params in statements:
            self._trace(sql)
        try:
            with self.raw.pipeline():
                if begin:
                    self.raw.execute("BEGIN")
                cursors = [self.raw.execute(translate(sql), params)  # type: ignore[arg-type]
                           for sql, params in statements]
        except psycopg.Error as exc:
            raise _as_sqlite_error(exc) from exc
        return cursors

    def executemany(self, sql: str, seq: Sequence[Sequence[Any] | dict[str, Any]]) -> Any:
        if self._begin_pending:
            self._begin_pending = False
            self.execute("BEGIN")
        self._trace(sql)
        try:
            with self.raw.cursor() as cursor:
                cursor.executemany(translate(sql), seq)  # type: ignore[arg-type]
                return cursor
        except psycopg.Error as exc:
            raise _as_sqlite_error(exc) from exc

    @property
    def in_transaction(self) -> bool:
        return self._begin_pending or self.raw.info.transaction_status != TransactionStatus.IDLE

    @property
    def broken(self) -> bool:
        return self.raw.broken or self.raw.closed

    def alive(self) -> bool:
        """Still usable? Checked without a round trip: these connections never LISTEN, so
        an idle one has nothing to read unless the server ended it (a restart or
        ``pg_terminate_backend`` sends a last error message and closes the socket)."""
        if self.broken:
            return False
        try:
            readable, _, _ = select.select([self.raw.fileno()], [], [], 0)
        except (OSError, ValueError, psycopg.Error):
            return False
        return not readable

    def close(self) -> None:
        self._begin_pending = False
        self.raw.close()


#: Every kandevd connection's settings. A daemon that hangs or vanishes inside a
#: transaction must not hold a lock for long: the server ends an idle transaction after
#: a minute and, over TCP, notices a dead client within about half a minute (server
#: keepalives); the client notices a dead server as fast (libpq keepalives and
#: ``tcp_user_timeout``). Unix-socket connections ignore the TCP settings.
_CONNECT_OPTIONS: dict[str, Any] = {
    "autocommit": True, "connect_timeout": 10, "keepalives": 1, "keepalives_idle": 10,
    "keepalives_interval": 5, "keepalives_count": 3, "tcp_user_timeout": 30000,
    # READ COMMITTED whatever the server's or the role's default: a claim relies on each
    # statement's fresh snapshot (see RunRepository._lock_and_claim_pg).
    "options": (f"-c lock_timeout={BUSY_TIMEOUT_MS} -c idle_in_transaction_session_timeout=60000"
                r" -c default_transaction_isolation=read\ committed"
                " -c tcp_keepalives_idle=10 -c tcp_keepalives_interval=5"
                " -c tcp_keepalives_count=3 -c TimeZone=UTC"),
}


def connect_raw(url: str, application_name: str, **kwargs: Any) -> psycopg.Connection[Any]:
    """A plain psycopg connection with kandevd's settings; errors as :mod:`sqlite3`'s,
    their text scrubbed of the URL's secrets."""
    try:
        return psycopg.connect(url, application_name=application_name,
                               **{**_CONNECT_OPTIONS, **kwargs})
    except psycopg.Error as exc:
        raise _as_sqlite_error(exc, url) from None


def connect(url: str, trace: Any, *, application_name: str = "kandevd") -> Connection:
    """A new autocommit connection of the store to ``url`` (a ``postgresql://`` URL)."""
    return Connection(connect_raw(url, application_name, row_factory=_row_factory), trace)


class PgStore(BaseStore):
    """The PostgreSQL store at ``url``; ``path`` is the URL without its password."""

    dialect = "postgresql"
    shared = True

    def __init__(self, url: str) -> None:
        self.url = url
        self.path = redact_url(url)
        self._init_common()
        self.writer_wait_s = 0.0
        self._reconnecting = False  # (the writer's connection broke and is not back yet)
        self._conn = connect(url, self._trace)

    def _writer(self) -> Connection:
        """The writer; a connection that broke is replaced (outside a transaction)."""
        if not self.writing and not self._conn.alive():
            # (said once per outage: each failed reconnection would say it again)
            said = log.debug if self._reconnecting else log.warning
            said("the connection to %s broke; reconnecting", self.path)
            self._reconnecting = True
            broken, self._conn = self._conn, connect(self.url, self._trace)
            log.info("reconnected to %s", self.path)  # (connect raised otherwise)
            self._reconnecting = False
            try:
                broken.close()
            except psycopg.Error:
                pass
        return self._conn

    def _usable(self, conn: Connection) -> bool:
        return conn.alive()

    def _open_reader_connection(self) -> Connection:
        return connect(self.url, self._trace, application_name="kandevd-reader")

    def _begin(self, conn: Connection, exclusive: bool) -> None:
        if not exclusive:
            conn.begin()  # sent with the first statement
            return
        started = time.perf_counter()
        conn.begin(("SELECT pg_advisory_xact_lock(?, ?)", (LOCK_NAMESPACE, WRITER_LOCK)))
        #: Seconds spent waiting for the writer lock (other daemons' transactions).
        self.writer_wait_s += time.perf_counter() - started

    def _in_transaction(self, conn: Connection) -> bool:
        return conn.in_transaction

    def _note_failure(self, exc: BaseException) -> None:
        """PostgreSQL guards its own files: nothing here marks the store damaged."""

    def size_bytes(self) -> int:
        row = self.query_one("SELECT pg_database_size(current_database())")
        return int(row[0]) if row else 0

    def _close_writer(self) -> None:
        try:
            self._conn.close()
        except psycopg.Error:
            pass
