"""Several real daemons on one PostgreSQL database (pgserver): the cluster end to end.

Each daemon has a home of its own and the same ``store.url``. What they must
show: a shared drain where every run executes once and no agent ever runs two
executions at once (read from the agents' own log, not from any daemon), the
claims of a killed daemon finished by the others, one leader with failover,
a cron occurrence fired once, and a wake-up across daemons within milliseconds.
"""

from __future__ import annotations

import itertools
import json
import os
import select
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from kandevd.timeutil import rfc3339, utc_now
from tests.support.cluster import cluster_config, probe_log, wait_for
from tests.support.daemon import DaemonProcess, run_cli
from tests.support.workflows import (
    RECORDER,
    history,
    recorder_config,
    schedule,
    write_workflow,
)

pytestmark = pytest.mark.integration

def assert_serialized(records: list[dict[str, Any]]) -> None:
    """No agent ever had two executions at once (from the agents' own timestamps)."""
    by_agent: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for record in records:
        by_agent[record["agent"]].append((record["start"], record["end"]))
    for agent, spans in by_agent.items():
        spans.sort()
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert start >= end, f"agent {agent} ran two executions at once"


def start_cluster(daemon_factory: Callable[..., DaemonProcess], tmp_path: Path,
                  config: dict[str, Any], count: int) -> list[DaemonProcess]:
    return [daemon_factory(config, home=tmp_path / f"home{n}") for n in range(count)]


def seed(daemon: DaemonProcess, agents: int) -> tuple[str, list[str]]:
    ws = daemon.call("workspaces.create", {"name": "shared"})["id"]
    return ws, [daemon.call("agents.create", {"workspace_id": ws, "name": f"a{i}"})["id"]
                for i in range(agents)]


def claimed_here(daemon: DaemonProcess) -> int:
    """How many runs this daemon claimed since it started (its queue's counter)."""
    return int(daemon.call("daemon.status")["stats"]["queue"]["claimed"])


def finished(daemon: DaemonProcess) -> int:
    return daemon.call("runs.list", {"status": "finished", "limit": 1})["total"]


def test_a_shared_drain_runs_each_run_once_with_agents_serialized_across_daemons(
        daemon_factory: Callable[..., DaemonProcess], tmp_path: Path, pg_url: str) -> None:
    probe_file = tmp_path / "probe.jsonl"
    first, second = start_cluster(daemon_factory, tmp_path,
                                  cluster_config(pg_url, probe_file), 2)
    ws, agents = seed(first, 5)
    total = 40
    for n in range(total):  # the intake is split between the daemons too
        (first if n % 2 else second).call("runs.enqueue", {
            "workspace_id": ws, "agent_id": agents[n % len(agents)], "reason": f"r{n}",
            "payload": {"sleep_s": 0.05}})
    wait_for(lambda: finished(first) == total, 60, "every run finished")
    records = wait_for(lambda: len(probe_log(probe_file)) >= total and probe_log(probe_file), 10,
                       "every probe line")
    assert Counter(r["run"] for r in records) == Counter(
        r["id"] for r in first.call("runs.list", {"limit": 100})["items"])
    assert all(n == 1 for n in Counter(r["run"] for r in records).values())
    assert_serialized(records)
    # Both daemons did part of the work.
    for daemon in (first, second):
        assert claimed_here(daemon) > 0
    status = first.call("daemon.status")
    members = status["cluster"]["daemons"]
    assert len(members) == 2 and all(m["alive"] for m in members)
    leaders = [d.call("daemon.status")["cluster"]["leader"] for d in (first, second)]
    assert sorted(leaders) == [False, True]
    lines = {run_cli(d.home, "status").stdout.splitlines()[-1] for d in (first, second)}
    assert lines == {"cluster  leader; 2 of 2 daemon(s) alive",
                     "cluster  follower; 2 of 2 daemon(s) alive"}
    for daemon in (first, second):
        assert daemon.stop() == 0
        assert "Traceback" not in daemon.log_text


