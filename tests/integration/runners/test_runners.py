"""Runners on other machines, through real processes on loopback: a daemon with its
gateway, ``kandevd runners`` on its socket, and ``kandevd runner`` processes with homes
and configs of their own."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.certs import make_certificate
from tests.support.cluster import cluster_config
from tests.support.console import console_of, request, sign_in
from tests.support.daemon import DaemonProcess, run_cli
from tests.support.runners import add_runner, gateway_config, gateway_url, runner_process
from tests.support.workflows import schedule, write_workflow

pytestmark = pytest.mark.integration

#: What the runner's ``gpu`` profile runs: it says where it ran, then a summary line.
GPU_AGENT = [sys.executable, "-c",
             "import json, os, sys; sys.stdin.read(); print('ran on', os.environ['KANDEVD_HOME']);"
             " print(json.dumps({'summary': 'remote ok', 'cost_cents': 3}))"]


@pytest.fixture
def runners(tmp_path: Path) -> Iterator[Callable[..., DaemonProcess]]:
    made: list[DaemonProcess] = []

    def make(server: str, token_file: Path, name: str, profiles: dict[str, Any],
             start: bool = True, args: tuple[str, ...] = ()) -> DaemonProcess:
        runner = runner_process(tmp_path / f"runner-{name}", server, token_file, profiles,
                                args=args)
        made.append(runner)
        if start:
            runner.start()
        return runner

    yield make
    for runner in made:
        runner.cleanup()


def remote_run(daemon: DaemonProcess, reason: str) -> dict[str, Any]:
    """Workspace ``w`` and agent ``g`` (profile ``gpu``, runs_on ``gpu``), and a run of it."""
    daemon.call("workspaces.create", {"id": "w", "name": "w"})
    daemon.call("agents.create", {"id": "g", "workspace_id": "w", "name": "g",
                                  "profile": "gpu", "runs_on": ["gpu"]})
    return daemon.call("runs.enqueue", {"workspace_id": "w", "agent_id": "g",
                                        "reason": reason})["run"]


def session_ended(daemon: DaemonProcess, job: str) -> dict[str, Any]:
    """``job``'s newest history entry once it no longer runs."""
    def ended() -> Any:
        items = daemon.call("scheduler.jobs.runs", {"id": job})["items"]
        return items[0] if items and items[0]["status"] != "running" else None
    entry: dict[str, Any] = daemon.wait_until(ended, what=f"the end of {job}'s session")
    return entry


def done(daemon: DaemonProcess, run_id: str) -> Callable[[], Any]:
    def check() -> Any:
        run = daemon.call("runs.get", {"id": run_id})
        return run if run["status"] not in ("queued", "claimed") else None
    return check


def test_a_labelled_agent_runs_on_the_runner_and_the_others_stay_here(
        daemon_factory: Callable[..., DaemonProcess], runners: Callable[..., DaemonProcess],
        tmp_path: Path) -> None:
    daemon = daemon_factory(gateway_config())
    server = gateway_url(daemon)
    token = add_runner(daemon, tmp_path / "tokens", "laptop", "gpu", "linux")
    runner = runners(server, token, "laptop", {"gpu": {"command": GPU_AGENT, "timeout_s": 60}})
    daemon.wait_for_line("runner laptop connected")

    daemon.call("workspaces.create", {"id": "w", "name": "w"})
    remote = daemon.call("agents.create", {"id": "g", "workspace_id": "w", "name": "g",
                                           "profile": "gpu", "runs_on": ["gpu"]})
    assert remote["runs_on"] == ["gpu"]
    daemon.call("agents.create", {"id": "l", "workspace_id": "w", "name": "l"})
    there = daemon.call("runs.enqueue", {"workspace_id": "w", "agent_id": "g",
                                         "reason": "remote"})["run"]
    here = daemon.call("runs.enqueue", {"workspace_id": "w", "agent_id": "l",
                                        "reason": "local"})["run"]

    ran = daemon.wait_until(done(daemon, there["id"]), what="the remote run")
    assert (ran["status"], ran["output_summary"], ran["cost_cents"]) == \
        ("finished", "remote ok", 3.0)
    log = Path(ran["log_path"]).read_text()
    assert f"ran on {runner.home}" in log  # the runner's agent, in the server's log
    assert "attempt 1 started" in log and "on runner laptop" in log
    assert "attempt 1 ended" in log and ": succeeded" in log
    logs = run_cli(daemon.home, "runs", "logs", there["id"])
    assert f"ran on {runner.home}" in logs.stdout
    # The server has its log and input now: the runner's copies go (its home stays small).
    runner_logs = runner.home / "logs" / "runs"
    daemon.wait_until(lambda: not [p for p in runner_logs.iterdir()
                                   if p.name.endswith((".log", ".input.json"))],
                      what="the runner's copies of the log and input removed")

    local = daemon.wait_until(done(daemon, here["id"]), what="the local run")
    assert local["status"] == "finished"
    assert "runner" not in Path(local["log_path"]).read_text()

    listed = json.loads(run_cli(daemon.home, "runners", "list", "--json").stdout)
    assert listed["items"] == [{"name": "laptop", "labels": ["gpu", "linux"], "online": True,
                                "last_seen_at": listed["items"][0]["last_seen_at"],
                                "running": 0}]
    assert listed["items"][0]["last_seen_at"] is not None
    assert runner.stop() == 0  # SIGINT: a graceful stop
    assert "runner stopped" in runner.log_text


