"""Finding and stopping agent processes a dead daemon left behind (real processes, real /proc).

The "agents" are small Python children started the way the runner starts
agents: in their own session, with ``KANDEVD_HOME`` / ``KANDEVD_RUN_ID`` /
``KANDEVD_SESSION_ID`` in their environment. Each says "ready" on stdout once
its signal disposition is set, so no test races the child's start-up.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kandevd.runtime import AgentRuntime, ExecutionResult, ExecutionSpec, orphans
from kandevd.runtime.orphans import find_orphan_agents, stop_orphan_agents

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")

_CHILD = """
import signal, sys, time
if sys.argv[1] == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
time.sleep(120)
"""


class Children:
    """Spawns agent-like children and kills whatever a test leaves alive."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []

    def spawn(self, home: Path, *, run_id: str = "r1", session_id: str = "",
              sigterm: str = "default", own_session: bool = True,
              agent_env: bool = True) -> subprocess.Popen[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KANDEVD_")}
        env["KANDEVD_HOME"] = str(home)
        if agent_env:
            env["KANDEVD_RUN_ID"] = run_id
            env["KANDEVD_SESSION_ID"] = session_id
        proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, sigterm], stdout=subprocess.PIPE, text=True, env=env,
            start_new_session=own_session, process_group=None if own_session else 0,
        )
        self.procs.append(proc)
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        return proc

    def cleanup(self) -> None:
        for proc in self.procs:
            try:  # every child leads its own group; take what it started, too
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait(10)
            if proc.stdout is not None:
                proc.stdout.close()


@pytest.fixture
def children() -> Iterator[Children]:
    made = Children()
    yield made
    made.cleanup()


@pytest.fixture
def home(tmp_path: Path) -> Path:
    path = (tmp_path / "home").resolve()
    path.mkdir()
    return path


def test_finds_the_agents_of_this_home_only(children: Children, home: Path,
                                            tmp_path: Path) -> None:
    run = children.spawn(home, run_id="run-1")
    launch = children.spawn(home, run_id="", session_id="")  # a launch: no run, no session
    children.spawn(tmp_path / "other-home")
    children.spawn(home / "sub")  # a prefix match is not a match
    children.spawn(home, own_session=False)  # own group but not a session leader
    children.spawn(home, agent_env=False)  # a shell that merely exports KANDEVD_HOME

    assert find_orphan_agents(home) == sorted([run.pid, launch.pid])
    assert {o.pid: o.what for o in orphans.scan(home)} == {run.pid: "run run-1",
                                                           launch.pid: "launch"}


def test_nothing_found_for_a_home_without_agents(children: Children, home: Path,
                                                 tmp_path: Path) -> None:
    children.spawn(tmp_path / "other-home")
    assert find_orphan_agents(home) == []
    assert stop_orphan_agents(home, grace_s=1.0) == 0


def test_stop_terminates_escalates_and_leaves_other_homes_alone(
        children: Children, home: Path, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    polite = children.spawn(home, run_id="run-1")
    stubborn = children.spawn(home, run_id="run-2", sigterm="ignore")
    frozen = children.spawn(home, run_id="", session_id="s1")
    os.kill(frozen.pid, signal.SIGSTOP)  # stopped: SIGTERM alone would stay pending
    bystander = children.spawn(tmp_path / "other-home")

    with caplog.at_level(logging.INFO, logger="kandevd.runtime.orphans"):
        assert stop_orphan_agents(home, grace_s=1.0) == 3

    # stop_orphan_agents returned only once they were gone: each exited already.
    assert polite.poll() == -signal.SIGTERM
    assert frozen.poll() == -signal.SIGTERM
    assert stubborn.poll() == -signal.SIGKILL
    assert bystander.poll() is None
    assert find_orphan_agents(home) == []
    assert "stopped 3 agent process(es) left by a previous instance" in caplog.text
    assert f"{stubborn.pid} still running" in caplog.text


def test_children_in_an_agents_group_are_stopped_with_it(children: Children, home: Path,
                                                          tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    script = (
        "import signal, subprocess, sys, time\n"
        "g = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(g.pid))\n"
        "print('ready', flush=True)\n"
        "time.sleep(120)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KANDEVD_")}
    env.update(KANDEVD_HOME=str(home), KANDEVD_RUN_ID="run-1", KANDEVD_SESSION_ID="")
    leader = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              env=env, start_new_session=True)
    children.procs.append(leader)
    assert leader.stdout is not None and leader.stdout.readline().strip() == "ready"
    grandchild = int(pid_file.read_text())
    pidfd = os.pidfd_open(grandchild)
    try:
        # Only the leader is an agent; its child (same group) is not counted...
        assert find_orphan_agents(home) == [leader.pid]
        assert stop_orphan_agents(home, grace_s=0.5) == 1
        # ...but it ignored SIGTERM and still went with the group's SIGKILL.
        readable, _, _ = select.select([pidfd], [], [], 10)
        assert readable == [pidfd]
    finally:
        os.close(pidfd)


