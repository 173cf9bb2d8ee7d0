"""Retention through the real daemon: old terminal runs go with their files, the rest stays.

Runs are executed by the daemon (the built-in echo agent), then aged while it
is stopped (their end moved 60 days back in the database); the next start's
first safety pass prunes them and says so in one log line.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.support.daemon import FAST_CONFIG, DaemonProcess, seed_agents

AGED = "2026-01-01T00:00:00.000000Z"


def enqueue(daemon: DaemonProcess, agent: str, **extra: Any) -> str:
    return daemon.call("runs.enqueue", {"workspace_id": "ws", "agent_id": agent,
                                        "reason": "test", "coalesce": False,
                                        **extra})["run"]["id"]


def test_old_terminal_runs_are_pruned_with_their_files_and_the_rest_is_kept(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    config = {**FAST_CONFIG, "queue": {**FAST_CONFIG["queue"], "retention_days": 30}}
    daemon = daemon_factory(config)
    seed_agents(daemon, "ws", ["a1", "a2", "a3", "a4"])
    seed_agents(daemon, "ws", ["paused"], status="paused")
    old = [enqueue(daemon, agent) for agent in ("a1", "a2", "a3")]
    keyed = enqueue(daemon, "a4", idempotency_key="still-deduplicating")
    queued = enqueue(daemon, "paused")

    def ended() -> bool:
        with daemon.db() as conn:
            return conn.execute("SELECT COUNT(*) FROM runs WHERE status = 'finished'"
                                ).fetchone()[0] == 4
    daemon.wait_until(ended, what="the runs to finish")
    logs = Path(daemon.home) / "logs" / "runs"
    for run_id in [*old, keyed]:
        assert (logs / f"{run_id}.log").exists()
        assert (Path(daemon.home) / "runs" / run_id).is_dir()
    assert daemon.stop() == 0

    with daemon.db() as conn:  # every run is old now, the queued one too
        conn.execute("UPDATE runs SET finished_at = CASE WHEN finished_at IS NULL THEN NULL"
                     " ELSE ? END, updated_at = ?, requested_at = ?", (AGED, AGED, AGED))
    conn.close()
    daemon.start()
    line = daemon.wait_for_line("retention: deleted")
    assert "retention: deleted 3 terminal runs older than 30 days (oldest kept: " in line, line

    with daemon.db() as conn:
        left = {r["id"]: r["status"] for r in conn.execute("SELECT id, status FROM runs")}
    conn.close()
    assert left == {keyed: "finished", queued: "queued"}
    for run_id in old:
        assert not (logs / f"{run_id}.log").exists()
        assert not (Path(daemon.home) / "runs" / run_id).exists()
        assert not (Path(daemon.home) / "attempts" / run_id).exists()
        assert not list((Path(daemon.home) / "attempts").glob(f"{run_id}.*"))
    assert (logs / f"{keyed}.log").exists()
    # The key kept its run: the same request still answers with it.
    again = daemon.call("runs.enqueue", {"workspace_id": "ws", "agent_id": "a4",
                                         "reason": "test", "idempotency_key":
                                         "still-deduplicating"})
    assert again["deduplicated"] and again["run"]["id"] == keyed

    db = daemon.call("daemon.status")["store"]["db"]
    assert db["retention_days"] == 30
    assert db["oldest_run_at"] == AGED
    home_db = Path(daemon.home) / "kandevd.db"
    assert db["size_bytes"] >= home_db.stat().st_size > 0
    assert daemon.count_lines("retention: deleted") == 1  # nothing more to say
    assert daemon.stop() == 0


def test_retention_zero_keeps_every_run(daemon_factory: Callable[..., DaemonProcess]) -> None:
    config = {**FAST_CONFIG, "queue": {**FAST_CONFIG["queue"], "retention_days": 0,
                                       "safety_interval_s": 0.2}}
    daemon = daemon_factory(config)
    seed_agents(daemon, "ws", ["a1"])
    run_id = enqueue(daemon, "a1")
    daemon.wait_until(lambda: daemon.call("runs.get", {"id": run_id})["status"] == "finished",
                      what="the run to finish")
    with daemon.db() as conn:
        conn.execute("UPDATE runs SET finished_at = ?, updated_at = ?", (AGED, AGED))
    conn.close()
    # Several safety passes go by (the loop ticks at least every 0.2 s) ...
    ticks = daemon.call("daemon.status")["stats"]["queue"]["ticks"]
    daemon.wait_until(lambda: daemon.call("daemon.status")["stats"]["queue"]["ticks"]
                      >= ticks + 3, what="three more queue ticks")
    # ... and the run is still there.
    assert daemon.call("runs.get", {"id": run_id})["status"] == "finished"
    assert daemon.call("daemon.status")["store"]["db"]["retention_days"] == 0
    assert daemon.count_lines("retention:") == 0
    assert daemon.stop() == 0