def test_an_agent_needing_a_label_no_runner_carries_waits(
        daemon_factory: Callable[..., DaemonProcess], runners: Callable[..., DaemonProcess],
        tmp_path: Path) -> None:
    daemon = daemon_factory(gateway_config())
    token = add_runner(daemon, tmp_path / "tokens", "laptop", "linux")
    runners(gateway_url(daemon), token, "laptop",
            {"gpu": {"command": GPU_AGENT, "timeout_s": 60}})
    daemon.call("workspaces.create", {"id": "w", "name": "w"})
    daemon.call("agents.create", {"id": "g", "workspace_id": "w", "name": "g",
                                  "profile": "gpu", "runs_on": ["gpu"]})
    daemon.call("agents.create", {"id": "l", "workspace_id": "w", "name": "l"})
    waiting = daemon.call("runs.enqueue", {"workspace_id": "w", "agent_id": "g",
                                           "reason": "needs a gpu"})["run"]
    later = daemon.call("runs.enqueue", {"workspace_id": "w", "agent_id": "l",
                                         "reason": "local"})["run"]
    daemon.wait_until(done(daemon, later["id"]), what="the local run")  # (not held up)
    assert daemon.call("runs.get", {"id": waiting["id"]})["status"] == "queued"
    explained = daemon.call("runs.explain", {"id": waiting["id"]})
    assert "gpu" in json.dumps(explained)


def test_a_refused_token_exits_77_with_one_line(
        daemon_factory: Callable[..., DaemonProcess], runners: Callable[..., DaemonProcess],
        tmp_path: Path) -> None:
    daemon = daemon_factory(gateway_config())
    bogus = tmp_path / "bogus.token"
    bogus.write_text("kdr_" + "x" * 43)
    bogus.chmod(0o600)
    runner = runners(gateway_url(daemon), bogus, "bogus", {}, start=False)
    runner.start(wait_ready=False)
    assert runner.wait(60) == 77
    assert len(runner.lines) == 1 and "refused this runner's token" in runner.lines[0], \
        runner.log_text  # (CONTRACT 10: one line on stderr)


def test_a_removed_runner_gets_nothing_more_and_exits_77(
        daemon_factory: Callable[..., DaemonProcess], runners: Callable[..., DaemonProcess],
        tmp_path: Path) -> None:
    daemon = daemon_factory(gateway_config())
    token = add_runner(daemon, tmp_path / "tokens", "laptop", "gpu")
    runner = runners(gateway_url(daemon), token, "laptop",
                     {"gpu": {"command": GPU_AGENT, "timeout_s": 60}})
    result = run_cli(daemon.home, "runners", "remove", "laptop")
    assert result.returncode == 0, result.stderr
    assert runner.wait(60) == 77  # its next request (a heartbeat or a poll) is refused
    run = remote_run(daemon, "x")
    assert daemon.call("runs.get", {"id": run["id"]})["status"] == "queued"
    assert daemon.call("runners.list")["items"] == []
    again = runners(gateway_url(daemon), token, "again", {}, start=False)
    again.start(wait_ready=False)
    assert again.wait(60) == 77


