"""Events pushed to clients, through the real daemon and its socket: a run's events in
order with their times, a schedule's fire and session through ``kandevd events``, a
subscriber that never reads during a drain, and several daemons on PostgreSQL."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kandevd.control.client import Client, RpcCallError
from tests.support.cluster import cluster_config
from tests.support.daemon import DaemonProcess, enqueue, fast_config, run_cli, wait_status
from tests.support.workflows import schedule, write_workflow

pytestmark = pytest.mark.integration

Factory = Callable[..., DaemonProcess]
WAIT_S = 60.0


def setup_agents(daemon: DaemonProcess, count: int = 1, workspace: str = "ws") -> list[str]:
    daemon.call("workspaces.create", {"id": workspace, "name": workspace})
    agents = [f"a{n}" for n in range(1, count + 1)]
    for agent in agents:
        daemon.call("agents.create", {"id": agent, "workspace_id": workspace, "name": agent})
    return agents


def subscribed(daemon: DaemonProcess, *topics: str) -> Iterator[dict[str, Any]]:
    """The notifications of a new subscription to ``topics``."""
    client = Client(daemon.socket)
    answer, stream = client.subscribe(list(topics))
    assert answer["subscription"].startswith("sub-") and answer["topics"] == list(topics)
    return stream


def events_of(stream: Iterator[dict[str, Any]], run_id: str, last: str
              ) -> list[dict[str, Any]]:
    """``run_id``'s events until its ``last`` topic."""
    seen: list[dict[str, Any]] = []
    for message in stream:
        params = message["params"]
        if params.get("data", {}).get("id") == run_id:
            seen.append(params)
            if params["topic"] == last:
                return seen
    raise AssertionError(f"the stream ended before {last} of {run_id}: {seen}")


def test_a_runs_events_arrive_in_order_with_their_times_and_the_run_itself(
        daemon_factory: Factory) -> None:
    daemon = daemon_factory(fast_config())
    setup_agents(daemon)
    stream = subscribed(daemon, "run.*")
    run = enqueue(daemon, "a1")
    seen = events_of(stream, run["id"], "run.finished")
    assert [e["topic"] for e in seen] == ["run.queued", "run.claimed", "run.finished"]
    assert [e["data"]["status"] for e in seen] == ["queued", "claimed", "finished"]
    times = [e["at"] for e in seen]
    assert times == sorted(times) and all(t.endswith("Z") for t in times)
    assert seen[-1]["data"] == daemon.call("runs.get", {"id": run["id"]})


def test_a_failing_run_says_retry_then_failed_and_a_bad_topic_is_refused(
        daemon_factory: Factory) -> None:
    daemon = daemon_factory(fast_config(retry={"delays_s": [0], "jitter": 0},
                                        queue={"max_attempts": 2}))
    setup_agents(daemon)
    with pytest.raises(RpcCallError) as refused:
        Client(daemon.socket).subscribe(["runs.*"])
    assert refused.value.error["data"]["kind"] == "invalid_params"
    assert "'runs.*' matches no topic" in refused.value.error["message"]
    typed = run_cli(daemon.home, "events", "--topic", "runs.*")
    assert typed.returncode == 1
    assert typed.stderr.strip() == "kandevd: --topic: 'runs.*' matches no topic"
    stream = subscribed(daemon, "run.*", "office.run.*")
    run = enqueue(daemon, "a1", exit_code=3)
    seen = events_of(stream, run["id"], "run.failed")
    assert [e["topic"] for e in seen] == ["run.queued", "run.claimed", "run.retry_scheduled",
                                          "run.claimed", "run.failed"]
    assert seen[2]["data"]["retry_count"] == 1 and seen[-1]["data"]["attempt"] == 2


