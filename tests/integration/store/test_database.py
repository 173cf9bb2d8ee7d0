"""A broken database gets a clear exit and a way out, never a traceback.

Each broken file is handed to the real ``kandevd serve``: it must exit 74
(EX_IOERR) with one line naming the file and what to do, and leave the file
exactly as it was. Damage found while running is answered ``unavailable``
and shown in ``daemon.status``. ``kandevd db check`` and ``kandevd db backup``
work on the live database.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from kandevd.control.client import RpcCallError
from kandevd.store.open import open_store
from tests.support.daemon import FAST_CONFIG, DaemonProcess, run_cli

pytestmark = pytest.mark.integration

Factory = Callable[..., DaemonProcess]


def serve_once(home: Path) -> subprocess.CompletedProcess[str]:
    """``kandevd serve`` on ``home``, expected to refuse to start."""
    return subprocess.run([sys.executable, "-m", "kandevd", "serve", "--home", str(home)],
                          capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)


def populated_db(path: Path, rows: int = 200, payload_bytes: int = 2000) -> None:
    """A real kandevd database with some data (so truncation or damage hits tables)."""
    store = open_store(path)
    with store.transaction() as conn:
        conn.execute("INSERT INTO workspaces (id, name, office_workflow_id, created_at,"
                     " updated_at) VALUES ('ws', 'ws', '', 'x', 'x')")
        conn.execute("INSERT INTO agents (id, workspace_id, name, profile, cooldown_s, status,"
                     " created_at, updated_at) VALUES ('a1', 'ws', 'a1', 'default', 0,"
                     " 'active', 'x', 'x')")
        for i in range(rows):
            conn.execute("INSERT INTO runs (id, workspace_id, agent_id, reason, payload, status,"
                         " requested_at, updated_at) VALUES (?, 'ws', 'a1', 'r', ?, 'finished',"
                         " 'x', 'x')", (f"run_{i}", json.dumps({"pad": "x" * payload_bytes})))
    store.close()


def assert_refused(home: Path, *expected: str) -> None:
    before = _snapshot(home / "kandevd.db")
    result = serve_once(home)
    assert result.returncode == 74, result.stderr
    assert "Traceback" not in result.stderr
    line = [line for line in result.stderr.splitlines() if "database" in line][-1]
    assert str(home / "kandevd.db") in line
    for text in expected:
        assert text in line, line
    assert _snapshot(home / "kandevd.db") == before  # never rewritten


def _snapshot(path: Path) -> bytes | str:
    if path.is_dir():
        return "dir"
    return path.read_bytes()


@pytest.fixture
def home(tmp_path: Path) -> Path:
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    return home


def test_random_bytes_exit_74(home: Path) -> None:
    (home / "kandevd.db").write_bytes(os.urandom(8192))
    assert_refused(home, "not a SQLite database", ".recover")


def test_a_half_truncated_database_exits_74(home: Path) -> None:
    populated_db(home / "kandevd.db")
    data = (home / "kandevd.db").read_bytes()
    (home / "kandevd.db").write_bytes(data[: len(data) // 2])
    assert_refused(home, "restore a backup")


def test_a_directory_at_the_database_path_exits_74(home: Path) -> None:
    (home / "kandevd.db").mkdir()
    assert_refused(home, "is a directory")


def test_a_zero_byte_database_is_reported_not_reinitialised(home: Path) -> None:
    (home / "kandevd.db").write_bytes(b"")
    assert_refused(home, "is empty (0 bytes)")


def test_pages_damaged_in_the_middle_fail_the_start_check(home: Path) -> None:
    populated_db(home / "kandevd.db")
    path = home / "kandevd.db"
    size = path.stat().st_size
    with open(path, "r+b") as handle:
        handle.seek(size // 2)
        handle.write(os.urandom(4096 * 3))
    assert_refused(home, "restore a backup")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes read-only files anyway")
def test_a_read_only_database_exits_74(home: Path) -> None:
    populated_db(home / "kandevd.db")
    os.chmod(home / "kandevd.db", 0o444)
    assert_refused(home, "read-only")


def test_damage_found_while_running_is_unavailable_not_a_traceback(
        daemon_factory: Factory, tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    # Larger than SQLite's page cache, so reads after the damage reach the disk.
    populated_db(home / "kandevd.db", rows=6000, payload_bytes=3000)
    daemon = daemon_factory(FAST_CONFIG, home=home)
    path = home / "kandevd.db"
    size = path.stat().st_size
    with open(path, "r+b") as handle:
        for fraction in (0.3, 0.5, 0.7):
            handle.seek(int(size * fraction))
            handle.write(b"\xff" * (4096 * 8))  # neither a page header nor UTF-8

    with pytest.raises(RpcCallError) as caught:
        for offset in range(0, 6000, 500):
            daemon.call("runs.list", {"limit": 500, "offset": offset})
    assert caught.value.kind == "unavailable", caught.value.error
    assert caught.value.code == -32000
    status = daemon.call("daemon.status")
    assert status["store"]["status"] == "degraded", (status["store"], caught.value.error)
    assert status["store"]["reason"]
    daemon.wait_for_line("is damaged")
    assert "Traceback" not in daemon.log_text


def test_db_check_and_a_backup_taken_while_runs_are_written(
        daemon_factory: Factory, tmp_path: Path) -> None:
    daemon = daemon_factory(FAST_CONFIG)
    daemon.call("workspaces.create", {"id": "ws", "name": "ws"})
    daemon.call("agents.create", {"id": "a1", "workspace_id": "ws", "name": "a1",
                                  "status": "paused"})
    stop = threading.Event()

    def write() -> None:
        client = daemon.client()
        i = 0
        while not stop.is_set():
            client.call("runs.enqueue", {"workspace_id": "ws", "agent_id": "a1",
                                         "reason": f"r{i}", "coalesce": False})
            i += 1

    writer = threading.Thread(target=write)
    writer.start()
    try:
        daemon.wait_until(lambda: daemon.call("runs.list", {"limit": 1})["total"] > 50,
                          what="runs being written")
        copy = tmp_path / "backup.db"
        result = run_cli(daemon.home, "db", "backup", str(copy))
    finally:
        stop.set()
        writer.join()
    assert result.returncode == 0, result.stderr
    with sqlite3.connect(copy) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        assert conn.execute("SELECT COUNT(*) FROM runs").fetchone()[0] > 50
    again = run_cli(daemon.home, "db", "backup", str(copy))  # (nothing is overwritten)
    assert again.returncode == 73 and "already exists" in again.stderr, again.stderr
    nowhere = run_cli(daemon.home, "db", "backup", str(tmp_path / "no-such-dir" / "b.db"))
    assert nowhere.returncode == 73 and "No such file or directory" in nowhere.stderr

    checked = run_cli(daemon.home, "db", "check")
    assert checked.returncode == 0, checked.stderr
    assert "quick_check: ok" in checked.stdout and "integrity_check: ok" in checked.stdout

    damaged = tmp_path / "damaged"
    damaged.mkdir()
    populated_db(damaged / "kandevd.db")
    size = (damaged / "kandevd.db").stat().st_size
    with open(damaged / "kandevd.db", "r+b") as handle:
        handle.seek(size // 2)
        handle.write(os.urandom(4096 * 3))
    bad = run_cli(damaged, "db", "check")
    assert bad.returncode in (1, 74), bad.stdout + bad.stderr
    assert "Traceback" not in bad.stderr


def test_a_full_disk_at_start_exits_with_the_path(tmp_path: Path) -> None:
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        home = mount / "home"
        home.mkdir(mode=0o700)
        filler = mount / "filler"
        with open(filler, "wb") as handle:
            try:
                while True:
                    handle.write(b"\0" * 65536)
                    handle.flush()
            except OSError:
                pass
        result = serve_once(home)
        assert result.returncode in (73, 74), result.stderr
        assert "Traceback" not in result.stderr
        assert str(home) in result.stderr
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_db_check_and_backup_on_a_postgresql_home_say_so(tmp_path: Path) -> None:
    """Not 'database <home>/kandevd.db: no such file' (exit 74), as if it were lost."""
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    (home / "kandevd.yaml").write_text(
        "store:\n  url: postgresql://kandevd:secret@127.0.0.1:1/kandevd\n")
    for command in (["check"], ["backup", str(tmp_path / "copy.db")]):
        result = run_cli(home, "db", *command)
        assert result.returncode == 1, result.stderr
        assert "this home's store is PostgreSQL (postgresql://kandevd:***@127.0.0.1:1/" \
            "kandevd)" in result.stderr and "secret" not in result.stderr
        assert f"`kandevd db {command[0]}` works on a SQLite home's file" in result.stderr