def test_a_second_runner_process_with_the_same_token_is_refused_while_the_first_serves(
        daemon_factory: Callable[..., DaemonProcess], runners: Callable[..., DaemonProcess],
        tmp_path: Path) -> None:
    daemon = daemon_factory(gateway_config(dead_after_s=3))
    server = gateway_url(daemon)
    token = add_runner(daemon, tmp_path / "tokens", "box", "gpu")
    started = tmp_path / "started"
    agent = [sys.executable, "-c",
             f"import os, sys, time; sys.stdin.read(); open({str(started)!r}, 'a')"
             ".write(str(os.getpid()) + '\\n'); time.sleep(2); print('done')"]
    profiles = {"gpu": {"command": agent, "timeout_s": 60}}
    first = runners(server, token, "box", profiles)
    run = remote_run(daemon, "once")
    daemon.wait_until(started.exists, what="the agent on the first runner")
    # The same token on another home (a copy of the unit, a test in a terminal): refused,
    # not allowed to take the first one's run as "lost" and have it taken back in turn.
    second = runners(server, token, "box-copy", profiles, start=False)
    second.start(wait_ready=False)
    assert second.wait(60) == 75
    assert "served by another runner home" in second.log_text, second.log_text
    ended = daemon.wait_until(done(daemon, run["id"]), what="the run")
    assert (ended["status"], ended["attempt"]) == ("finished", 1)
    assert len(started.read_text().split()) == 1  # one execution, never two
    # A graceful stop holding nothing says goodbye: offline at once (its last sighting
    # kept), and another home may serve the name at once.
    assert first.stop() == 0
    [listed] = daemon.call("runners.list")["items"]
    assert listed["online"] is False and listed["last_seen_at"] is not None
    daemon.wait_for_line("runner box stopped (offline)")
    runners(server, token, "box-new", profiles)  # (started: it serves)
    assert daemon.call("runners.list")["items"][0]["online"] is True


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@pytest.mark.parametrize("machine", [True, False], ids=["its-machine", "the-process-alone"])
def test_a_runner_killed_mid_run_has_its_run_ended_and_the_next_runner_takes_it(
        daemon_factory: Callable[..., DaemonProcess], runners: Callable[..., DaemonProcess],
        tmp_path: Path, machine: bool) -> None:
    daemon = daemon_factory(gateway_config(dead_after_s=3))
    server = gateway_url(daemon)
    first_ran = tmp_path / "first-ran"
    # The first attempt blocks (until its runner is killed); the second one finishes.
    agent = [sys.executable, "-c",
             f"import os, sys, time; sys.stdin.read(); p = {str(first_ran)!r}\n"
             "if os.path.exists(p): print('second attempt')\n"
             "else:\n open(p, 'w').write(str(os.getpid())); time.sleep(120)"]
    profiles = {"gpu": {"command": agent, "timeout_s": 300}}
    first = runners(server, add_runner(daemon, tmp_path / "tokens", "one", "gpu"), "one",
                    profiles)
    run = remote_run(daemon, "long")
    daemon.wait_until(lambda: daemon.call("runs.get", {"id": run["id"]})["status"]
                      == "claimed" and first_ran.exists() and first_ran.read_text(),
                      what="the first attempt running")
    agent_pid = int(first_ran.read_text())
    if machine:
        first.kill9()  # the runner's machine goes away: its process, its keeper, its agent
    else:  # the runner alone: its keeper stops the agent after half of dead_after_s
        first.kill_daemon_only()

    daemon.wait_for_line("runner one silent for")
    # Stopped as the server gave its run up (half of dead_after_s before, by the runner's
    # keeper or with its machine): a moment's slack for a keeper the machine holds off.
    daemon.wait_until(lambda: not alive(agent_pid), timeout=5, what="the agent stopped")
    rescued = daemon.call("runs.get", {"id": run["id"]})
    assert rescued["status"] == "queued" and "runner one was silent" in \
        rescued["error_message"]
    # The attempt the server took back ends in the run's log too.
    log_lines = (daemon.home / "logs" / "runs" / f"{run['id']}.log").read_text().splitlines()
    [closed] = [line for line in log_lines if "==== attempt 1 ended " in line]
    assert ": error (runner one was silent" in closed
    runners(server, add_runner(daemon, tmp_path / "tokens", "two", "gpu"), "two", profiles)
    ended = daemon.wait_until(done(daemon, run["id"]), what="the second attempt")
    assert (ended["status"], ended["attempt"]) == ("finished", 2), daemon.log_text[-6000:]
    assert "second attempt" in Path(ended["log_path"]).read_text()


def test_the_console_agents_page_shows_the_runners_and_where_an_agent_runs(
        daemon_factory: Callable[..., DaemonProcess], runners: Callable[..., DaemonProcess],
        tmp_path: Path) -> None:
    config = gateway_config()
    config["web"] = {"listen": "127.0.0.1:0"}
    daemon = daemon_factory(config)
    token = add_runner(daemon, tmp_path / "tokens", "gpu-box", "gpu", "linux")
    add_runner(daemon, tmp_path / "tokens", "laptop", "mac")  # never connects
    runners(gateway_url(daemon), token, "gpu-box", {})
    daemon.wait_for_line("runner gpu-box connected")
    daemon.call("workspaces.create", {"id": "w", "name": "w"})
    daemon.call("agents.create", {"id": "g", "workspace_id": "w", "name": "g",
                                  "profile": "coder", "runs_on": ["gpu"]})
    console = console_of(daemon)
    page = request(console, "GET", "/agents", cookie=sign_in(console))
    assert page.status == 200
    rows = page.body.split("<h2>Runners</h2>", 1)[1]
    assert "gpu-box" in rows and "gpu, linux" in rows and "s-online" in rows
    assert "laptop" in rows and "s-offline" in rows and "never" in rows
    assert "on a runner with gpu" in page.body