def test_a_killed_daemons_claims_finish_on_the_other(
        daemon_factory: Callable[..., DaemonProcess], tmp_path: Path, pg_url: str) -> None:
    probe_file = tmp_path / "probe.jsonl"
    config = cluster_config(pg_url, probe_file)
    victim = daemon_factory(config, home=tmp_path / "victim")
    ws, agents = seed(victim, 2)
    runs = [victim.call("runs.enqueue", {"workspace_id": ws, "agent_id": agent,
                                         "reason": "long", "payload": {"sleep_s": 30}})["run"]
            for agent in agents]
    wait_for(lambda: victim.call("runs.list", {"status": "claimed", "limit": 1})["total"] == 2,
             10, "both runs claimed by the victim")
    survivor = daemon_factory(config, home=tmp_path / "survivor")
    killed_at = time.monotonic()
    victim.kill9()  # the daemon and its agents: their claims stay behind in the database
    line = survivor.wait_for_line("claimed by a daemon that stopped", timeout=3 + 5 + 5)
    assert time.monotonic() - killed_at < 3 + 5 + 2  # dead_after_s + safety pass (+ slack)
    assert "re-queued" in line
    # Each run is claimed again, here, its lost attempt counted.
    wait_for(lambda: all(survivor.call("runs.get", {"id": r["id"]})["attempt"] == 2
                         for r in runs), 10, "both runs claimed again")
    members = survivor.call("daemon.status")["cluster"]["daemons"]
    dead = [m for m in members if not m["self"]]
    assert dead and not dead[0]["alive"]
    # (The victim's lease may outlive its heartbeat by a beat: the survivor leads after it.)
    wait_for(lambda: survivor.call("daemon.status")["cluster"]["leader"] is True, 10,
             "the survivor leading")
    assert survivor.stop() == 0


def test_a_gracefully_stopped_daemons_interrupted_run_goes_on_elsewhere_uncounted(
        daemon_factory: Callable[..., DaemonProcess], tmp_path: Path, pg_url: str) -> None:
    """A shutdown never uses up an attempt, in a cluster too: the stopping daemon gives
    its interrupted run back to the queue, and another daemon takes it up at once."""
    probe_file = tmp_path / "probe.jsonl"
    config = cluster_config(pg_url, probe_file, runtime={"stop_grace_s": 0.1})
    leaving = daemon_factory(config, home=tmp_path / "leaving")
    ws, [agent] = seed(leaving, 1)
    run = leaving.call("runs.enqueue", {"workspace_id": ws, "agent_id": agent,
                                        "reason": "long", "payload": {"sleep_s": 30}})["run"]
    wait_for(lambda: leaving.call("runs.get", {"id": run["id"]})["status"] == "claimed",
             10, "the run claimed by the daemon about to stop")
    staying = daemon_factory(config, home=tmp_path / "staying")
    assert leaving.stop() == 0
    assert "re-queued 1 run(s) this graceful stop interrupted" in leaving.log_text
    again = wait_for(lambda: (r := staying.call("runs.get", {"id": run["id"]}))["status"]
                     == "claimed" and r, 10, "the run claimed by the other daemon")
    assert again["attempt"] == 1
    assert staying.stop() == 0


def test_a_run_queued_on_one_daemon_wakes_an_idle_one_at_once(
        daemon_factory: Callable[..., DaemonProcess], tmp_path: Path, pg_url: str) -> None:
    """The queuing daemon has no free slot; the other, idle, is woken by NOTIFY."""
    probe_file = tmp_path / "probe.jsonl"
    config = cluster_config(pg_url, probe_file, queue={"safety_interval_s": 60})
    busy = daemon_factory({**config, "runtime": {"max_concurrent": 1, "stop_grace_s": 5}},
                          home=tmp_path / "busy")
    ws, agents = seed(busy, 3)
    busy.call("runs.enqueue", {"workspace_id": ws, "agent_id": agents[0], "reason": "hold",
                               "payload": {"sleep_s": 20}})
    wait_for(lambda: busy.call("runs.list", {"status": "claimed", "limit": 1})["total"] == 1,
             10, "the busy daemon's slot taken")
    idle = daemon_factory(config, home=tmp_path / "idle")
    latencies = []
    for n in range(5):
        run = busy.call("runs.enqueue", {"workspace_id": ws, "agent_id": agents[1 + n % 2],
                                         "reason": f"w{n}", "payload": {"sleep_s": 0}})["run"]
        got = wait_for(lambda run=run: (lambda r: r if r["claimed_at"] else None)(
            idle.call("runs.get", {"id": run["id"]})), 5, "the idle daemon's claim")
        stamp = datetime.fromisoformat
        latencies.append((stamp(got["claimed_at"].replace("Z", "+00:00"))
                          - stamp(got["requested_at"].replace("Z", "+00:00"))).total_seconds())
        wait_for(lambda run=run: idle.call("runs.get", {"id": run["id"]})["status"]
                 == "finished", 10, "the run finished")
    assert max(latencies) < 1.0, latencies  # not the 60 s safety pass
    assert claimed_here(idle) == 5
    for daemon in (idle, busy):
        daemon.kill9()


