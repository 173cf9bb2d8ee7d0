"""The keeper through the real daemon: the agents' parent, outliving the daemon, replaced
when it dies, holding time limits alone, ended by a graceful stop; and an execution of an
earlier version (under its shim) adopted after the upgrade."""

from __future__ import annotations

import itertools
import json
import os
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from kandevd.keeper.journal import read as read_journal
from kandevd.runtime import attempts, shim
from kandevd.runtime.records import ExecutionRecord, write_record
from kandevd.timeutil import after, rfc3339
from tests.support.daemon import DaemonProcess, enqueue, fast_config, wait_status

pytestmark = pytest.mark.integration

Factory = Callable[..., DaemonProcess]
WAIT_S = 60.0


def setup(daemon: DaemonProcess, agents: list[str]) -> None:
    daemon.call("workspaces.create", {"id": "ws", "name": "ws"})
    for agent in agents:
        daemon.call("agents.create", {"id": agent, "workspace_id": "ws", "name": agent})


def windows(touch: Path) -> dict[str, list[tuple[str, str]]]:
    """Each run's successful executions, as the echo agent wrote them: (start, end)."""
    found: dict[str, list[tuple[str, str]]] = {}
    if touch.exists():
        for line in touch.read_text().splitlines():
            run_id, start, end = line.split()
            found.setdefault(run_id, []).append((start, end))
    return found


def parent_of(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_bytes()
    return int(stat[stat.rindex(b")") + 2:].split()[1])


def keeper_of(daemon: DaemonProcess) -> dict[str, Any]:
    return daemon.call("daemon.status")["runtime"]["keeper"]


def test_an_agent_is_the_keepers_own_child_with_no_shell_between(
        daemon_factory: Factory, tmp_path: Path) -> None:
    daemon = daemon_factory(fast_config(agents={"default": {"env": {"FROM_PROFILE": "p"}}}),
                            env={"FROM_DAEMON": "d", "FROM_PROFILE": "overridden"})
    setup(daemon, ["a1"])
    run = enqueue(daemon, "a1", wait_for=str(tmp_path / "go"))
    [agent] = daemon.wait_until(daemon.agent_pids, what="the agent")
    # its environment: the daemon's, the profile's over it, then the run's own
    environ = dict(item.split(b"=", 1) for item in
                   Path(f"/proc/{agent}/environ").read_bytes().split(b"\0") if item)
    assert (environ[b"FROM_DAEMON"], environ[b"FROM_PROFILE"]) == (b"d", b"p")
    assert environ[b"KANDEVD_RUN_ID"] == run["id"].encode()
    assert environ[b"PATH"] == os.environ["PATH"].encode()
    # (the agent is in /proc a moment before the keeper's word of its spawn is read)
    keeper = daemon.wait_until(lambda: (k := keeper_of(daemon))["agents"] == 1 and k,
                               what="the keeper counting the agent")
    assert parent_of(agent) == keeper["pid"]
    argv = Path(f"/proc/{agent}/cmdline").read_bytes().split(b"\0")
    assert argv[1:3] == [b"-m", b"kandevd.agents.echo"]  # the profile's argv, as is
    assert os.getsid(agent) == os.getpgid(agent) == agent  # its own session and group
    assert os.getsid(keeper["pid"]) != os.getsid(daemon.proc.pid)  # not the daemon's
    assert daemon.keeper_pids() == [keeper["pid"]]
    (tmp_path / "go").touch()
    assert wait_status(daemon, run["id"], "finished",
                       timeout=WAIT_S)["output_summary"] == "echoed run"
    assert daemon.wait_until(lambda: keeper_of(daemon)["agents"] == 0, what="no agent")


def test_a_keeper_killed_mid_drain_is_replaced_and_every_run_runs_once(
        daemon_factory: Factory, tmp_path: Path) -> None:
    touch = tmp_path / "windows"
    daemon = daemon_factory(fast_config(runtime={"max_concurrent": 2}))
    setup(daemon, ["a1", "a2", "a3"])
    runs = [enqueue(daemon, f"a{1 + i % 3}", sleep_s=1.5, touch=str(touch))
            for i in range(9)]
    daemon.wait_until(lambda: len(daemon.agent_pids()) == 2, what="two agents running")
    [old] = daemon.kill_keeper()
    daemon.wait_for_line("the keeper ended unexpectedly; starting another")
    for run in runs:
        wait_status(daemon, run["id"], "finished", timeout=WAIT_S)
    keeper = keeper_of(daemon)
    assert keeper["pid"] != old and keeper["restarts"] == 1
    spans = windows(touch)
    assert {run_id: len(s) for run_id, s in spans.items()} == {r["id"]: 1 for r in runs}
    # never two executions of one agent at once
    by_agent: dict[str, list[tuple[str, str]]] = {}
    for run in runs:
        by_agent.setdefault(run["agent_id"], []).extend(spans[run["id"]])
    for agent_spans in by_agent.values():
        ordered = sorted(agent_spans)
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(ordered))
    with daemon.db() as conn:
        assert conn.execute("SELECT max(retry_count) FROM runs").fetchone()[0] == 0