def test_the_shipped_runner_unit_is_a_valid_systemd_unit(tmp_path: Path) -> None:
    shipped = resources.files("kandevd.conf").joinpath("kandevd-runner.service").read_text()
    assert "runner --server" in shipped and "RestartPreventExitStatus=77" in shipped
    assert "KillMode=process" in shipped  # the keeper stops the agents, not systemd
    kandevd = Path(sys.executable).with_name("kandevd")
    unit = tmp_path / "kandevd-runner.service"
    unit.write_text(shipped.replace("%h/.local/bin/kandevd", str(kandevd)))
    verified = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                              text=True, timeout=60, check=False)
    assert verified.returncode == 0 and verified.stderr == "", verified.stderr


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_the_server_killed_while_a_runner_works_loses_nothing(
        daemon_factory: Callable[..., DaemonProcess], runners: Callable[..., DaemonProcess],
        tmp_path: Path) -> None:
    config = gateway_config()
    config["gateway"]["listen"] = f"127.0.0.1:{free_port()}"  # (the same after the restart)
    daemon = daemon_factory(config)
    started, release = tmp_path / "started", tmp_path / "release"
    agent = [sys.executable, "-c",
             f"import json, os, sys, time; sys.stdin.read(); open({str(started)!r}, 'w')\n"
             f"while not os.path.exists({str(release)!r}): time.sleep(0.05)\n"
             "print('worked through the outage')\n"
             "print(json.dumps({'summary': 'done once', 'cost_cents': 4}))"]
    runner = runners(gateway_url(daemon), add_runner(daemon, tmp_path / "tokens", "box",
                                                     "gpu"), "box",
                     {"gpu": {"command": agent, "timeout_s": 300}})
    run = remote_run(daemon, "long")
    daemon.wait_until(started.exists, what="the agent on the runner")

    daemon.kill9()  # the server's machine: its daemon, its keeper, its own agents
    release.touch()  # the runner's agent ends while no server listens
    runner.wait_for_line("the server cannot be reached")
    daemon.start()
    ended = daemon.wait_until(done(daemon, run["id"]), what="the outcome, reported late")
    assert (ended["status"], ended["attempt"], ended["output_summary"]) == \
        ("finished", 1, "done once")
    assert "worked through the outage" in Path(ended["log_path"]).read_text()
    runner.wait_for_line("the server is reachable again")
    assert daemon.count_lines("re-queued") == 0


def test_a_scheduled_turn_with_runs_on_runs_on_the_runner(
        daemon_factory: Callable[..., DaemonProcess], runners: Callable[..., DaemonProcess],
        tmp_path: Path) -> None:
    home = tmp_path / "home"
    write_workflow(home / "workspace", "reports", [schedule(  # (coder: the runner's only)
        "daily", messages=["hello there"], runs_on=["gpu"])], agent_profile="coder")
    write_workflow(home / "workspace", "local", [schedule("daily", messages=["here"])])
    daemon = daemon_factory(gateway_config(), home=home)
    token = add_runner(daemon, tmp_path / "tokens", "box", "gpu")
    waiting = daemon.call("scheduler.jobs.get", {"id": "workflow:reports:daily"})
    assert waiting["state"] == "blocked" and "runs_on gpu: no runner online" in \
        waiting["state_reason"], waiting
    assert waiting["next_run_at"] is not None  # it fires: its turns wait for a runner
    turn_agent = [sys.executable, "-c",
                  "import json, os, sys; given = json.load(sys.stdin);"
                  " print('turn on', os.environ['KANDEVD_HOME'], given['message']);"
                  " print(json.dumps({'summary': 'remote turn', 'cost_cents': 5}))"]
    runner = runners(gateway_url(daemon), token, "box",
                     {"coder": {"command": turn_agent, "timeout_s": 60}})
    job = daemon.call("scheduler.jobs.get", {"id": "workflow:reports:daily"})
    assert job["runs_on"] == ["gpu"] and job["state"] == "scheduled", job
    daemon.call("scheduler.jobs.trigger", {"id": "workflow:reports:daily"})
    entry = session_ended(daemon, "workflow:reports:daily")
    assert entry["status"] == "success", entry
    first = entry["turns"][0]
    assert (first["status"], first["output"], first["cost_cents"]) == \
        ("success", "remote turn", 5)
    log = Path(first["log_path"]).read_text()
    assert f"turn on {runner.home} hello there" in log  # the runner's agent, here
    logs = run_cli(daemon.home, "jobs", "logs", "workflow:reports:daily")
    assert f"turn on {runner.home}" in logs.stdout


def turns_on_gpu(daemon_factory: Callable[..., DaemonProcess], tmp_path: Path, *,
                 dead_after_s: float) -> DaemonProcess:
    """A daemon with its gateway and a schedule, ``workflow:reports:daily``, whose turns
    run on a runner carrying ``gpu``."""
    home = tmp_path / "home"
    write_workflow(home / "workspace", "reports", [schedule(
        "daily", messages=["work"], runs_on=["gpu"])])
    return daemon_factory(gateway_config(dead_after_s=dead_after_s), home=home)


def turn_on_runner_one(daemon: DaemonProcess, runners: Callable[..., DaemonProcess],
                       tmp_path: Path, next_says: str
                       ) -> tuple[DaemonProcess, dict[str, Any], str]:
    """Runner ``one`` started, ``workflow:reports:daily`` triggered and its turn's agent
    running there (for 2 minutes); the agent of any later execution says ``next_says``.
    The runner, the profiles and the server's URL."""
    first_ran = tmp_path / "first-ran"
    agent = [sys.executable, "-c",
             f"import os, sys, time; sys.stdin.read(); p = {str(first_ran)!r}\n"
             f"if os.path.exists(p): print({next_says!r})\n"
             "else:\n open(p, 'w').close(); print('first part', flush=True);"
             " time.sleep(120)"]
    profiles = {"default": {"command": agent, "timeout_s": 300}}
    server = gateway_url(daemon)
    first = runners(server, add_runner(daemon, tmp_path / "tokens", "one", "gpu"), "one",
                    profiles)
    daemon.call("scheduler.jobs.trigger", {"id": "workflow:reports:daily"})
    daemon.wait_until(first_ran.exists, what="the turn on the first runner")
    return first, profiles, server


