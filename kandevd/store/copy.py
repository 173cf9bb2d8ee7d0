"""Copying a home's SQLite database into an empty PostgreSQL one (``kandevd db migrate``).

The source is read read-only (a ``mode=ro`` connection, one read transaction,
so every table is read from the same snapshot); the caller holds the home's
lock, so no daemon writes it meanwhile. The target is a store opened with
:func:`~kandevd.store.open.open_store` (its schema already created).

Everything is written in ONE target transaction: the target must hold no row
of any copied table (never overwrite, never mix two homes), every table is
copied in foreign-key order in batches of :data:`BATCH_ROWS`, ``runs.seq``'s
identity is moved past the largest copied ``seq``, and the row counts of both
sides are compared before the commit. A failure, or a count that differs,
rolls everything back: the target is left as empty as it was found.

Columns are the ones the SQLite table has (``PRAGMA table_info``), named
explicitly: PostgreSQL's ``rowid`` identity columns (workspaces, agents,
workflows, tasks) are not copied but generated, and rows are inserted in
SQLite's rowid order, so they are numbered in the order the lists show.
Runs keep their ``seq``.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kandevd.store.base import BaseStore
from kandevd.store.migrations.sqlite import MIGRATIONS

#: Every table copied, in foreign-key order (a table after those it refers to).
#: ``schema_migrations`` is not copied: each database records its own schema.
TABLES = (
    "workspaces", "agents", "workflows", "workflow_steps", "tasks", "office_projects",
    "office_routines", "office_budget_policies", "office_budget_alerts", "runs", "run_keys",
    "run_counts", "runners", "runner_stops",
)

#: Tables of the SQLite schema that are deliberately not copied.
#: The turns handed to runners are a running daemon's (its sessions end with it).
NOT_COPIED = ("schema_migrations", "remote_turns", "remote_turn_output")

#: Rows per ``executemany``.
BATCH_ROWS = 1000


class CopyError(Exception):
    """The copy cannot be made; the message says why (nothing was written)."""


class SourceUnusable(CopyError):
    """The SQLite database cannot be read (missing, damaged, an unexpected schema)."""


class TargetNotEmpty(CopyError):
    """The target already holds rows: the copy never overwrites or mixes data."""


@dataclass(frozen=True)
class TablePlan:
    """One table to copy: its SQLite columns, the source's order and its row count."""

    name: str
    columns: tuple[str, ...]
    order_by: str
    rows: int


@dataclass(frozen=True)
class TableCount:
    name: str
    source: int
    target: int

    @property
    def matches(self) -> bool:
        return self.source == self.target


class VerificationFailed(CopyError):
    """The counts differ after the copy; it was rolled back."""

    def __init__(self, counts: list[TableCount]) -> None:
        self.counts = counts
        self.mismatched = [count.name for count in counts if not count.matches]
        super().__init__("row counts differ after the copy: " + ", ".join(
            f"{c.name} ({c.source} in the source, {c.target} in the target)"
            for c in counts if not c.matches))


def _problem(path: Path, what: str) -> SourceUnusable:
    return SourceUnusable(f"database {path}: {what}")