def test_an_exit_a_wedged_keeper_does_not_report_is_read_by_the_daemon(
        daemon_factory: Factory, tmp_path: Path) -> None:
    """The daemon waits for the keeper's word of an exit; a keeper that is alive but
    says nothing (stopped here) does not hold the run: the daemon reads the exit from
    the agent it follows itself, within seconds."""
    daemon = daemon_factory(fast_config())
    setup(daemon, ["a1"])
    go = tmp_path / "go"
    run = enqueue(daemon, "a1", wait_for=str(go))
    daemon.wait_until(daemon.agent_pids, what="the agent")
    keeper = keeper_of(daemon)["pid"]
    os.kill(keeper, signal.SIGSTOP)
    try:
        go.touch()
        finished = wait_status(daemon, run["id"], "finished", "failed", timeout=WAIT_S)
        assert finished["status"] == "finished"
        daemon.wait_for_line("the keeper did not report the exit of agent")
    finally:
        os.kill(keeper, signal.SIGCONT)
    again = enqueue(daemon, "a1")
    assert wait_status(daemon, again["id"], "finished",
                       timeout=WAIT_S)["output_summary"] == "echoed run"


def test_a_spawn_the_dying_keeper_never_read_is_refused_and_retried_not_left_waiting(
        daemon_factory: Factory, tmp_path: Path) -> None:
    """The keeper dies with a spawn request still unread: the keeper that replaces it
    has no word of it, and nothing was started. The execution is refused (a failed
    attempt under the retry policy) instead of waiting for an answer for ever."""
    touch = tmp_path / "windows"
    daemon = daemon_factory(fast_config(retry={"delays_s": [0], "jitter": 0}))
    setup(daemon, ["a1"])
    keeper = keeper_of(daemon)["pid"]
    os.kill(keeper, signal.SIGSTOP)  # (it reads nothing more: the request waits unread)
    try:
        run = enqueue(daemon, "a1", touch=str(touch))
        wait_status(daemon, run["id"], "claimed", timeout=WAIT_S)
        # its stdout file is created just before the request is sent
        daemon.wait_until(lambda: list((daemon.home / "attempts").glob(
            f"{run['id']}.*.stdout")), what="the spawn request about to be sent")
    finally:
        os.kill(keeper, signal.SIGKILL)  # (a stopped process dies of it too; it may be
        # reaped at once, so no signal may follow)
    finished = wait_status(daemon, run["id"], "finished", timeout=WAIT_S)
    assert list(windows(touch)) == [run["id"]] and len(windows(touch)[run["id"]]) == 1
    if finished["attempt"] == 2:  # (else the request went out only to the new keeper)
        assert finished["retry_count"] == 1
        # (the request unread when the keeper died; or, when the kill came just before
        # it went out, refused at once: either way a failed attempt, retried)
        daemon.wait_until(lambda: "the keeper ended before it started the agent"
                          in daemon.log_text or "the keeper cannot be reached"
                          in daemon.log_text, what="the refusal in the log")


def test_daemon_and_keeper_killed_together_lose_nothing_and_run_nothing_twice(
        daemon_factory: Factory, tmp_path: Path) -> None:
    touch = tmp_path / "windows"
    home = tmp_path / "home"
    first = daemon_factory(fast_config(), home=home)
    setup(first, ["long", "short"])
    long_run = enqueue(first, "long", wait_for=str(tmp_path / "go"), touch=str(touch))
    short_run = enqueue(first, "short", wait_for=str(tmp_path / "short-go"), touch=str(touch))
    first.wait_until(lambda: len(first.agent_pids()) == 2, what="both agents running")
    short_pid = next(p for p in first.agent_pids()
                     if short_run["id"].encode() in Path(f"/proc/{p}/environ").read_bytes())
    os.kill(first.proc.pid, signal.SIGKILL)
    first.kill_keeper()
    first.wait()
    # While neither runs: the short agent ends on its own, the long one runs on.
    (tmp_path / "short-go").touch()
    first.wait_until(lambda: not _running(short_pid), what="the short agent to end")
    assert len(first.agent_pids()) == 1
    second = daemon_factory(fast_config(), home=home)
    second.wait_for_line(f"run {long_run['id']}: adopted its agent")
    (tmp_path / "go").touch()
    finished = wait_status(second, long_run["id"], "finished", timeout=WAIT_S)
    assert finished["retry_count"] == 0
    short = wait_status(second, short_run["id"], "finished", timeout=WAIT_S)
    spans = windows(touch)
    assert len(spans[long_run["id"]]) == 1
    # Whether its exit is still known depends on this machine's init: the zombie the
    # short agent left keeps it until init reaps it.
    if "recording the outcome its execution left" in second.log_text:  # read from it
        assert short["attempt"] == 1 and len(spans[short_run["id"]]) == 1
    else:  # reaped meanwhile: its outcome is unknown, so it is re-queued and runs again
        assert short["attempt"] == 2 and len(spans[short_run["id"]]) == 2


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