def test_a_runner_killed_mid_turn_ends_the_turn_naming_it_and_the_next_takes_the_job(
        daemon_factory: Callable[..., DaemonProcess], runners: Callable[..., DaemonProcess],
        tmp_path: Path) -> None:
    daemon = turns_on_gpu(daemon_factory, tmp_path, dead_after_s=3)
    first, profiles, server = turn_on_runner_one(daemon, runners, tmp_path, "second runner")
    first.kill9()

    def runs() -> list[Any]:
        return daemon.call("scheduler.jobs.runs", {"id": "workflow:reports:daily"})["items"]
    lost = daemon.wait_until(lambda: runs() and runs()[0]["status"] != "running" and
                             runs()[0], what="the session ended")
    assert lost["status"] == "error" and "runner one was silent" in lost["error"], lost
    runners(server, add_runner(daemon, tmp_path / "tokens", "two", "gpu"), "two", profiles)
    daemon.call("scheduler.jobs.trigger", {"id": "workflow:reports:daily"})
    done = daemon.wait_until(lambda: len(runs()) == 2 and runs()[0]["status"] != "running"
                             and runs()[0], what="the next session")
    assert done["status"] == "success", done
    assert "second runner" in Path(done["turns"][0]["log_path"]).read_text()


def test_a_runner_stopped_mid_turn_hands_the_turn_back_and_the_next_runner_ends_it(
        daemon_factory: Callable[..., DaemonProcess], runners: Callable[..., DaemonProcess],
        tmp_path: Path) -> None:
    """A graceful stop of the runner (an upgrade, say) does not fail the session: the
    turn waits for a runner again, as a run is re-queued."""
    daemon = turns_on_gpu(daemon_factory, tmp_path, dead_after_s=30)
    first, profiles, server = turn_on_runner_one(daemon, runners, tmp_path,
                                                 "on the next runner")
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=60) == 0
    daemon.wait_for_line("interrupted on runner one; waiting for a runner again")
    runners(server, add_runner(daemon, tmp_path / "tokens", "two", "gpu"), "two", profiles)
    entry = session_ended(daemon, "workflow:reports:daily")
    assert entry["status"] == "success", entry
    log = Path(entry["turns"][0]["log_path"]).read_text()
    assert "turn interrupted on runner one" in log and "on the next runner" in log, log
    assert log.index("turn interrupted on runner one") < log.index("on the next runner")


def test_a_daemon_stopping_with_no_agent_of_its_own_tells_the_runner_its_turn_ended(
        daemon_factory: Callable[..., DaemonProcess], runners: Callable[..., DaemonProcess],
        tmp_path: Path) -> None:
    """The gateway waits for the runner's next heartbeat (a few seconds at most), which
    says the turn is no longer its: the agent stops then, not once the runner has been
    out of touch for half of dead_after_s."""
    daemon = turns_on_gpu(daemon_factory, tmp_path, dead_after_s=60)
    started = tmp_path / "started"
    agent = [sys.executable, "-c",
             f"import sys, time; sys.stdin.read(); open({str(started)!r}, 'w').close();"
             " time.sleep(120)"]
    runner = runners(gateway_url(daemon), add_runner(daemon, tmp_path / "tokens", "box",
                                                     "gpu"), "box",
                     {"default": {"command": agent, "timeout_s": 300}})
    daemon.call("scheduler.jobs.trigger", {"id": "workflow:reports:daily"})
    daemon.wait_until(started.exists, what="the turn on the runner")
    assert daemon.stop(signal.SIGTERM, timeout=60) == 0
    assert "not every runner holding a turn was heard" not in daemon.log_text
    # (told by the heartbeat the daemon waited for; its fence would take 30 s)
    runner.wait_for_line("no longer this runner's (the server ended it)", timeout=15)
    assert "the server was out of reach" not in runner.log_text


def test_a_runner_restarted_mid_run_adopts_its_agent_and_the_run_is_recorded_once(
        daemon_factory: Callable[..., DaemonProcess], runners: Callable[..., DaemonProcess],
        tmp_path: Path) -> None:
    daemon = daemon_factory(gateway_config())
    started, release = tmp_path / "started", tmp_path / "release"
    agent = [sys.executable, "-c",
             f"import json, os, sys, time; sys.stdin.read(); open({str(started)!r}, 'w')"
             ".write(str(os.getpid()))\n"
             "print('before the restart', flush=True)\n"
             f"while not os.path.exists({str(release)!r}): time.sleep(0.05)\n"
             "print('after the restart')\n"
             "print(json.dumps({'summary': 'adopted and done', 'cost_cents': 2}))"]
    token = add_runner(daemon, tmp_path / "tokens", "box", "gpu")
    profiles = {"gpu": {"command": agent, "timeout_s": 300}}
    first = runners(gateway_url(daemon), token, "box", profiles)
    run = remote_run(daemon, "long")
    daemon.wait_until(lambda: started.exists() and started.read_text(),
                      what="the agent on the runner")
    agent_pid = int(started.read_text())

    first.kill_daemon_only()  # the runner's process alone; its keeper keeps the agent
    assert alive(agent_pid)
    again = runner_process(first.home, gateway_url(daemon), token, profiles)
    again.start()
    try:
        again.wait_for_line("adopted its agent")
        assert alive(agent_pid)
        release.touch()
        ended = daemon.wait_until(done(daemon, run["id"]), what="the adopted run's end")
        assert (ended["status"], ended["attempt"], ended["output_summary"]) == \
            ("finished", 1, "adopted and done")
        log = Path(ended["log_path"]).read_text()
        assert log.count("before the restart") == 1 and "after the restart" in log
        assert log.count("attempt 1 ended") == 1
        assert daemon.count_lines("re-queued") == 0
        assert again.stop() == 0
    finally:
        again.cleanup()


