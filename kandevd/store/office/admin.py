"""The rows the ``office.*`` methods create, change and list: projects, routines and
budget policies (:mod:`kandevd.control.methods.office`), and the checks of the
references they hold."""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping, Sequence
from typing import Any

from kandevd.store.base import BaseStore

#: The tables the methods own, and the columns a list may be filtered on.
TABLES = {
    "office_projects": ("workspace_id",),
    "office_routines": ("workspace_id", "agent_id", "status"),
    "office_budget_policies": ("workspace_id", "scope_type", "scope_id"),
}


def _table(table: str) -> str:
    if table not in TABLES:
        raise ValueError(f"not a table of the office methods: {table!r}")
    return table


def id_taken(conn: sqlite3.Connection, table: str, ident: str) -> bool:
    """Is ``ident`` an id in ``table`` already?"""
    return conn.execute(f"SELECT 1 FROM {_table(table)} WHERE id = ?",
                        (ident,)).fetchone() is not None


def workspace_exists(conn: sqlite3.Connection, workspace_id: str) -> bool:
    return conn.execute("SELECT 1 FROM workspaces WHERE id = ?",
                        (workspace_id,)).fetchone() is not None


def agent_workspace(conn: sqlite3.Connection, agent_id: str) -> str | None:
    """The workspace ``agent_id`` belongs to; None when there is no such agent."""
    row = conn.execute("SELECT workspace_id FROM agents WHERE id = ?", (agent_id,)).fetchone()
    return None if row is None else str(row["workspace_id"])


def insert(conn: sqlite3.Connection, table: str, row: Mapping[str, Any],
           columns: Sequence[str]) -> sqlite3.Row:
    """Insert ``row``'s ``columns`` into ``table``; the row as written."""
    return conn.execute(
        f"INSERT INTO {_table(table)} ({', '.join(columns)}) VALUES"
        f" ({', '.join(':' + c for c in columns)}) RETURNING *",
        {c: row[c] for c in columns}).fetchone()


def get(conn: sqlite3.Connection, table: str, ident: str) -> sqlite3.Row | None:
    return conn.execute(f"SELECT * FROM {_table(table)} WHERE id = ?", (ident,)).fetchone()


def update(conn: sqlite3.Connection, table: str, ident: str,
           fields: Mapping[str, Any]) -> sqlite3.Row:
    """Set ``fields`` on row ``ident`` of ``table``; the row as written."""
    return conn.execute(
        f"UPDATE {_table(table)} SET {', '.join(f'{k} = :{k}' for k in fields)}"
        " WHERE id = :id RETURNING *", {**fields, "id": ident}).fetchone()


def page(store: BaseStore, table: str, filters: Mapping[str, Any], limit: int,
         offset: int) -> tuple[int, list[sqlite3.Row]]:
    """(how many rows match ``filters``, the page of them), oldest first; a filter whose
    value is None is left out."""
    names = [name for name in TABLES[_table(table)] if filters.get(name) is not None]
    values = [filters[name] for name in names]
    clause = (" WHERE " + " AND ".join(f"{name} = ?" for name in names)) if names else ""
    total = store.query_one(f"SELECT COUNT(*) FROM {table}{clause}", values)[0]
    rows = store.query(f"SELECT * FROM {table}{clause} ORDER BY created_at, id LIMIT ? OFFSET ?",
                       [*values, limit, offset])
    return int(total), rows
