"""Which store a config asks for, and whether this installation can open it.

SQLite in the home (``store.url: null``) is the store. A ``postgresql://``
URL names the shared store several daemons would use; it needs psycopg 3
(``pip install 'kandevd[postgres]'``), and this version does not open one
yet: such a config is refused at start with one line (exit 78), never
half-used, and the URL's password never appears in that line.
"""

from __future__ import annotations

import importlib.util

from kandevd.config import Config, redact_url

POSTGRES_EXTRA = "pip install 'kandevd[postgres]'"


def backend_problem(config: Config) -> str | None:
    """Why the configured store cannot be used here; None for SQLite (always usable)."""
    url = config.store.url
    if url is None:
        return None
    shown = redact_url(url)
    if importlib.util.find_spec("psycopg") is None:
        return (f"store.url: {shown} needs the PostgreSQL driver (psycopg 3), which is not "
                f"installed: {POSTGRES_EXTRA}")
    return (f"store.url: {shown}: a PostgreSQL store is not supported by this version of "
            "kandevd; remove store.url to use the SQLite database in the home")
