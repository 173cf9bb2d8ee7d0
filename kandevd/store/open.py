"""Opening the configured store: SQLite in the home, or PostgreSQL at a ``postgresql://`` URL."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kandevd.store.base import BaseStore
from kandevd.store.migrations import migrate
from kandevd.store.sqlite import Store


def is_postgresql_url(path: Path | str) -> bool:
    return isinstance(path, str) and path.startswith(("postgresql://", "postgres://"))


def open_store(path: Path | str, **kwargs: Any) -> BaseStore:
    """Open the store and bring its schema up to date.

    ``path``: a SQLite file, or a ``postgresql://`` URL (the shared store; psycopg is
    imported only then).
    """
    store: BaseStore
    if is_postgresql_url(path):
        from kandevd.store.postgres import PgStore  # psycopg: only for a PostgreSQL store

        store = PgStore(str(path))
    else:
        store = Store(path, **kwargs)
    try:
        migrate(store)
    except BaseException:
        store.close()
        raise
    return store