def test_a_subscriber_that_never_reads_slows_nothing_and_is_told_what_it_lost(
        daemon_factory: Factory) -> None:
    daemon = daemon_factory(fast_config(control={"event_buffer": 100},
                                        runtime={"max_concurrent": 4}))
    agents = setup_agents(daemon, 20)
    slow = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    slow.connect(str(daemon.socket))
    slow.sendall(b'{"jsonrpc":"2.0","id":1,"method":"events.subscribe",'
                 b'"params":{"topics":["run.*"]}}\n')
    reader = slow.makefile("rb")
    assert json.loads(reader.readline())["result"]["subscription"]
    items = [{"workspace_id": "ws", "agent_id": agents[n % 20], "reason": "manual",
              "coalesce": False} for n in range(300)]
    daemon.call("runs.enqueue_many", {"runs": items})
    slowest = 0.0

    def drained() -> bool:
        nonlocal slowest
        began = time.monotonic()
        daemon.call("daemon.status")
        slowest = max(slowest, time.monotonic() - began)
        answer = daemon.call("runs.list", {"status": "finished", "limit": 1})
        return bool(answer["total"] == 300)
    daemon.wait_until(drained, timeout=120, what="300 runs drained")
    assert slowest < 1.0, f"daemon.status took {slowest:.2f} s during the drain"
    # now it reads: what it kept, and one count of what it lost where it lost it
    slow.settimeout(WAIT_S)
    events = lost = 0
    while events + lost < 900:
        message = json.loads(reader.readline())
        if message["method"] == "events.lost":
            lost += message["params"]["count"]
        else:
            events += 1
    assert lost > 0 and events + lost == 900
    slow.close()
    assert daemon.call("daemon.status")["state"] == "running"


def test_the_default_buffer_holds_bursts_of_enqueue_many_for_a_subscriber(
        daemon_factory: Factory) -> None:
    """Three batches of 1,000 runs and their cancels, 6,000 events, all published
    before the subscriber reads one (a burst comes faster than any client reads): the
    default buffer (10,000) holds them. With 1,000, even a client reading as fast as
    it could was told of losses."""
    daemon = daemon_factory(fast_config())
    [agent] = setup_agents(daemon)
    daemon.call("agents.update", {"id": agent, "status": "paused"})
    stream = subscribed(daemon, "run.*")
    queued = []
    for _ in range(3):
        items = [{"workspace_id": "ws", "agent_id": agent, "reason": "manual",
                  "coalesce": False} for _ in range(1000)]
        queued += [r["run"]["id"] for r in daemon.call("runs.enqueue_many", {"runs": items})[
            "results"]]
    for run_id in queued:
        daemon.call("runs.cancel", {"id": run_id})
    topics: dict[str, int] = {}
    for message in stream:
        assert message["method"] == "event", message  # (no events.lost)
        topic = message["params"]["topic"]
        topics[topic] = topics.get(topic, 0) + 1
        if topics.get("run.cancelled") == 3000:
            break
    assert topics == {"run.queued": 3000, "run.cancelled": 3000}