def test_other_platforms_find_nothing(children: Children, home: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    proc = children.spawn(home)
    assert find_orphan_agents(home) == [proc.pid]
    monkeypatch.setattr(orphans.sys, "platform", "darwin")
    assert find_orphan_agents(home) == []
    assert stop_orphan_agents(home, grace_s=0.1) == 0
    assert proc.poll() is None


def test_a_shim_left_running_is_found_and_kept_or_stopped(home: Path, tmp_path: Path) -> None:
    """The runner's shim leads the session: it is what the scan finds (not the agent)."""
    fifo = tmp_path / "agent.pid"
    os.mkfifo(fifo)
    record_dir = tmp_path / "record"
    spec = ExecutionSpec(
        key="run-1", kind="run", argv=("sh", "-c", 'echo $$ > "$0"; exec sleep 120', str(fifo)),
        stdin={}, cwd=tmp_path / "cwd", log_path=tmp_path / "logs" / "run-1.log",
        timeout_s=60, run_id="run-1", session_id="ses-1", home=str(home),
        record_dir=record_dir)
    runtime = AgentRuntime(2, 5.0)
    results: list[ExecutionResult] = []
    runtime.launch(spec, results.append)
    with open(fifo) as handle:
        agent = int(handle.read())
    runtime.stop(keep_agents=True)
    assert [r.outcome for r in results] == ["detached"]
    shim_pid = os.getpgid(agent)
    try:
        assert find_orphan_agents(home) == [shim_pid]
        assert {o.pid: o.what for o in orphans.scan(home)} == {shim_pid: "run run-1"}
        assert find_orphan_agents(home, keep=frozenset({shim_pid})) == []
        assert stop_orphan_agents(home, grace_s=1.0, keep=frozenset({shim_pid})) == 0
        os.kill(agent, 0)  # kept: still running

        assert stop_orphan_agents(home, grace_s=5.0) == 1
        # SIGTERM ended the agent; the shim outlived it long enough to record that.
        assert (record_dir / "exit").read_text() == "143\n"
        assert find_orphan_agents(home) == []
    finally:
        try:
            os.killpg(shim_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_an_agent_whose_shim_was_killed_alone_is_stopped(home: Path, tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """A shim SIGKILLed on its own leaves its agent leaderless in the session: swept too."""
    from kandevd.runtime import shim

    fifo = tmp_path / "agent.pid"
    os.mkfifo(fifo)
    (tmp_path / "input.json").write_text("{}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KANDEVD_")}
    env.update(KANDEVD_HOME=str(home), KANDEVD_RUN_ID="run-7", KANDEVD_SESSION_ID="")
    proc = subprocess.Popen(
        shim.shim_argv(tmp_path / "exit", tmp_path / "input.json", tmp_path / "agent.log",
                       ["sh", "-c", 'echo $$ > "$0"; exec sleep 120', str(fifo)],
                       tmp_path / "stdout"),
        stdin=subprocess.DEVNULL, start_new_session=True, env=env)
    with open(fifo) as handle:
        agent = int(handle.read())
    pidfd = os.pidfd_open(agent)
    try:
        os.kill(proc.pid, signal.SIGKILL)  # the shim alone, not its group
        assert proc.wait(10) == -signal.SIGKILL
        os.kill(agent, 0)  # the agent runs on, in a session without its leader
        assert os.getsid(agent) == proc.pid
        assert find_orphan_agents(home) == [agent]
        assert orphans.scan(home)[0].members == (agent,)
        # Keeping the session (an adopted shim's pid) keeps its agent too.
        assert find_orphan_agents(home, keep=frozenset({proc.pid})) == []
        with caplog.at_level(logging.INFO, logger="kandevd.runtime.orphans"):
            assert stop_orphan_agents(home, grace_s=5.0) == 1
        readable, _, _ = select.select([pidfd], [], [], 10)
        assert readable == [pidfd]
        assert f"stopping agent process {agent} (run run-7) left by a previous instance" \
            in caplog.text
        assert "stopped 1 agent process(es) left by a previous instance" in caplog.text
        assert find_orphan_agents(home) == []
    finally:
        os.close(pidfd)
        try:
            os.kill(agent, signal.SIGKILL)
        except ProcessLookupError:
            pass
