"""Store.reading(): reads on read-only connections that never wait for the writer."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kandevd.control.registry import Registry
from kandevd.store.base import MAX_IDLE_READERS, StoreClosedError
from kandevd.store.open import open_store
from kandevd.store.sqlite import Store


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    opened = open_store(tmp_path / "kandevd.db")
    opened.execute("CREATE TABLE t (n INTEGER)")
    opened.execute("INSERT INTO t VALUES (1)")
    yield opened
    opened.close()


def in_thread(fn, timeout: float = 5.0):  # type: ignore[no-untyped-def]
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), "the read waited for the writer"
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box.get("value")


def test_a_read_does_not_wait_for_a_writer_in_a_transaction(store: Store) -> None:
    with store.transaction() as conn:
        conn.execute("INSERT INTO t VALUES (2)")

        def read() -> int:
            with store.reading():
                return store.query_one("SELECT COUNT(*) FROM t")[0]

        assert in_thread(read) == 1  # the last committed state, while the writer holds
        # without reading() the same read waits for the writer's lock
        blocked = threading.Thread(target=lambda: store.query("SELECT 1"))
        blocked.start()
        blocked.join(0.2)
        assert blocked.is_alive()
    blocked.join(5)
    with store.reading():
        assert store.query_one("SELECT COUNT(*) FROM t")[0] == 2  # committed: seen at once


def test_reads_are_on_a_read_only_connection(store: Store) -> None:
    with store.reading(), store.connection() as conn:
        assert conn is not store._conn
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            conn.execute("INSERT INTO t VALUES (3)")
        nested = store.query("SELECT n FROM t")  # nested use of the same connection
        assert [r["n"] for r in nested] == [1]
    assert store.degraded is None  # a refused write is not damage


def test_writes_and_reads_in_a_transaction_stay_on_the_writer(store: Store) -> None:
    with store.reading():
        store.execute("INSERT INTO t VALUES (4)")
        with store.transaction() as conn:
            conn.execute("INSERT INTO t VALUES (5)")
            assert store.query_one("SELECT COUNT(*) FROM t")[0] == 3  # its own write
            with store.connection() as inner:
                assert inner is store._conn
        assert store.query_one("SELECT COUNT(*) FROM t")[0] == 3


def test_statements_on_readers_are_counted(store: Store) -> None:
    before = store.statements
    with store.reading():
        store.query("SELECT 1")
    assert store.statements > before


def test_readers_are_pooled_not_one_per_thread(store: Store) -> None:
    def read() -> None:
        with store.reading():
            store.query("SELECT 1")

    for _ in range(20):
        in_thread(read)
    assert 1 <= store.readers_open <= MAX_IDLE_READERS


def test_close_waits_for_a_read_and_later_reads_raise(store: Store) -> None:
    inside, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            with store.reading():
                with store.connection() as conn:
                    conn.execute("SELECT 1").fetchone()
                    inside.set()
                    release.wait(5)
                    conn.execute("SELECT 2").fetchone()  # still open: close waits for us
                store.query("SELECT 3")
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=reader)
    thread.start()
    assert inside.wait(5)
    closer = threading.Thread(target=store.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive()  # waiting for the read in progress
    release.set()
    closer.join(5)
    thread.join(5)
    assert not closer.is_alive() and not thread.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], StoreClosedError)
    assert store.readers_open == 0
    with pytest.raises(StoreClosedError), store.reading():
        store.query("SELECT 1")


def test_close_with_idle_readers(tmp_path: Path) -> None:
    store = open_store(tmp_path / "kandevd.db")
    def read() -> None:
        with store.reading():
            store.query("SELECT 1")

    in_thread(read)
    read()
    assert store.readers_open >= 1  # idle in the pool
    store.close()
    assert store.readers_open == 0
    with pytest.raises(StoreClosedError), store.reading():
        store.query_one("SELECT 1")


def test_memory_store_reads_from_the_writer() -> None:
    store = Store(":memory:")
    try:
        store.execute("CREATE TABLE t (n INTEGER)")
        store.execute("INSERT INTO t VALUES (1)")
        with store.reading(), store.connection() as conn:
            assert conn is store._conn
            assert store.query_one("SELECT n FROM t")[0] == 1
        assert store.readers_open == 0
    finally:
        store.close()


def test_damage_seen_by_a_reader_degrades_the_store(store: Store) -> None:
    with store.reading(), pytest.raises(sqlite3.DatabaseError), store.connection():
        raise sqlite3.DatabaseError("database disk image is malformed")
    assert store.degraded == "database disk image is malformed"


def test_registry_runs_reads_in_the_reader(store: Store) -> None:
    registry = Registry(reader=store.reading)
    seen: list[sqlite3.Connection] = []

    def grab(_p: object) -> None:
        with store.connection() as conn:
            seen.append(conn)

    registry.add("things.list", grab)
    registry.add("things.explain", grab, reads=True)
    registry.add("things.create", grab)
    for name in ("things.list", "things.explain", "things.create"):
        method = registry.get(name)
        with registry.reading(method):
            method.handler({})
    assert [registry.get(n).reads for n in ("things.list", "things.explain", "things.create")] \
        == [True, True, False]
    assert seen[0] is not store._conn and seen[1] is not store._conn
    assert seen[2] is store._conn
