"""The two store backends for tests: SQLite in a temp folder, PostgreSQL from pgserver.

One PostgreSQL server (the ``pgserver`` package: PostgreSQL binaries from
PyPI, no system service) is started once per test session, on first use;
each test gets a database of its own, dropped afterwards. A test module
that takes the ``backend`` fixture runs once per backend.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

BACKENDS = ("sqlite", "postgresql")

_server: Any = None
_server_lock = threading.Lock()


def pg_server(base: Path) -> Any:
    """The session's PostgreSQL server (started on first use)."""
    global _server
    with _server_lock:
        if _server is None:
            os.environ.setdefault("XDG_RUNTIME_DIR", str(base))  # pgserver's runtime files
            import pgserver

            _server = pgserver.get_server(base / "pgdata", cleanup_mode="stop")
        return _server


def stop_pg_server() -> None:
    global _server, _template_ready
    with _server_lock:
        if _server is not None:
            _server.cleanup()
            _server = None
            _template_ready = False


_TEMPLATE = "kandevd_template"
_template_ready = False


def _template(server: Any) -> str:
    """A database with kandevd's schema, copied for each test (much faster than migrating)."""
    global _template_ready
    with _server_lock:
        if not _template_ready:
            import psycopg

            from kandevd.store.open import open_store

            with psycopg.connect(server.get_uri(), autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{_TEMPLATE}"')
                conn.execute(f'CREATE DATABASE "{_TEMPLATE}"')
            open_store(server.get_uri(_TEMPLATE)).close()
            _template_ready = True
    return _TEMPLATE


def new_database(base: Path, *, schema: bool = True) -> tuple[str, str]:
    """A new database on the session's server: ``(url, name)``.

    With ``schema`` it holds kandevd's (empty) schema already, as a daemon
    would leave it after its first start; else it is empty.
    """
    import psycopg

    server = pg_server(base)
    template = f' TEMPLATE "{_template(server)}"' if schema else ""
    name = "t_" + uuid.uuid4().hex[:16]
    with psycopg.connect(server.get_uri(), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"{template}')
    return server.get_uri(name), name


def drop_database(base: Path, name: str) -> None:
    import psycopg

    with psycopg.connect(pg_server(base).get_uri(), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def sqlite_only(store: Any, why: str = "exercises SQLite itself") -> None:
    """Skip the rest of a backend-parametrized test on PostgreSQL, saying why."""
    if store.dialect != "sqlite":
        pytest.skip(f"SQLite only: {why}")


@pytest.fixture(scope="session")
def pg_base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    base = tmp_path_factory.mktemp("pg")
    yield base
    stop_pg_server()


@pytest.fixture
def pg_url(pg_base: Path) -> Iterator[str]:
    """The URL of a new PostgreSQL database with kandevd's schema and no data (dropped
    after the test)."""
    url, name = new_database(pg_base)
    yield url
    drop_database(pg_base, name)


@pytest.fixture
def empty_pg_url(pg_base: Path) -> Iterator[str]:
    """The URL of a new PostgreSQL database without any table (dropped after the test)."""
    url, name = new_database(pg_base, schema=False)
    yield url
    drop_database(pg_base, name)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def store_location(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    """Where a store of the test's backend lives: a SQLite path or a PostgreSQL URL."""
    if backend == "sqlite":
        return str(tmp_path / "kandevd.db")
    return request.getfixturevalue("pg_url")
