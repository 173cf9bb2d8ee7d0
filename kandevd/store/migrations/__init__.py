"""Versioned schema migrations, one schema per database (sqlite.py, postgres.py).

Append new migrations to a schema's ``MIGRATIONS``; never edit an applied one.
"""

from __future__ import annotations

from kandevd.store.base import BaseStore
from kandevd.store.migrations import postgres, sqlite

_SCHEMAS = {"sqlite": sqlite.migrate, "postgresql": postgres.migrate}


def migrate(store: BaseStore) -> int:
    """Apply every pending migration of the store's schema; the resulting version."""
    return _SCHEMAS[store.dialect](store)