def test_the_leader_fails_over_and_a_cron_occurrence_fires_once(
        daemon_factory: Callable[..., DaemonProcess], tmp_path: Path, pg_url: str) -> None:
    shared_root = tmp_path / "shared-workflows"
    record = tmp_path / "cron.jsonl"
    write_workflow(shared_root, "w", [schedule("m", "* * * * *")])
    config = cluster_config(pg_url, tmp_path / "probe.jsonl",
                            scheduler={"root": str(shared_root)})
    config["agents"]["default"] = {"command": [sys.executable, RECORDER], "timeout_s": 30,
                                   "env": {"RECORD_FILE": str(record)}}
    daemons = start_cluster(daemon_factory, tmp_path, config, 2)

    def leaders() -> list[DaemonProcess]:
        return [d for d in daemons if d.call("daemon.status")["cluster"]["leader"]]

    [leader] = wait_for(lambda: len(leaders()) == 1 and leaders(), 10, "one leader")
    # The next occurrence fires once, on the leader.
    wait_for(lambda: record.exists() and record.read_text().strip(), 75, "a cron fire")
    time.sleep(2)  # a second fire of the same occurrence would have come by now
    turns = [json.loads(line) for line in record.read_text().splitlines()]
    assert len({turn["stdin"]["session_id"] for turn in turns}) == 1, turns  # one session
    assert {turn["env"]["KANDEVD_HOME"] for turn in turns} == {str(leader.home)}
    entries = history(shared_root / "Workflow" / "w")
    assert [e["trigger_source"] for e in entries] == ["cron"], entries
    follower = next(d for d in daemons if d is not leader)
    leader.kill9()
    wait_for(lambda: follower.call("daemon.status")["cluster"]["leader"], 10,
             "the follower taking over")
    assert follower.stop() == 0


def test_connections_cut_by_the_server_are_replaced_and_the_drain_goes_on(
        daemon_factory: Callable[..., DaemonProcess], tmp_path: Path, pg_url: str) -> None:
    """PostgreSQL ends every kandevd connection (as a restart does): the daemon reconnects,
    LISTENs again, stays the leader or becomes it again, and every run still finishes."""
    import psycopg

    probe_file = tmp_path / "probe.jsonl"
    daemon = daemon_factory(cluster_config(pg_url, probe_file), home=tmp_path / "home")
    ws, agents = seed(daemon, 3)
    for n in range(6):
        daemon.call("runs.enqueue", {"workspace_id": ws, "agent_id": agents[n % 3],
                                     "reason": f"before{n}", "payload": {"sleep_s": 0.2}})
    with psycopg.connect(pg_url, autocommit=True) as admin:
        cut = admin.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE application_name LIKE 'kandevd%' AND pid != pg_backend_pid()"
        ).fetchone()[0]
    assert cut >= 2  # the writer and the listener at least
    daemon.wait_for_line("connection to the database failed", timeout=10)

    def enqueue(n: int) -> bool:
        try:
            daemon.call("runs.enqueue", {"workspace_id": ws, "agent_id": agents[n % 3],
                                         "reason": f"after{n}", "payload": {"sleep_s": 0}})
            return True
        except Exception:  # 'unavailable' until the writer is back
            return False

    for n in range(6):
        wait_for(lambda n=n: enqueue(n), 10, "an enqueue accepted again")
    wait_for(lambda: finished(daemon) == 12, 30, "every run finished")
    assert len({r["run"] for r in probe_log(probe_file)}) >= 6  # the second six, at least
    wait_for(lambda: daemon.call("daemon.status")["cluster"]["leader"], 10, "the leader again")
    assert daemon.stop() == 0
    assert "Traceback" not in daemon.log_text


def test_a_restarted_daemon_adopts_its_agents_and_no_other_daemon_takes_them(
        daemon_factory: Callable[..., DaemonProcess], tmp_path: Path, pg_url: str) -> None:
    """Live restore on PostgreSQL: the daemon of the same host and home adopts the agent its
    killed predecessor left running, while another daemon on the database looks on."""
    probe_file = tmp_path / "probe.jsonl"
    config = cluster_config(pg_url, probe_file, runtime={"adopt_on_restart": True})
    first = daemon_factory(config, home=tmp_path / "home")
    ws, agents = seed(first, 1)
    run = first.call("runs.enqueue", {"workspace_id": ws, "agent_id": agents[0],
                                      "reason": "long",
                                      "payload": {"wait_for": str(tmp_path / "go")}})["run"]
    wait_for(lambda: first.call("runs.get", {"id": run["id"]})["status"] == "claimed"
             and first.agent_pids(), 10, "the run executing on the first daemon")
    # The onlooker joins once the run is claimed, so the claim is certainly the first's.
    other = daemon_factory(config, home=tmp_path / "other")
    first.kill_daemon_only()  # its agent runs on (until it is told to end)
    again = daemon_factory(config, home=tmp_path / "home")
    assert again.call("daemon.status")["runs"]["adopted"] == 1
    (tmp_path / "go").touch()
    wait_for(lambda: again.call("runs.get", {"id": run["id"]})["status"] == "finished", 20,
             "the adopted run finished")
    got = again.call("runs.get", {"id": run["id"]})
    assert got["attempt"] == 1  # never re-queued, never run again
    assert [r["run"] for r in probe_log(probe_file)] == [run["id"]]
    assert other.count_lines("claimed by a daemon that stopped") == 0
    for daemon in (again, other):
        assert daemon.stop() == 0