def test_an_agent_its_keeper_stopped_while_no_runner_ran_counts_as_a_failed_attempt(
        daemon_factory: Callable[..., DaemonProcess], runners: Callable[..., DaemonProcess],
        tmp_path: Path) -> None:
    daemon = daemon_factory(gateway_config(dead_after_s=20))
    started = tmp_path / "started"
    agent = [sys.executable, "-c",
             f"import os, sys, time; sys.stdin.read(); open({str(started)!r}, 'w')"
             ".write(str(os.getpid())); time.sleep(300)"]
    token = add_runner(daemon, tmp_path / "tokens", "box", "gpu")
    profiles = {"gpu": {"command": agent, "timeout_s": 600}}
    first = runners(gateway_url(daemon), token, "box", profiles)
    run = remote_run(daemon, "long")
    daemon.wait_until(lambda: started.exists() and started.read_text(),
                      what="the agent on the runner")
    agent_pid = int(started.read_text())
    first.kill_daemon_only()
    daemon.wait_until(lambda: not alive(agent_pid), timeout=20,
                      what="the keeper stopping the agent (after half of dead_after_s)")
    again = runner_process(first.home, gateway_url(daemon), token, profiles)
    again.start()
    try:
        failed = daemon.wait_until(
            lambda: (r := daemon.call("runs.get", {"id": run["id"]}))["status"] != "claimed"
            and r, what="the end reported by the restarted runner")
        assert failed["status"] == "queued" and failed["attempt"] == 1
        assert "stopped by the runner's keeper" in (failed["error_message"] or ""), failed
        assert failed["scheduled_retry_at"] is not None  # a counted, retried attempt
    finally:
        again.cleanup()


def test_a_product_schedule_with_runs_on_sends_its_messages_through_a_runner(
        daemon_factory: Callable[..., DaemonProcess], runners: Callable[..., DaemonProcess],
        tmp_path: Path) -> None:
    home = tmp_path / "home"
    folder = home / "workspace" / "products" / "helper"
    folder.mkdir(parents=True)
    (folder / "product.yaml").write_text(yaml.safe_dump({"profile": {
        "id": "helper", "runtime": {"conversation": {"mode": "singleton"}},
        "schedules": [{"id": "brief", "cron_expression": "0 8 * * *",
                       "timezone": "Europe/Paris", "messages": ["one", "two"],
                       "runs_on": ["gpu"]}]}}))
    daemon = daemon_factory(gateway_config(), home=home)
    turn_agent = [sys.executable, "-c",
                  "import json, os, sys; given = json.load(sys.stdin);"
                  " print('product turn', given['message'], given['user_id']);"
                  " print(json.dumps({'summary': 'said ' + given['message']}))"]
    runners(gateway_url(daemon), add_runner(daemon, tmp_path / "tokens", "box", "gpu"),
            "box", {"default": {"command": turn_agent, "timeout_s": 60}})
    job = "product:helper:brief"
    assert daemon.call("scheduler.jobs.get", {"id": job})["runs_on"] == ["gpu"]
    daemon.call("scheduler.jobs.trigger", {"id": job})
    entry = session_ended(daemon, job)
    assert entry["status"] == "success", entry
    assert [t["output"] for t in entry["turns"]] == ["said one", "said two"]
    assert "product turn one local" in Path(entry["turns"][0]["log_path"]).read_text()


def test_several_daemons_on_postgresql_any_gateway_serves_a_runners_queued_runs(
        daemon_factory: Callable[..., DaemonProcess], runners: Callable[..., DaemonProcess],
        tmp_path: Path, pg_url: str) -> None:
    """The runner talks to one daemon; the run is enqueued on the other, which never hears
    from the runner and must not take it for silent (dead_after_s 4, the agent takes 6 s)."""
    config = cluster_config(pg_url, tmp_path / "probe.jsonl",
                            gateway={"listen": "127.0.0.1:0", "dead_after_s": 4})
    first = daemon_factory(config, home=tmp_path / "home-a")
    second = daemon_factory(config, home=tmp_path / "home-b")
    token = add_runner(first, tmp_path / "tokens", "box", "gpu")
    agent = [sys.executable, "-c", "import sys, time; sys.stdin.read(); time.sleep(6);"
             " print('{\"summary\": \"slow and once\"}')"]
    runners(gateway_url(second), token, "box", {"gpu": {"command": agent, "timeout_s": 60}})
    run = remote_run(first, "through the other")
    ended = first.wait_until(done(first, run["id"]), what="the run through the other daemon")
    assert (ended["status"], ended["attempt"], ended["output_summary"]) == \
        ("finished", 1, "slow and once")
    assert first.count_lines("silent for") == 0 and second.count_lines("silent for") == 0
    assert first.call("runners.list")["items"][0]["online"] is True