def test_kandevd_events_streams_a_session_and_ends_when_the_daemon_stops(
        daemon_factory: Factory, tmp_path: Path) -> None:
    home = tmp_path / "home"
    write_workflow(home / "workspace", "w", [schedule("s", messages=["hello"])])
    daemon = daemon_factory(fast_config(), home=home)
    printer = subprocess.Popen(
        [sys.executable, "-m", "kandevd", "events", "--home", str(home), "--topic",
         "schedule.*", "--topic", "daemon.stopping"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        daemon.wait_until(lambda: daemon.call("daemon.status")["events"]["subscribers"] == 1,
                          what="the subscription")
        job = daemon.call("scheduler.jobs.list")["items"][0]["id"]
        daemon.call("scheduler.jobs.trigger", {"id": job})
        assert printer.stdout is not None
        started = printer.stdout.readline()
        ended = printer.stdout.readline()
        assert f"schedule.session_started id={job} entry_id=" in started
        assert "status=running trigger_source=manual" in started
        assert f"schedule.session_ended id={job} entry_id=" in ended and "status=success" in ended
        daemon.stop()
        rest = printer.stdout.read()
        assert "daemon.stopping pid=" in rest
        assert printer.wait(WAIT_S) == 0
    finally:
        if printer.poll() is None:
            printer.send_signal(signal.SIGINT)
            printer.wait(WAIT_S)


def test_an_unreadable_pause_file_pauses_the_scheduler_and_a_resume_is_told(
        daemon_factory: Factory, tmp_path: Path) -> None:
    home = tmp_path / "home"
    write_workflow(home / "workspace", "w", [schedule("s", messages=["hello"])])
    daemon = daemon_factory(fast_config(), home=home)
    stream = subscribed(daemon, "schedule.paused", "schedule.resumed")
    with pytest.raises(RpcCallError) as refused:  # (a name shown on one line)
        daemon.call("scheduler.config.put", {"globally_paused": True, "paused_by": "a\nb"})
    assert refused.value.error["message"] == ("params.paused_by: 'a\\nb' holds a control "
                                              "character (a line break, a tab...)")
    daemon.call("scheduler.config.put", {"globally_paused": True, "paused_by": "alice"})
    assert next(stream)["params"]["data"]["reason"] == "paused by alice"
    pause_file = home / "workspace" / "config" / "scheduler.json"
    pause_file.write_text("garbage")
    # Whether it was paused is unknown: it stays paused, says why, and reload reports it.
    reloaded = daemon.call("scheduler.reload")
    [problem] = [e for e in reloaded["errors"] if e["path"] == str(pause_file)]
    assert problem["kind"] == "state"
    assert f"; moved aside to {pause_file}.corrupt-" in problem["message"]
    config = daemon.call("scheduler.config.get")
    assert config["globally_paused"] is True
    assert "config/scheduler.json could not be read" in config["paused_by"]
    assert json.loads(pause_file.read_text())["globally_paused"] is True
    daemon.wait_for_line("scheduler paused: ")
    daemon.call("scheduler.config.put", {"globally_paused": False})
    resumed = next(stream)["params"]
    assert resumed["topic"] == "schedule.resumed"
    assert resumed["data"] == {"id": None, "entry_id": None, "status": "resumed",
                               "reason": "resumed by an operator"}
    assert daemon.call("scheduler.config.get")["globally_paused"] is False


def test_on_postgresql_a_subscriber_sees_a_run_another_daemon_ran(
        daemon_factory: Factory, tmp_path: Path, pg_url: str) -> None:
    """One slot per daemon and two held runs: one runs on each daemon, and the
    subscriber on the second sees both in their order."""
    config = cluster_config(pg_url, tmp_path / "probe.jsonl", runtime={"max_concurrent": 1},
                            agents={"default": {"command": None, "timeout_s": 60}})
    first = daemon_factory(config, home=tmp_path / "home-a")
    second = daemon_factory(config, home=tmp_path / "home-b")
    first.call("workspaces.create", {"id": "ws", "name": "ws"})
    for agent in ("a1", "a2"):
        first.call("agents.create", {"id": agent, "workspace_id": "ws", "name": agent})
    stream = subscribed(second, "run.*")
    gate = tmp_path / "go"
    runs = [first.call("runs.enqueue", {"workspace_id": "ws", "agent_id": agent,
                                        "reason": "r", "payload": {"wait_for": str(gate)}}
                       )["run"] for agent in ("a1", "a2")]
    for run in runs:
        wait_status(first, run["id"], "claimed", timeout=WAIT_S)
    gate.touch()
    finished = [wait_status(first, run["id"], "finished", timeout=WAIT_S) for run in runs]
    homes = sorted(Path(run["log_path"]).parents[2].name for run in finished)
    assert homes == ["home-a", "home-b"], homes  # (one on each daemon)
    seen: dict[str, list[str]] = {run["id"]: [] for run in runs}
    for message in stream:
        params = message["params"]
        seen[params["data"]["id"]].append(params["topic"])
        if all(topics[-1:] == ["run.finished"] for topics in seen.values()):
            break
    assert all(topics == ["run.queued", "run.claimed", "run.finished"]
               for topics in seen.values()), seen