def open_source(path: Path) -> sqlite3.Connection:
    """The home's SQLite database, read-only, inside one read transaction.

    Raises :class:`SourceUnusable` when it is missing, not a kandevd database
    or not at this kandevd's schema version.
    """
    path = Path(path)
    if not path.exists():
        raise _problem(path, "does not exist: nothing to migrate (is --home right?)")
    if path.is_dir():
        raise _problem(path, "is a directory, not a database file")
    if path.stat().st_size == 0:
        raise _problem(path, "is empty (0 bytes): nothing to migrate")
    try:
        conn = sqlite3.connect(path.absolute().as_uri() + "?mode=ro", uri=True,
                               isolation_level=None, timeout=10)
    except sqlite3.Error as exc:
        raise _problem(path, f"cannot be opened: {exc}") from None
    try:
        conn.execute("BEGIN")  # one snapshot for the counts and the rows
        names = {row[0] for row in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")}
        if "schema_migrations" not in names:
            raise _problem(path, "is not a kandevd database (it has no schema_migrations)")
        version = int(conn.execute("SELECT MAX(version) FROM schema_migrations")
                      .fetchone()[0] or 0)
        known = MIGRATIONS[-1][0]
        if version < known:
            raise _problem(path, f"is at schema version {version}, older than this "
                                 f"kandevd's ({known}): start `kandevd serve` on this home "
                                 "once to upgrade it, stop it, then migrate")
        if version > known:
            raise _problem(path, f"is at schema version {version}, newer than this kandevd "
                                 f"knows ({known}): migrate with a kandevd at least as new "
                                 "as the one that wrote it")
        unknown = sorted(names - set(TABLES) - set(NOT_COPIED))
        missing = sorted(set(TABLES) - names)
        if unknown or missing:
            raise _problem(path, "has an unexpected schema ("
                           + "; ".join(filter(None, [
                               unknown and "tables this copy does not know: " + ", ".join(unknown),
                               missing and "missing tables: " + ", ".join(missing)])) + ")")
    except sqlite3.Error as exc:
        conn.close()
        raise _problem(path, f"cannot be read: {exc}") from None
    except BaseException:
        conn.close()
        raise
    return conn


def _target_columns(conn: Any, table: str) -> set[str]:
    rows = conn.execute("SELECT column_name FROM information_schema.columns"
                        " WHERE table_schema = current_schema() AND table_name = ?",
                        (table,)).fetchall()
    return {row[0] for row in rows}


def plan(source: sqlite3.Connection, store: BaseStore) -> list[TablePlan]:
    """What to copy: each table's SQLite columns, present in the target, and its rows.

    Raises :class:`CopyError` if a SQLite column has no place in the target
    (a schema this kandevd's PostgreSQL schema does not match).
    """
    with store.connection() as target:
        present = {table: _target_columns(target, table) for table in TABLES}
    plans = []
    for table in TABLES:
        try:
            info = source.execute(f'PRAGMA table_info("{table}")').fetchall()
            try:
                source.execute(f'SELECT rowid FROM "{table}" LIMIT 0')
                order_by = "rowid"  # insertion order (runs: seq, its alias)
            except sqlite3.OperationalError:  # WITHOUT ROWID: its primary key's order
                keys = sorted((row[5], row[1]) for row in info if row[5])
                order_by = ", ".join(f'"{name}"' for _, name in keys)
            rows = source.execute(f'SELECT COUNT(*) FROM "{table}"').fetchone()[0]
        except sqlite3.Error as exc:
            raise SourceUnusable(f"reading {table} failed: {exc}") from None
        columns = tuple(row[1] for row in info)
        if not present[table]:
            raise CopyError(f"the target has no table {table}: its schema does not match "
                            "this kandevd's")
        lacking = [column for column in columns if column not in present[table]]
        if lacking:
            raise CopyError(f"the target's table {table} has no column "
                            f"{', '.join(lacking)}: its schema does not match this kandevd's")
        plans.append(TablePlan(table, columns, order_by, int(rows)))
    return plans


def _batches(source: sqlite3.Connection, table: TablePlan) -> Iterator[list[tuple[Any, ...]]]:
    columns = ", ".join(f'"{column}"' for column in table.columns)
    cursor = source.execute(f'SELECT {columns} FROM "{table.name}" ORDER BY {table.order_by}')
    while batch := cursor.fetchmany(BATCH_ROWS):
        yield batch


def _read_batches(source: sqlite3.Connection, table: TablePlan
                  ) -> Iterator[list[tuple[Any, ...]]]:
    """The source's rows, a batch at a time; a read error is the source's, named so."""
    batches = _batches(source, table)
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except sqlite3.Error as exc:
            raise SourceUnusable(f"reading {table.name} failed: {exc}") from None
        yield batch


def _count(conn: Any, table: str) -> int:
    return int(conn.execute(f'SELECT COUNT(*) FROM "{table}"').fetchone()[0])


def _source_count(source: sqlite3.Connection, table: str) -> int:
    try:
        return _count(source, table)
    except sqlite3.Error as exc:
        raise SourceUnusable(f"counting {table} failed: {exc}") from None


def copy_tables(source: sqlite3.Connection, store: BaseStore, plans: list[TablePlan], *,
                progress: Callable[[int], None] | None = None) -> list[TableCount]:
    """Copy every planned table into ``store`` in one transaction; the verified counts.

    Raises :class:`TargetNotEmpty` before writing anything if the target holds
    rows, :class:`VerificationFailed` (after rolling back) if a count differs.
    """
    with store.transaction() as conn:
        occupied = [table.name for table in plans
                    if conn.execute(f'SELECT 1 FROM "{table.name}" LIMIT 1').fetchone()]
        if occupied:
            raise TargetNotEmpty("it already holds " + ", ".join(occupied))
        for table in plans:
            columns = ", ".join(f'"{column}"' for column in table.columns)
            marks = ", ".join("?" for _ in table.columns)
            insert = f'INSERT INTO "{table.name}" ({columns}) VALUES ({marks})'
            for batch in _read_batches(source, table):
                conn.executemany(insert, batch)
                if progress is not None:
                    progress(len(batch))
        if store.dialect == "postgresql":
            # Runs kept their seq: the identity goes on after the largest (1 when none).
            conn.execute("SELECT setval(pg_get_serial_sequence('runs', 'seq'),"
                         " COALESCE(MAX(seq), 1), MAX(seq) IS NOT NULL) FROM runs")
        counts = [TableCount(table.name, _source_count(source, table.name),
                             _count(conn, table.name)) for table in plans]
        if not all(count.matches for count in counts):
            raise VerificationFailed(counts)  # rolls the copy back
    return counts