def test_several_daemons_on_postgresql_a_cancel_on_one_stops_the_agent_on_a_runner_of_the_other(
        daemon_factory: Callable[..., DaemonProcess], runners: Callable[..., DaemonProcess],
        tmp_path: Path, pg_url: str) -> None:
    """The runner talks to the second daemon; the run is cancelled on the first. The
    agent is stopped, and the agent's next run starts only once it has ended (its stop
    takes a second: the agent writes its end then)."""
    config = cluster_config(pg_url, tmp_path / "probe.jsonl",
                            gateway={"listen": "127.0.0.1:0", "dead_after_s": 8})
    first = daemon_factory(config, home=tmp_path / "home-a")
    second = daemon_factory(config, home=tmp_path / "home-b")
    token = add_runner(first, tmp_path / "tokens", "box", "gpu")
    record = tmp_path / "record.txt"
    agent = [sys.executable, "-c",
             "import json, signal, sys, time\n"
             "given = json.load(sys.stdin)\n"
             f"def note(what):\n    with open({str(record)!r}, 'a') as f:"
             " f.write(what + ' ' + given['reason'] + '\\n')\n"
             "def stop(*_):\n    time.sleep(1); note('end'); sys.exit(143)\n"
             "signal.signal(signal.SIGTERM, stop)\n"
             "note('start')\n"
             "if given['reason'] == 'long': time.sleep(60)\n"
             "note('end'); print(json.dumps({'summary': 'next'}))"]
    runners(gateway_url(second), token, "box", {"gpu": {"command": agent, "timeout_s": 90}})
    run = remote_run(first, "long")
    first.wait_until(lambda: record.exists() and "start long" in record.read_text(),
                     what="the long run's agent on the runner")
    assert first.call("runs.cancel", {"id": run["id"]})["status"] == "cancelled"
    after = first.call("runs.enqueue", {"workspace_id": "w", "agent_id": "g",
                                        "reason": "after"})["run"]
    ended = first.wait_until(done(first, after["id"]), what="the next run")
    assert ended["status"] == "finished", ended
    # Stopped (not run out its 60 s), and one agent at a time.
    assert record.read_text().splitlines() == ["start long", "end long", "start after",
                                               "end after"]


def test_several_daemons_on_postgresql_a_turn_of_a_daemon_without_a_gateway_runs_through_another(
        daemon_factory: Callable[..., DaemonProcess], runners: Callable[..., DaemonProcess],
        tmp_path: Path, pg_url: str) -> None:
    """The session runs on a daemon with no gateway; the runner talks to the other
    daemon, which hands it the turn and takes its output and end (through the database):
    the entry, its output and its log land on the session's daemon."""
    home = tmp_path / "home-a"
    write_workflow(home / "workspace", "reports", [schedule(
        "daily", messages=["far away"], runs_on=["gpu"])])
    config = cluster_config(pg_url, tmp_path / "probe.jsonl")
    first = daemon_factory(config, home=home)
    second = daemon_factory({**config, "gateway": {"listen": "127.0.0.1:0",
                                                   "dead_after_s": 4}},
                            home=tmp_path / "home-b")
    token = add_runner(second, tmp_path / "tokens", "box", "gpu")
    agent = [sys.executable, "-c",
             "import json, os, sys, time; given = json.load(sys.stdin);"
             " print('turn on', os.environ['KANDEVD_HOME'], given['message'], flush=True);"
             " time.sleep(6); print(json.dumps({'summary': 'via b', 'cost_cents': 2}))"]
    runner = runners(gateway_url(second), token, "box",
                     {"default": {"command": agent, "timeout_s": 60}})
    first.wait_until(lambda: first.call("scheduler.jobs.get", {
        "id": "workflow:reports:daily"})["state"] == "scheduled", what="the runner online")
    first.call("scheduler.jobs.trigger", {"id": "workflow:reports:daily"})
    entry = session_ended(first, "workflow:reports:daily")
    assert entry["status"] == "success", entry
    turn = entry["turns"][0]
    assert (turn["status"], turn["output"], turn["cost_cents"]) == ("success", "via b", 2)
    assert f"turn on {runner.home} far away" in Path(turn["log_path"]).read_text()
    assert f"turn on {runner.home}" in run_cli(first.home, "jobs", "logs",
                                               "workflow:reports:daily").stdout
    # (6 s of work, longer than dead_after_s: the daemon that never heard from the
    # runner did not take it for silent)
    assert first.count_lines("silent for") == 0 and second.count_lines("silent for") == 0


