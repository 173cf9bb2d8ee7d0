"""The shim, execution records and adoption, against real processes and real files.

Nothing sleeps to wait for an event: agents announce themselves over a unix
socket and wait there for the test's "go"; a shim's end is awaited on a
pidfd. The only sleeper is an agent a test leaves waiting on purpose.
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from kandevd.runtime import (
    DETACHED,
    AgentRuntime,
    ExecutionControl,
    ExecutionRecord,
    ExecutionSpec,
    InProcessRunner,
    ProcessRunner,
    shim,
)
from kandevd.runtime.attempts import spent_stdout_path
from kandevd.runtime.output import AgentReport, collect_stdout
from kandevd.runtime.records import (
    NO_EXIT_STATUS,
    outcome_from_record,
    read_exit_status,
    read_record,
    record_alive,
    write_record,
)
from kandevd.timeutil import utc_now
from tests.support.runtime import CHILD_ENV, WAIT_S, Recorder, runtimes

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")

# An agent that reports its pid over a unix socket, then waits for one byte
# ("go") before it prints its summary line and exits with the asked code.
LINKED_AGENT = r"""
import json, os, socket, sys
opts = json.load(sys.stdin)["payload"]
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(opts["link"])
s.sendall(str(os.getpid()).encode() + b"\n")
s.recv(1)
print("working", flush=True)
print(json.dumps({"summary": opts.get("summary", "done"), "cost_cents": 4}), flush=True)
sys.exit(opts.get("exit", 0))
"""


class Link:
    """The test's end of LINKED_AGENT's socket."""

    def __init__(self, directory: Path) -> None:
        self.path = str(directory / "link.sock")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self.path)
        self._sock.listen(8)
        self._sock.settimeout(WAIT_S)
        self._conns: list[socket.socket] = []

    def accept(self) -> tuple[int, socket.socket]:
        """The next agent's pid and its connection (send b"g" to let it finish)."""
        conn, _ = self._sock.accept()
        conn.settimeout(WAIT_S)
        self._conns.append(conn)
        data = b""
        while not data.endswith(b"\n"):
            chunk = conn.recv(64)
            assert chunk, "agent hung up before it said its pid"
            data += chunk
        return int(data), conn

    def close(self) -> None:
        for conn in self._conns:
            conn.close()
        self._sock.close()


@pytest.fixture
def link() -> Iterator[Link]:
    directory = Path(tempfile.mkdtemp(prefix="kd-shim-", dir="/tmp"))  # short socket path
    made = Link(directory)
    try:
        yield made
    finally:
        made.close()
        os.unlink(made.path)
        directory.rmdir()


class Groups:
    """Process groups a test leaves running on purpose; SIGKILLed at teardown."""

    def __init__(self) -> None:
        self.pgids: list[int] = []

    def add(self, pgid: int) -> int:
        self.pgids.append(pgid)
        return pgid

    def cleanup(self) -> None:
        for pgid in self.pgids:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


@pytest.fixture
def groups() -> Iterator[Groups]:
    made = Groups()
    yield made
    made.cleanup()


@pytest.fixture
def make_runtime() -> Iterator[Callable[..., AgentRuntime]]:
    with runtimes() as make:
        yield make


