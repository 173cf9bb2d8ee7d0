"""A runner cut off from its server, and a runner that stops: real processes on loopback,
the runner reaching the gateway through a proxy that can cut the network."""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.support.daemon import DaemonProcess
from tests.support.proxy import PartitionProxy
from tests.support.runners import add_runner, gateway_config, gateway_url, runner_process

pytestmark = pytest.mark.integration


@pytest.fixture
def proxy_to() -> Iterator[Callable[[str], PartitionProxy]]:
    made: list[PartitionProxy] = []

    def make(url: str) -> PartitionProxy:
        parts = urlsplit(url)
        assert parts.hostname is not None and parts.port is not None
        made.append(PartitionProxy((parts.hostname, parts.port)))
        return made[-1]

    yield make
    for proxy in made:
        proxy.close()


def attempt_ended_at(log_text: str, attempt: int) -> datetime:
    """When the server wrote attempt ``attempt`` ended into the run's log."""
    marker = f"==== attempt {attempt} ended "
    [line] = [line for line in log_text.splitlines() if marker in line]
    stamp = line.split(marker, 1)[1].split(":", 3)
    return datetime.fromisoformat(":".join(stamp[:3]).replace("Z", "+00:00"))


def long_agent(started: Path, ended: Path) -> list[str]:
    """An agent that marks its start, runs for 5 minutes, and on SIGTERM writes when it
    ended (UTC) and exits."""
    return [sys.executable, "-c",
            "import datetime, signal, sys, time; sys.stdin.read()\n"
            "def end(*_):\n"
            f" open({str(ended)!r}, 'w').write(datetime.datetime.now("
            "datetime.timezone.utc).isoformat()); sys.exit(1)\n"
            "signal.signal(signal.SIGTERM, end)\n"
            f"open({str(started)!r}, 'w')\n"
            "time.sleep(300)"]


def long_run_on(daemon: DaemonProcess, runner: DaemonProcess, started: Path,
                reason: str) -> dict[str, Any]:
    """The runner started, agent ``g`` (runs_on gpu) with a run whose agent has started."""
    runner.start()
    daemon.call("workspaces.create", {"id": "w", "name": "w"})
    daemon.call("agents.create", {"id": "g", "workspace_id": "w", "name": "g",
                                  "profile": "gpu", "runs_on": ["gpu"]})
    run: dict[str, Any] = daemon.call("runs.enqueue", {"workspace_id": "w", "agent_id": "g",
                                                       "reason": reason})["run"]
    daemon.wait_until(started.exists, what="the agent on the runner")
    return run


def test_a_runner_cut_off_stops_its_agent_before_the_server_gives_its_run_away(
        daemon_factory: Callable[..., DaemonProcess], tmp_path: Path,
        proxy_to: Callable[[str], PartitionProxy]) -> None:
    """The runner's fence does not wait for a heartbeat hanging on the cut network (up to
    10 s): the agent ends (SIGTERM) before the server ends the attempt as a silent
    runner's, so the run never executes twice at once."""
    daemon = daemon_factory(gateway_config(dead_after_s=12))
    proxy = proxy_to(gateway_url(daemon))
    started, ended = tmp_path / "started", tmp_path / "ended"
    agent = long_agent(started, ended)
    runner = runner_process(tmp_path / "runner", f"http://127.0.0.1:{proxy.port}",
                            add_runner(daemon, tmp_path / "tokens", "box", "gpu"),
                            {"gpu": {"command": agent, "timeout_s": 600}},
                            slots=1)  # (busy: no poll of its held on the server)
    try:
        run = long_run_on(daemon, runner, started, "cut off")
        proxy.cut()
        runner.wait_for_line("the server was out of reach for", timeout=60)
        daemon.wait_for_line("runner box was silent for", timeout=60)
        rescued = daemon.wait_until(
            lambda: (r := daemon.call("runs.get", {"id": run["id"]}))["status"] != "claimed"
            and r, what="the run taken back")
        assert "runner box was silent" in rescued["error_message"], rescued
        agent_ended = datetime.fromisoformat(ended.read_text())
        server_ended = attempt_ended_at(
            (daemon.home / "logs" / "runs" / f"{run['id']}.log").read_text(), 1)
        assert agent_ended < server_ended, (agent_ended, server_ended)
        line = runner.wait_for_line("the server was out of reach for")
        silent_s = int(line.split("out of reach for ")[1].split("s", 1)[0])
        assert 6 <= silent_s <= 11, line  # (said as it was: more than half of 12 s)
    finally:
        proxy.heal()
        runner.cleanup()