def test_a_time_limit_holds_while_no_daemon_runs(daemon_factory: Factory,
                                                  tmp_path: Path) -> None:
    home = tmp_path / "home"
    cfg = fast_config(agents={"default": {"timeout_s": 3}}, retry={"max_retries": 0})
    first = daemon_factory(cfg, home=home)
    setup(first, ["a1"])
    run = enqueue(first, "a1", wait_for=str(tmp_path / "never"))
    [agent] = first.wait_until(first.agent_pids, what="the agent")
    first.kill_daemon_only()
    first.wait_until(lambda: not _running(agent), timeout=30, what="the keeper to stop it")

    def journaled_exits() -> list[dict]:
        return [e.exit for e in read_journal(home / "keeper" / "journal").values()
                if e.meta.get("run_id") == run["id"] and e.exit]

    # (The keeper journals the exit once it reaped the agent, a moment after it ended.)
    ended = first.wait_until(journaled_exits, what="the keeper to journal the exit")
    assert ended[0]["by"] == "timed_out"
    second = daemon_factory(cfg, home=home)
    failed = wait_status(second, run["id"], "failed", timeout=WAIT_S)
    assert "timed out after 3.0s" in failed["error_message"]


@pytest.mark.parametrize("keep", [False, True])
def test_a_graceful_stop_ends_the_keeper_unless_agents_are_kept(
        daemon_factory: Factory, tmp_path: Path, keep: bool) -> None:
    daemon = daemon_factory(fast_config(runtime={"keep_agents_on_stop": keep}))
    setup(daemon, ["a1"])
    enqueue(daemon, "a1", wait_for=str(tmp_path / "never"))
    daemon.wait_until(daemon.agent_pids, what="the agent")
    [keeper] = daemon.keeper_pids()
    assert daemon.stop() == 0
    if keep:
        assert daemon.keeper_pids() == [keeper] and daemon.agent_pids()
    else:
        assert daemon.wait_until(lambda: not daemon.keeper_pids(), what="the keeper to end")
        assert daemon.agent_pids() == []


def test_an_execution_an_earlier_version_started_under_its_shim_is_adopted(
        daemon_factory: Factory, tmp_path: Path) -> None:
    """As a daemon before the keeper left it: the agent under a ``sh`` shim, the attempt's
    ``record.json`` naming the shim, the run claimed by that daemon's instance."""
    touch = tmp_path / "windows"
    home = tmp_path / "home"
    daemon = daemon_factory(fast_config(), home=home)
    setup(daemon, ["a1"])
    daemon.call("agents.update", {"id": "a1", "status": "paused"})
    run = enqueue(daemon, "a1", wait_for=str(tmp_path / "go"), touch=str(touch))
    assert daemon.stop() == 0
    token = f"legacy.{run['seq']}"
    now = datetime.now(UTC)
    with sqlite3.connect(home / "kandevd.db") as conn:
        conn.execute("UPDATE runs SET status = 'claimed', claim_token = ?, claimed_by = ?,"
                     " claimed_at = ?, attempt = 1 WHERE id = ?",
                     (token, "an-earlier-version", rfc3339(now), run["id"]))
        conn.execute("UPDATE agents SET status = 'active' WHERE id = 'a1'")
    folder = attempts.attempt_dir(home / "attempts", run["id"], token)
    attempts.prepare(folder)
    log_path = home / "logs" / "runs" / f"{run['id']}.log"
    input_path = log_path.with_name(f"{run['id']}.input.json")
    input_path.write_text(json.dumps({"kind": "run", "run_id": run["id"],
                                      "session_id": "ses_legacy", "agent_id": "a1",
                                      "payload": run["payload"]}) + "\n")
    argv = (sys.executable, "-m", "kandevd.agents.echo")
    env = {**os.environ, "KANDEVD_RUN_ID": run["id"], "KANDEVD_SESSION_ID": "ses_legacy",
           "KANDEVD_HOME": str(home), "KANDEVD_INPUT": str(input_path)}
    cwd = home / "runs" / run["id"]
    cwd.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as sink:
        proc = subprocess.Popen(
            shim.shim_argv(folder / attempts.EXIT_FILE, input_path, log_path, argv,
                           folder / attempts.STDOUT_FILE),
            stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT, cwd=cwd, env=env,
            start_new_session=True)
    write_record(ExecutionRecord(
        record_dir=folder, pid=proc.pid, pid_start=shim.proc_start_time(proc.pid) or 0,
        key=run["id"], run_id=run["id"], session_id="ses_legacy", started_at=now,
        deadline=after(now, 3600), timeout_s=3600.0, log_path=log_path,
        input_path=input_path, argv=argv))
    try:
        second = daemon_factory(fast_config(), home=home)
        second.wait_for_line(f"run {run['id']}: adopted its agent (pid {proc.pid})")
        (tmp_path / "go").touch()
        finished = wait_status(second, run["id"], "finished", timeout=WAIT_S)
        assert finished["output_summary"] == "echoed run" and finished["attempt"] == 1
        assert len(windows(touch)[run["id"]]) == 1
        assert "echo: run" in log_path.read_text()  # its stdout, merged into the log
    finally:
        proc.wait(30)  # (the shim is this test's child: reaped here)