def test_over_https_a_runner_trusts_only_the_ca_it_is_given(
        daemon_factory: Callable[..., DaemonProcess], runners: Callable[..., DaemonProcess],
        tmp_path: Path) -> None:
    cert, key = make_certificate(tmp_path, "gateway")
    config = gateway_config()
    config["gateway"].update(tls_cert=str(cert), tls_key=str(key))
    daemon = daemon_factory(config)
    server = gateway_url(daemon)
    assert server.startswith("https://127.0.0.1:")
    token = add_runner(daemon, tmp_path / "tokens", "box", "gpu")
    doubting = runners(server, token, "doubting", {}, start=False)
    doubting.start(wait_ready=False)
    doubting.wait_for_line("the server cannot be reached")  # (its system CAs refuse it)
    assert "CERTIFICATE_VERIFY_FAILED" in doubting.log_text
    runners(server, token, "box", {"gpu": {"command": GPU_AGENT, "timeout_s": 60}},
            args=("--ca-file", str(cert)))
    run = remote_run(daemon, "over https")
    ended = daemon.wait_until(done(daemon, run["id"]), what="the run over https")
    assert (ended["status"], ended["output_summary"]) == ("finished", "remote ok")
    # The gateway's URL given with http://: the runner says the server may speak TLS.
    clear = runners(server.replace("https://", "http://"), token, "clear", {}, start=False)
    clear.start(wait_ready=False)
    said = clear.wait_for_line("the server cannot be reached")
    assert "if the gateway has tls_cert set, use an https:// URL" in said, said
    # A --ca-file that cannot be used is said as such (not as a problem with the home).
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    for name, ca_file, code in (("missing", tmp_path / "none.pem", 66),
                                ("garbage", garbage, 65)):
        bad = runners(server, token, name, {}, start=False, args=("--ca-file", str(ca_file)))
        bad.start(wait_ready=False)
        assert bad.wait(60) == code, bad.log_text
        assert len(bad.lines) == 1 and f"--ca-file {ca_file}" in bad.lines[0], bad.log_text


def test_a_graceful_restart_while_local_agents_end_keeps_the_runners_agents(
        daemon_factory: Callable[..., DaemonProcess], runners: Callable[..., DaemonProcess],
        tmp_path: Path) -> None:
    """The daemon's stop waits runtime.stop_grace_s for its own agents; meanwhile its
    gateway still hears the runners (it hands out nothing more), so a grace longer than
    half of gateway.dead_after_s does not make them take the server for gone and stop
    their agents: the remote run goes on across the restart, one attempt, recorded by
    the next daemon."""
    started, local_started, release = (tmp_path / "started", tmp_path / "local-started",
                                       tmp_path / "release")
    holder = [sys.executable, "-c", "import sys, time; sys.stdin.read(); "
              f"open({str(local_started)!r}, 'w'); time.sleep(300)"]
    config = gateway_config(dead_after_s=12, runtime={"stop_grace_s": 9},
                            agents={"hold": {"command": holder, "timeout_s": 300}})
    config["gateway"]["listen"] = f"127.0.0.1:{free_port()}"  # (the same after the restart)
    daemon = daemon_factory(config)
    agent = [sys.executable, "-c",
             f"import json, os, sys, time; sys.stdin.read(); open({str(started)!r}, 'w')\n"
             f"while not os.path.exists({str(release)!r}): time.sleep(0.05)\n"
             "print(json.dumps({'summary': 'one attempt', 'cost_cents': 1}))"]
    runners(gateway_url(daemon), add_runner(daemon, tmp_path / "tokens", "box", "gpu"),
            "box", {"gpu": {"command": agent, "timeout_s": 300}})
    run = remote_run(daemon, "across the restart")
    daemon.call("agents.create", {"id": "h", "workspace_id": "w", "name": "h",
                                  "profile": "hold"})
    daemon.call("runs.enqueue", {"workspace_id": "w", "agent_id": "h", "reason": "hold"})
    daemon.wait_until(started.exists, what="the agent on the runner")
    daemon.wait_until(local_started.exists, what="the local agent")

    assert daemon.stop(signal.SIGTERM, timeout=60) == 0  # (9 s of grace: > 12 / 2)
    daemon.start()
    release.touch()
    ended = daemon.wait_until(done(daemon, run["id"]), what="the remote run's outcome")
    assert (ended["status"], ended["attempt"], ended["retry_count"],
            ended["output_summary"]) == ("finished", 1, 0, "one attempt"), ended


def test_with_the_gateway_off_no_runner_is_taken_for_online(
        daemon_factory: Callable[..., DaemonProcess], runners: Callable[..., DaemonProcess],
        tmp_path: Path) -> None:
    """A runner seen a moment ago by a daemon that now runs without a gateway (and alone
    on its store) cannot reach it: `runs.explain` says no_runner at once, not after
    dead_after_s."""
    config = gateway_config(dead_after_s=300)
    daemon = daemon_factory(config)
    token = add_runner(daemon, tmp_path / "tokens", "box", "gpu")
    runner = runners(gateway_url(daemon), token, "box", {})
    assert daemon.stop() == 0
    runner.stop()
    del config["gateway"]
    (daemon.home / "kandevd.yaml").write_text(yaml.safe_dump(config))
    daemon.start()
    run = remote_run(daemon, "nobody can take it")
    explained = daemon.call("runs.explain", {"id": run["id"]})
    assert explained["eligible"] is False and "no_runner" in explained["blockers"], explained