def test_office_work_happens_once_across_daemons(
        daemon_factory: Callable[..., DaemonProcess], tmp_path: Path, pg_url: str) -> None:
    """Tasks created on either daemon, and tasks no subscriber saw (written straight into
    the database): one task_assigned run each; recovery runs on the leader only."""
    import psycopg

    config = cluster_config(pg_url, tmp_path / "probe.jsonl")
    daemons = start_cluster(daemon_factory, tmp_path, config, 2)
    first = daemons[0]
    first.call("workspaces.create", {"id": "ws1", "name": "One"})
    first.call("agents.create", {"id": "a1", "workspace_id": "ws1", "name": "a1"})
    first.call("workflows.create", {"id": "office", "workspace_id": "ws1", "name": "office",
                                    "style": "office",
                                    "steps": [{"id": "todo", "name": "To do", "agent_id": "a1"}]})
    first.call("workspaces.update", {"id": "ws1", "office_workflow_id": "office"})
    tasks = [f"t{n}" for n in range(6)]
    for n, task in enumerate(tasks):
        daemons[n % 2].call("tasks.create", {"id": task, "workspace_id": "ws1",
                                             "workflow_id": "office", "title": task})
    now = rfc3339(utc_now())
    with psycopg.connect(pg_url, autocommit=True) as conn:
        for task in ("m1", "m2"):
            conn.execute("INSERT INTO tasks (id, workspace_id, workflow_id, step_id, title,"
                         " project_id, state, created_at, updated_at) VALUES"
                         " (%s, 'ws1', 'office', 'todo', 'missed', '', 'TODO', %s, %s)",
                         (task, now, now))
    everything = [*tasks, "m1", "m2"]

    def assigned() -> dict[str, int]:
        found = Counter(r["task_id"] for r in first.call(
            "runs.list", {"reason": "task_assigned", "limit": 100})["items"])
        return found if set(found) == set(everything) else {}

    wait_for(assigned, 30, "a task_assigned run for every task")
    time.sleep(3)  # more Office ticks on the leader: nothing more may be queued
    assert assigned() == dict.fromkeys(everything, 1)
    [leader] = [d for d in daemons if d.call("daemon.status")["cluster"]["leader"]]
    follower = next(d for d in daemons if d is not leader)
    assert leader.call("daemon.status")["stats"]["office"]["ticks"] > 0
    assert follower.call("daemon.status")["stats"]["office"]["ticks"] == 0
    # m1 and m2 (no subscriber saw them); a task whose subscriber's enqueue had not yet
    # committed when the leader looked may be recovered too: still one run each (above)
    assert leader.count_lines("recovered unstarted Office task m1:") == 1
    assert leader.count_lines("recovered unstarted Office task m2:") == 1
    assert follower.count_lines("recovered unstarted Office task") == 0
    for daemon in daemons:
        assert daemon.stop() == 0


def test_a_turn_that_ended_while_its_daemon_was_down_is_recorded_at_its_restart(
        daemon_factory: Callable[..., DaemonProcess], tmp_path: Path, pg_url: str) -> None:
    """On PostgreSQL too: its record is in the home's own turns folder, so the run is
    this home's, and its real end is recorded (it stayed 'interrupted', a failure)."""
    home = tmp_path / "home"
    record = tmp_path / "record.jsonl"
    write_workflow(home / "workspace", "w", [schedule("s", messages=["HOLD", "next"])])
    config = {**recorder_config(record), "store": {"url": pg_url}}
    daemon = daemon_factory(config, home=home)
    daemon.call("scheduler.jobs.trigger", {"id": "workflow:w:s"})
    daemon.wait_until(Path(str(record) + ".held").exists, what="the turn's agent holding")
    [agent] = daemon.agent_pids()
    daemon.kill_daemon_only()
    pidfd = os.pidfd_open(agent)
    try:
        Path(str(record) + ".release").touch()  # it ends while no daemon runs
        assert select.select([pidfd], [], [], 30)[0] == [pidfd]
    finally:
        os.close(pidfd)
    daemon.start()
    daemon.wait_for_line("left running by the previous daemon ended success")
    entry = daemon.call("scheduler.jobs.runs", {"id": "workflow:w:s"})["items"][0]
    assert (entry["status"], entry["error"]) == ("success", None), entry
    job = daemon.call("scheduler.jobs.get", {"id": "workflow:w:s"})
    assert (job["last_status"], job["consecutive_failures"]) == ("success", 0)
    assert not list((home / "turns").iterdir())