def test_a_frozen_runner_has_its_agent_stopped_by_its_keeper_before_the_run_is_given_away(
        daemon_factory: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    """SIGSTOP of the runner process (a debugger, a stuck interpreter): it stops nothing
    itself, and its keeper still sees it attached. The keeper's own fence, which the
    runner renews at each look, runs out: the agent ends before the server ends the
    attempt as a silent runner's."""
    daemon = daemon_factory(gateway_config(dead_after_s=12))
    started, ended = tmp_path / "started", tmp_path / "ended"
    agent = long_agent(started, ended)
    runner = runner_process(tmp_path / "runner", gateway_url(daemon),
                            add_runner(daemon, tmp_path / "tokens", "box", "gpu"),
                            {"gpu": {"command": agent, "timeout_s": 600}}, slots=1)
    try:
        run = long_run_on(daemon, runner, started, "frozen")
        # A runner that is in touch renews the fence: its agent runs past the fence its
        # hello armed (half of dead_after_s), heard from by the server meanwhile.
        since = datetime.fromtimestamp(started.stat().st_mtime, UTC)
        daemon.wait_until(lambda: (seen := daemon.call("runners.list")["items"][0][
            "last_seen_at"]) and datetime.fromisoformat(seen.replace("Z", "+00:00"))
            >= since + timedelta(seconds=8), what="the runner heard from 8 s on", timeout=60)
        assert not ended.exists()
        runner.send_signal(signal.SIGSTOP)
        daemon.wait_for_line("runner box was silent for", timeout=60)
        rescued = daemon.wait_until(
            lambda: (r := daemon.call("runs.get", {"id": run["id"]}))["status"] != "claimed"
            and r, what="the run taken back")
        assert ended.exists(), "the agent of a frozen runner ran on"
        agent_ended = datetime.fromisoformat(ended.read_text())
        server_ended = attempt_ended_at(
            (daemon.home / "logs" / "runs" / f"{rescued['id']}.log").read_text(), 1)
        assert agent_ended < server_ended, (agent_ended, server_ended)
        keeper_log = (tmp_path / "runner" / "logs" / "keeper.log").read_text()
        assert "keeper: stopping 1 agent(s): its runner lost touch with its server" \
            in keeper_log and "Traceback" not in keeper_log
    finally:
        runner.send_signal(signal.SIGCONT)
        runner.cleanup()


def test_a_runner_stopped_while_idle_exits_without_waiting_for_its_poll(
        daemon_factory: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    """It says goodbye at once, which answers the poll the server holds for it (10 s):
    it exits within a few seconds, shown offline."""
    daemon = daemon_factory(gateway_config())
    runner = runner_process(tmp_path / "runner", gateway_url(daemon),
                            add_runner(daemon, tmp_path / "tokens", "idle", "gpu"), {})
    try:
        runner.start()
        daemon.wait_for_line("runner idle connected")
        time.sleep(0.5)  # (its first poll reaches the server, which holds it)
        stopped_at = time.monotonic()
        runner.send_signal(signal.SIGTERM)
        assert runner.wait(timeout=30) == 0
        assert time.monotonic() - stopped_at < 6.0, runner.log_text  # (not the poll's 10 s)
        daemon.wait_for_line("runner idle stopped (offline)")
    finally:
        runner.cleanup()
