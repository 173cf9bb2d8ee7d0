"""Which store a config asks for, and whether this installation can open it.

SQLite in the home (``store.url: null``) is the default store. A
``postgresql://`` URL names the shared store several daemons use; it needs
psycopg 3 (``pip install 'kandevd[postgres]'``): without it such a config
is refused at start with one line (exit 78), and the URL's password never
appears in that line.
"""

from __future__ import annotations

import importlib.util

from kandevd.config import Config
from kandevd.net.urls import redact_url

POSTGRES_EXTRA = "pip install 'kandevd[postgres]'"


def backend_problem(config: Config) -> str | None:
    """Why the configured store cannot be used by this installation; None when it can."""
    url = config.store.url
    if url is None:
        return None
    shown = redact_url(url)
    if importlib.util.find_spec("psycopg") is None:
        return (f"store.url: {shown} needs the PostgreSQL driver (psycopg 3), which is not "
                f"installed: {POSTGRES_EXTRA}")
    return None