def wait_exit(pid: int) -> None:
    """Block until ``pid`` has exited (a pidfd works for any process, child or not)."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        readable, _, _ = select.select([pidfd], [], [], WAIT_S)
        assert readable == [pidfd], f"process {pid} did not exit"
    finally:
        os.close(pidfd)


def linked_spec(tmp_path: Path, key: str, link: Link, *, timeout_s: float = 30.0,
                record: bool = True, **opts: Any) -> ExecutionSpec:
    return ExecutionSpec(
        key=key, kind="run", argv=(sys.executable, "-c", LINKED_AGENT),
        stdin={"kind": "run", "run_id": key, "payload": {"link": link.path, **opts}},
        cwd=tmp_path / "runs" / key, log_path=tmp_path / "logs" / f"{key}.log",
        timeout_s=timeout_s, env=CHILD_ENV, run_id=key, session_id=f"sess-{key}",
        home=str(tmp_path),
        record_dir=tmp_path / "records" / key if record else None,
    )


def run_shim(tmp_path: Path, argv: list[str]) -> subprocess.Popen[bytes]:
    (tmp_path / "input.json").write_text("{}\n")
    return subprocess.Popen(
        shim.shim_argv(tmp_path / "exit", tmp_path / "input.json", tmp_path / "agent.log", argv,
                       tmp_path / "stdout"),
        stdin=subprocess.DEVNULL, start_new_session=True)


def detached_execution(tmp_path: Path, key: str, link: Link, make_runtime: Any,
                       groups: Groups, **opts: Any) -> tuple[ExecutionSpec, ExecutionRecord,
                                                             int, socket.socket]:
    """An execution started by one runtime and left running by its stop(keep_agents=True)."""
    first = make_runtime()
    done = Recorder()
    spec = linked_spec(tmp_path, key, link, **opts)
    first.launch(spec, done)
    agent, conn = link.accept()
    first.stop(keep_agents=True)
    result = done.wait(key)
    assert (result.outcome, result.exit_code) == (DETACHED, None)
    assert spec.record_dir is not None
    record = read_record(spec.record_dir)
    assert record is not None
    groups.add(record.pid)
    return spec, record, agent, conn


# -- the shim itself ------------------------------------------------------------------


@pytest.mark.parametrize(("argv", "status", "code"), [
    (["true"], "0\n", 0),
    (["sh", "-c", "exit 3"], "3\n", 3),
    (["sh", "-c", "kill -KILL $$"], "137\n", -signal.SIGKILL),
])
def test_shim_records_the_exit_status(tmp_path: Path, argv: list[str], status: str,
                                      code: int) -> None:
    proc = run_shim(tmp_path, argv)
    assert proc.wait(WAIT_S) == int(status)  # the shim exits with the agent's status
    assert (tmp_path / "exit").read_text() == status
    assert read_exit_status(tmp_path) == code


def test_shim_feeds_stdin_from_the_input_file_and_appends_output(tmp_path: Path) -> None:
    (tmp_path / "agent.log").write_text("earlier\n")
    (tmp_path / "stdout").write_text("before\n")
    proc = run_shim(tmp_path, ["sh", "-c", "cat; echo err >&2"])
    assert proc.wait(WAIT_S) == 0
    # stderr is appended to the log, stdout to the stdout file.
    assert (tmp_path / "agent.log").read_text() == "earlier\nerr\n"
    assert (tmp_path / "stdout").read_text() == "before\n{}\n"


def test_without_a_stdout_file_both_streams_go_to_the_log(tmp_path: Path) -> None:
    (tmp_path / "input.json").write_text("{}\n")
    proc = subprocess.Popen(
        shim.shim_argv(tmp_path / "exit", tmp_path / "input.json", tmp_path / "agent.log",
                       ["sh", "-c", "cat; echo err >&2"]),
        stdin=subprocess.DEVNULL, start_new_session=True)
    assert proc.wait(WAIT_S) == 0
    assert (tmp_path / "agent.log").read_text() == "{}\nerr\n"


def test_a_missing_agent_is_reported_in_the_log(tmp_path: Path) -> None:
    proc = run_shim(tmp_path, [str(tmp_path / "no-such-agent")])
    assert proc.wait(WAIT_S) == 127
    assert "no-such-agent" in (tmp_path / "agent.log").read_text()


def test_sigterm_to_the_group_kills_the_agent_and_the_shim_records_it(tmp_path: Path) -> None:
    fifo = tmp_path / "agent.pid"
    os.mkfifo(fifo)
    proc = run_shim(tmp_path, ["sh", "-c", 'echo $$ > "$0"; exec sleep 60', str(fifo)])
    try:
        with open(fifo) as handle:  # opens once the agent runs: the trap is set by then
            agent = int(handle.read())
        # The no-op trap is not inherited: the agent's SIGTERM is not ignored.
        status = Path(f"/proc/{agent}/status").read_text()
        ignored = int(next(line for line in status.splitlines()
                           if line.startswith("SigIgn:")).split()[1], 16)
        assert not ignored & (1 << (signal.SIGTERM - 1))
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(WAIT_S) == 143  # an exit, not a death by signal: it survived
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert (tmp_path / "exit").read_text() == "143\n"
    assert read_exit_status(tmp_path) == -signal.SIGTERM


def test_sigkill_of_the_group_leaves_no_exit_file(tmp_path: Path) -> None:
    fifo = tmp_path / "agent.pid"
    os.mkfifo(fifo)
    proc = run_shim(tmp_path, ["sh", "-c", 'echo $$ > "$0"; exec sleep 60', str(fifo)])
    with open(fifo) as handle:
        handle.read()
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(WAIT_S) == -signal.SIGKILL
    assert not (tmp_path / "exit").exists()
    assert read_exit_status(tmp_path) is None


@pytest.mark.parametrize(("content", "expected"), [
    (b"0\n", 0), (b"12\n", 12), (b"255\n", 255), (b"143\n", -15), (b"129\n", -1),
    (b"-3\n", -3), (b"", None), (b"0", None), (b"1\n2\n", None), (b"abc\n", None),
    (b" 1\n", None),
])
def test_read_exit_status_accepts_only_a_complete_line(tmp_path: Path, content: bytes,
                                                       expected: int | None) -> None:
    (tmp_path / "exit").write_bytes(content)
    assert read_exit_status(tmp_path) == expected


def test_read_exit_status_without_a_file(tmp_path: Path) -> None:
    assert read_exit_status(tmp_path) is None
    assert read_exit_status(tmp_path / "missing") is None


def test_last_log_line_skips_notes_and_earlier_output(tmp_path: Path) -> None:
    log = tmp_path / "a.log"
    log.write_bytes(b'{"summary": "old"}\n')
    offset = log.stat().st_size
    assert shim.last_log_line(log) == '{"summary": "old"}'
    assert shim.last_log_line(log, offset) is None  # nothing written after the offset
    with open(log, "ab") as handle:
        handle.write(b'noise\n{"summary": "new"}\n  \n[kandevd] timed out: sending SIGTERM\n\n')
    assert shim.last_log_line(log, offset) == '{"summary": "new"}'
    assert shim.last_log_line(tmp_path / "missing.log") is None


def test_last_log_line_too_long(tmp_path: Path) -> None:
    log = tmp_path / "a.log"
    log.write_bytes(b"first\n" + b"x" * 100)
    assert shim.last_log_line(log, limit=50) == shim.LINE_TOO_LONG
    log.write_bytes(b"first\n" + b"x" * 100 + b"\nshort\n")
    assert shim.last_log_line(log, limit=50) == "short"
    log.write_bytes(b"y" * 30 + b"\n" + b"z" * 19)  # the window starts right after a newline
    assert shim.last_log_line(log, limit=20) == "z" * 19


# -- records ----------------------------------------------------------------------------


def make_record(directory: Path, pid: int, pid_start: int, **changes: Any) -> ExecutionRecord:
    now = utc_now()
    record = ExecutionRecord(
        record_dir=directory, pid=pid, pid_start=pid_start, key="k", run_id="r",
        session_id="s", started_at=now, deadline=now + timedelta(seconds=30), timeout_s=30.0,
        log_path=directory / "k.log", input_path=directory / "k.input.json",
        argv=("agent", "--x"))
    return dataclasses.replace(record, **changes)


def test_record_round_trip_and_tolerant_reading(tmp_path: Path) -> None:
    assert read_record(tmp_path) is None  # missing
    record = make_record(tmp_path, 1234, 99, log_offset=17)
    write_record(record)
    assert read_record(tmp_path) == record
    assert stat_mode(tmp_path / "record.json") == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["record.json"]  # no temporary left

    text = (tmp_path / "record.json").read_text()
    for broken in (text[: len(text) // 2], "[]", "null", "",
                   text.replace('"pid": 1234', '"pid": "1234"'),
                   text.replace('"pid_start": 99', '"pid_start": true'),
                   text.replace('"argv": ["agent", "--x"]', '"argv": []'),
                   text.replace('"started_at": "', '"started_at": "x')):
        (tmp_path / "record.json").write_text(broken)
        assert read_record(tmp_path) is None, broken


def stat_mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_record_alive_checks_start_time_and_that_it_is_a_shim(tmp_path: Path) -> None:
    fifo = tmp_path / "agent.pid"
    os.mkfifo(fifo)
    proc = run_shim(tmp_path, ["sh", "-c", 'echo $$ > "$0"; exec sleep 60', str(fifo)])
    try:
        with open(fifo) as handle:
            agent = int(handle.read())
        start = shim.proc_start_time(proc.pid)
        assert start is not None
        assert record_alive(make_record(tmp_path, proc.pid, start))
        # A reused pid has another start time: not the shim of the record.
        assert not record_alive(make_record(tmp_path, proc.pid, start + 1))
        # The right start time, but not a shim (the agent, or this very process).
        agent_start = shim.proc_start_time(agent)
        assert agent_start is not None
        assert not record_alive(make_record(tmp_path, agent, agent_start))
        own_start = shim.proc_start_time(os.getpid())
        assert own_start is not None
        assert not record_alive(make_record(tmp_path, os.getpid(), own_start))
        # A shim all right, but one writing another exit file (another home, attempt).
        other = tmp_path / "other"
        other.mkdir()
        assert shim.is_our_shim(proc.pid)
        assert shim.is_our_shim(proc.pid, tmp_path / "exit")
        assert not shim.is_our_shim(proc.pid, other / "exit")
        assert not record_alive(make_record(other, proc.pid, start))
        # The same file reached through a symbolic link is the same shim.
        (tmp_path / "link").symlink_to(tmp_path)
        assert record_alive(make_record(tmp_path / "link", proc.pid, start))
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not record_alive(make_record(tmp_path, proc.pid, start))  # gone


def test_outcome_from_record(tmp_path: Path) -> None:
    record = make_record(tmp_path, 1234, 99)
    assert record.stdout_path == tmp_path / "stdout"
    record.log_path.write_text('{"summary": "before"}\nstderr after the summary\n')
    (tmp_path / "stdout").write_text('working\n{"summary": "mine", "cost_cents": 2}\n\n')
    assert outcome_from_record(record, tmp_path) is None  # no exit file: no outcome
    assert (tmp_path / "stdout").exists()  # nothing collected before the end
    (tmp_path / "exit").write_text("0\n")
    ok = outcome_from_record(record, tmp_path)
    assert ok is not None
    assert (ok.outcome, ok.exit_code, ok.summary, ok.cost_cents, ok.error) == (
        "succeeded", 0, "mine", 2.0, None)
    assert ok.key == "k" and ok.log_path == record.log_path
    assert ok.started_at == record.started_at <= ok.ended_at
    # The stdout went into the log (after its stderr) and its file is gone.
    merged = ('{"summary": "before"}\nstderr after the summary\n'
              'working\n{"summary": "mine", "cost_cents": 2}\n\n')
    assert record.log_path.read_text() == merged
    assert not (tmp_path / "stdout").exists()
    # Again (a restarted daemon restoring it once more): same summary, no duplicate.
    again = outcome_from_record(record, tmp_path)
    assert again is not None and (again.summary, again.cost_cents) == ("mine", 2.0)
    assert record.log_path.read_text() == merged
    (tmp_path / "exit").write_text("143\n")
    killed = outcome_from_record(record)
    assert killed is not None
    assert (killed.outcome, killed.exit_code, killed.error) == (
        "failed", -15, "killed by signal SIGTERM")
    assert killed.summary == "mine"


@pytest.mark.parametrize("crash", ["after_state", "partial_append", "after_append",
                                   "after_emptying"])
def test_collecting_stdout_again_after_a_crash_neither_loses_nor_duplicates(
        tmp_path: Path, crash: str) -> None:
    record = make_record(tmp_path, 1234, 99)
    (tmp_path / "exit").write_text("0\n")
    stderr = "some stderr\n"
    stdout = 'out\n{"summary": "kept", "cost_cents": 3}\n'
    record.log_path.write_text(stderr)
    (tmp_path / "stdout").write_text(stdout)
    # What a daemon killed half-way through the merge leaves behind.
    (tmp_path / "summary.json").write_text(json.dumps(
        {"summary": "kept", "cost_cents": 3, "log_size": len(stderr)}))
    if crash == "partial_append":
        record.log_path.write_text(stderr + stdout[:5])
    elif crash in ("after_append", "after_emptying"):
        record.log_path.write_text(stderr + stdout)
    if crash == "after_emptying":  # emptied, not yet moved out of the folder
        (tmp_path / "stdout").write_text("")
    result = outcome_from_record(record, tmp_path)
    assert result is not None and (result.summary, result.cost_cents) == ("kept", 3.0)
    assert record.log_path.read_text() == stderr + stdout
    assert not (tmp_path / "stdout").exists()
    assert spent_stdout_path(tmp_path).read_text() == ""


def test_a_merged_stdout_is_kept_empty_beside_its_folder_not_freed(tmp_path: Path) -> None:
    """No inode is freed per execution: the stdout file is emptied and moved out of the
    attempt folder (never reused for another attempt), and a second merge is a no-op."""
    folder = tmp_path / "attempts" / "run_a.t1"
    folder.mkdir(parents=True)
    log_path = tmp_path / "run_a.log"
    log_path.write_text("stderr\n")
    (folder / "stdout").write_text('{"summary": "s", "cost_cents": 2}\n')
    inode = os.stat(folder / "stdout").st_ino
    spent = spent_stdout_path(folder)
    assert spent == tmp_path / "attempts" / "run_a.t1.stdout"
    for _again in range(2):
        assert collect_stdout(folder / "stdout", log_path, folder / "summary.json",
                              spent) == AgentReport("s", 2.0)
        assert log_path.read_text() == 'stderr\n{"summary": "s", "cost_cents": 2}\n'
        assert not (folder / "stdout").exists()
        assert os.stat(spent).st_ino == inode and spent.read_text() == ""


def test_an_old_record_without_stdout_path_reads_the_default(tmp_path: Path) -> None:
    record = make_record(tmp_path, 1234, 99)
    write_record(record)
    document = json.loads((tmp_path / "record.json").read_text())
    assert document["stdout_path"] == str(tmp_path / "stdout")
    del document["stdout_path"]
    (tmp_path / "record.json").write_text(json.dumps(document))
    old = read_record(tmp_path)
    assert old is not None and old.stdout_path == tmp_path / "stdout"


# -- detaching and adopting ----------------------------------------------------------------


def test_a_detached_agent_runs_on_and_its_shim_writes_the_exit_file(
        tmp_path: Path, link: Link, make_runtime: Any, groups: Groups) -> None:
    spec, record, agent, conn = detached_execution(tmp_path, "det", link, make_runtime,
                                                   groups, summary="x")
    assert spec.record_dir is not None
    assert record.pid != agent and record.key == "det" and record.run_id == "det"
    assert record.session_id == "sess-det" and record.argv == spec.argv
    assert record.log_path == spec.log_path and record.input_path == spec.input_path
    assert record.deadline - record.started_at == timedelta(seconds=30)
    assert record_alive(record)
    assert os.getpgid(agent) == record.pid  # the shim leads the agent's group
    assert read_exit_status(spec.record_dir) is None  # still running

    conn.sendall(b"g")
    wait_exit(record.pid)
    assert (spec.record_dir / "exit").read_text() == "0\n"
    result = outcome_from_record(record, spec.record_dir)
    assert result is not None
    assert (result.outcome, result.summary, result.cost_cents) == ("succeeded", "x", 4.0)
    assert not record_alive(record)
    assert sorted(p.name for p in spec.record_dir.iterdir()) == [
        "exit", "record.json", "summary.json"]  # the stdout file went into the log
    assert spent_stdout_path(spec.record_dir).read_text() == ""  # and is kept, emptied
    assert spec.log_path.read_text().endswith('working\n{"summary": "x", "cost_cents": 4}\n')


def test_a_fresh_runtime_adopts_a_running_agent(tmp_path: Path, link: Link, make_runtime: Any,
                                                groups: Groups) -> None:
    spec, record, agent, conn = detached_execution(tmp_path, "adopt", link, make_runtime,
                                                   groups, summary="adopted work")
    second = make_runtime(max_concurrent=1)
    held = second.try_reserve()  # every slot is taken...
    assert held is not None
    done = Recorder()
    second.adopt(spec, record, done)  # ...adopted work takes one all the same
    assert second.active == 2 and second.is_live("adopt")
    second.release(held)
    assert second.try_reserve() is None  # over the bound until the adopted one ends
    with pytest.raises(ValueError, match="already live"):
        second.adopt(spec, record, done)

    conn.sendall(b"g")
    result = done.wait("adopt")
    assert (result.outcome, result.exit_code, result.error) == ("succeeded", 0, None)
    assert (result.summary, result.cost_cents) == ("adopted work", 4.0)
    assert result.started_at == record.started_at
    assert result.log_path == spec.log_path
    wait_exit(agent)
    slot = second.try_reserve()
    assert slot is not None
    second.release(slot)


def test_an_adopted_failure_is_failed(tmp_path: Path, link: Link, make_runtime: Any,
                                      groups: Groups) -> None:
    spec, record, _agent, conn = detached_execution(tmp_path, "adopt-fail", link,
                                                    make_runtime, groups, exit=5)
    second = make_runtime()
    done = Recorder()
    second.adopt(spec, record, done)
    conn.sendall(b"g")
    result = done.wait("adopt-fail")
    assert (result.outcome, result.exit_code, result.error) == ("failed", 5, "exit code 5")


def test_an_adopted_execution_past_its_deadline_is_timed_out_at_once(
        tmp_path: Path, link: Link, make_runtime: Any, groups: Groups) -> None:
    spec, record, agent, _conn = detached_execution(tmp_path, "late", link, make_runtime,
                                                    groups)
    late = dataclasses.replace(record, deadline=utc_now() - timedelta(seconds=1))
    second = make_runtime(kill_grace_s=5.0)
    done = Recorder()
    second.adopt(spec, late, done)
    result = done.wait("late")
    assert result.outcome == "timed_out"
    assert result.error == "timed out after 30.0s"  # the record's timeout
    assert result.exit_code == -signal.SIGTERM  # recorded by the shim
    wait_exit(agent)
    assert "sending SIGTERM to process group" in spec.log_path.read_text()


def test_an_adopted_execution_times_out_at_the_deadline_of_its_record(
        tmp_path: Path, link: Link, make_runtime: Any, groups: Groups) -> None:
    spec, record, agent, _conn = detached_execution(tmp_path, "timeout", link, make_runtime,
                                                    groups, timeout_s=1.0)
    second = make_runtime()
    done = Recorder()
    second.adopt(spec, record, done)
    result = done.wait("timeout")
    assert (result.outcome, result.error) == ("timed_out", "timed out after 1.0s")
    assert result.ended_at >= record.deadline
    wait_exit(agent)


def test_stop_execution_of_an_adopted_one(tmp_path: Path, link: Link, make_runtime: Any,
                                          groups: Groups) -> None:
    spec, record, agent, _conn = detached_execution(tmp_path, "stop", link, make_runtime,
                                                    groups)
    second = make_runtime()
    done = Recorder()
    second.adopt(spec, record, done)
    assert second.stop_execution("stop", "cancelled by test")
    result = done.wait("stop")
    assert (result.outcome, result.error) == ("stopped", "stopped: cancelled by test")
    assert result.exit_code == -signal.SIGTERM
    wait_exit(agent)
    wait_exit(record.pid)
    assert read_exit_status(record.record_dir) == -signal.SIGTERM


def test_shutdown_interrupts_an_adopted_one_and_kill_all_now_reaches_it(
        tmp_path: Path, link: Link, make_runtime: Any, groups: Groups) -> None:
    spec, record, agent, _conn = detached_execution(tmp_path, "shut", link, make_runtime,
                                                    groups)
    second = make_runtime(stop_grace_s=0.0)
    done = Recorder()
    second.adopt(spec, record, done)
    second.stop()
    result = done.wait("shut")
    assert (result.outcome, result.error) == ("interrupted", "interrupted: daemon shutting down")
    wait_exit(agent)

    spec2, record2, agent2, _conn2 = detached_execution(tmp_path, "forced", link,
                                                        make_runtime, groups)
    third = make_runtime(kill_grace_s=30.0)
    done = Recorder()
    third.adopt(spec2, record2, done)
    third.kill_all_now()
    forced = done.wait("forced")
    assert forced.outcome == "interrupted" and forced.error == "interrupted: forced exit"
    wait_exit(agent2)
    wait_exit(record2.pid)


def test_stop_keep_agents_detaches_an_adopted_one_again(tmp_path: Path, link: Link,
                                                        make_runtime: Any,
                                                        groups: Groups) -> None:
    spec, record, agent, conn = detached_execution(tmp_path, "again", link, make_runtime,
                                                   groups)
    second = make_runtime()
    done = Recorder()
    second.adopt(spec, record, done)
    second.stop(keep_agents=True)
    assert done.wait("again").outcome == DETACHED
    assert record_alive(record)
    third = make_runtime()
    done = Recorder()
    third.adopt(spec, record, done)
    conn.sendall(b"g")
    assert done.wait("again").succeeded
    wait_exit(agent)


def test_adopting_an_execution_that_already_ended(tmp_path: Path, link: Link,
                                                  make_runtime: Any, groups: Groups) -> None:
    spec, record, _agent, conn = detached_execution(tmp_path, "ended", link, make_runtime,
                                                    groups)
    conn.sendall(b"g")
    wait_exit(record.pid)
    runtime = make_runtime()
    done = Recorder()
    runtime.adopt(spec, record, done)
    result = done.wait("ended")
    assert result.succeeded and result.summary == "done"


def test_adopting_a_shim_that_died_without_an_exit_file(tmp_path: Path, link: Link,
                                                        make_runtime: Any,
                                                        groups: Groups) -> None:
    spec, record, agent, _conn = detached_execution(tmp_path, "lost", link, make_runtime,
                                                    groups)
    os.killpg(record.pid, signal.SIGKILL)
    wait_exit(record.pid)
    wait_exit(agent)
    runtime = make_runtime()
    done = Recorder()
    runtime.adopt(spec, record, done)
    result = done.wait("lost")
    assert (result.outcome, result.exit_code, result.error) == ("error", None, NO_EXIT_STATUS)


def test_stop_keep_agents_leaves_the_process_running(tmp_path: Path, link: Link,
                                                     make_runtime: Any,
                                                     groups: Groups) -> None:
    runtime = make_runtime(stop_grace_s=30.0)
    done = Recorder()
    spec = linked_spec(tmp_path, "kept", link)
    runtime.launch(spec, done)
    agent, _conn = link.accept()
    stopper = threading.Thread(target=runtime.stop, kwargs={"keep_agents": True})
    stopper.start()
    stopper.join(WAIT_S)  # not the 30 s grace: detached at once
    assert not stopper.is_alive()
    result = done.wait("kept")
    assert (result.outcome, result.exit_code) == (DETACHED, None)
    assert runtime.active == 0
    assert spec.record_dir is not None
    record = read_record(spec.record_dir)
    assert record is not None
    groups.add(record.pid)
    os.kill(agent, 0)  # both still running
    assert record_alive(record)
    os.killpg(record.pid, signal.SIGTERM)  # clean up: the shim records the end
    wait_exit(record.pid)
    assert read_exit_status(spec.record_dir) == -signal.SIGTERM


def test_stop_keep_agents_waits_for_what_cannot_be_adopted(tmp_path: Path, link: Link,
                                                           make_runtime: Any) -> None:
    started, gate = threading.Event(), threading.Event()

    def agent(spec: ExecutionSpec) -> tuple[int, str | None, float | None]:
        started.set()
        return (0 if gate.wait(WAIT_S) else 1), None, None

    in_process = make_runtime(runner=InProcessRunner(agent))
    done = Recorder()
    in_process.launch(linked_spec(tmp_path, "inproc", link), done)
    assert started.wait(WAIT_S)
    stopper = threading.Thread(target=in_process.stop, kwargs={"keep_agents": True})
    stopper.start()
    stopper.join(0.2)
    assert stopper.is_alive()  # the in-process execution is waited for...
    gate.set()
    stopper.join(WAIT_S)
    assert not stopper.is_alive()
    assert done.results["inproc"].succeeded  # ...to its end, not detached

    no_record = make_runtime(stop_grace_s=0.0, kill_grace_s=5.0)
    no_record.launch(linked_spec(tmp_path, "launch", link, record=False), done)
    agent, _conn = link.accept()
    no_record.stop(keep_agents=True)  # nobody could adopt it: interrupted as without
    assert done.results["launch"].outcome == "interrupted"
    wait_exit(agent)


def test_a_detach_request_before_the_start_starts_nothing(tmp_path: Path, link: Link) -> None:
    control = ExecutionControl()
    try:
        assert control.request_detach()
        assert not control.request_detach()  # once
        result = ProcessRunner().run(linked_spec(tmp_path, "never", link), control)
    finally:
        control.close()
    assert result.outcome == "interrupted"
    assert not (tmp_path / "records" / "never" / "record.json").exists()


def test_detach_does_not_override_a_termination(tmp_path: Path) -> None:
    control = ExecutionControl()
    try:
        assert control.request_termination("stopped", "cancel")
        assert not control.request_detach()
        assert not control.detach_requested
    finally:
        control.close()
    other = ExecutionControl()
    try:
        assert other.request_detach()
        assert other.request_termination("interrupted", "shutdown")  # still possible
    finally:
        other.close()


def test_in_process_runner_cannot_adopt(tmp_path: Path, link: Link) -> None:
    record = make_record(tmp_path, 1, 1)
    control = ExecutionControl()
    try:
        with pytest.raises(NotImplementedError):
            InProcessRunner(lambda spec: (0, None, None)).adopt(
                linked_spec(tmp_path, "x", link), control, record)
    finally:
        control.close()


def test_records_json_fields(tmp_path: Path, link: Link, make_runtime: Any,
                             groups: Groups) -> None:
    spec, record, _agent, conn = detached_execution(tmp_path, "fields", link, make_runtime,
                                                    groups)
    assert spec.record_dir is not None
    document = json.loads((spec.record_dir / "record.json").read_text())
    assert set(document) == {"pid", "pid_start", "key", "run_id", "session_id", "started_at",
                             "deadline", "timeout_s", "log_path", "input_path", "argv",
                             "log_offset", "stdout_path"}
    assert document["stdout_path"] == str(spec.record_dir / "stdout")
    assert document["pid"] == record.pid and document["timeout_s"] == 30.0
    assert document["started_at"].endswith("Z") and document["deadline"].endswith("Z")
    assert stat_mode(spec.record_dir) == 0o700
    conn.sendall(b"g")
    wait_exit(record.pid)


def test_without_pidfds_the_wait_polls(tmp_path: Path, link: Link, make_runtime: Any,
                                       groups: Groups, monkeypatch: pytest.MonkeyPatch) -> None:
    spec, record, agent, conn = detached_execution(tmp_path, "poll", link, make_runtime,
                                                   groups, summary="polled")
    monkeypatch.delattr(os, "pidfd_open")  # an old kernel: no pidfds
    control = ExecutionControl()
    try:
        conn.sendall(b"g")
        adopted = ProcessRunner().adopt(spec, control, record)
        quick = ProcessRunner().run(ExecutionSpec(
            key="quick", kind="run", argv=("sh", "-c", 'echo \'{"summary": "q"}\''), stdin={},
            cwd=tmp_path / "q", log_path=tmp_path / "logs" / "q.log", timeout_s=30),
            control)
    finally:
        control.close()
    assert (adopted.outcome, adopted.summary) == ("succeeded", "polled")
    assert (quick.outcome, quick.summary) == ("succeeded", "q")
    monkeypatch.undo()
    wait_exit(agent)