#: An agent that leaves three processes in sessions of their own (``setsid -f``), each
#: writing its pid to ``<dir>/<run>.<kind>``: one keeps the run's environment, one
#: drops ``KANDEVD_SESSION_ID``, one names another execution (as the agents of a kandevd
#: the agent itself ran would). It ends once ``<dir>/<run>.go`` exists.
STRAY_AGENT = r"""
d="$1"; r="$KANDEVD_RUN_ID"
leave='echo $$ > "$0.tmp" && mv "$0.tmp" "$0"; exec sleep 300'
setsid -f sh -c "$leave" "$d/$r.stray"
env -u KANDEVD_SESSION_ID setsid -f sh -c "$leave" "$d/$r.bare"
env KANDEVD_SESSION_ID=ses_inner KANDEVD_INPUT="$d/inner.json" setsid -f sh -c "$leave" \
    "$d/$r.foreign"
until [ -e "$d/$r.stray" ] && [ -e "$d/$r.bare" ] && [ -e "$d/$r.foreign" ] \
    && [ -e "$d/$r.go" ]; do sleep 0.02; done
"""


def test_what_an_ended_agent_left_in_a_session_of_its_own_is_ended(
        daemon_factory: Factory, tmp_path: Path) -> None:
    command = ["sh", "-c", STRAY_AGENT, "agent", str(tmp_path)]
    daemon = daemon_factory(fast_config(agents={"default": {"command": command}}))
    setup(daemon, ["a1", "a2"])
    first, second = enqueue(daemon, "a1"), enqueue(daemon, "a2")

    def pid(run: dict[str, Any], kind: str) -> int | None:
        path = tmp_path / f"{run['id']}.{kind}"
        return int(path.read_text()) if path.exists() else None

    left = {(run["id"], kind): daemon.wait_until(lambda r=run, k=kind: pid(r, k),
                                                   what=f"the {kind} process")
            for run in (first, second) for kind in ("stray", "bare", "foreign")}
    try:
        keeper = keeper_of(daemon)["pid"]
        assert parent_of(left[first["id"], "stray"]) == keeper  # (a child subreaper's)
        (tmp_path / f"{second['id']}.go").touch()
        wait_status(daemon, second["id"], "finished", timeout=WAIT_S)
        daemon.wait_until(lambda: not _running(left[second["id"], "stray"]),
                          what="what the second run's agent left, ended")
        assert _running(left[first["id"], "stray"])  # its agent runs on: left alone
        assert _running(left[second["id"], "bare"])  # whose, nobody can tell: left alone
        assert _running(left[second["id"], "foreign"])  # another execution's: left alone

        (tmp_path / f"{first['id']}.go").touch()
        wait_status(daemon, first["id"], "finished", timeout=WAIT_S)
        daemon.wait_until(lambda: not _running(left[first["id"], "stray"]),
                          what="what the first run's agent left, ended")
        assert _running(left[first["id"], "bare"])
        logged = (daemon.home / "logs" / "keeper.log").read_text()
        assert f"process {left[first['id'], 'stray']} (sleep), left running by an agent " \
            "of session ses_" in logged
    finally:
        for process in left.values():
            try:
                os.kill(process, signal.SIGKILL)
            except ProcessLookupError:
                pass
