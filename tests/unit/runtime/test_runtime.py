"""AgentRuntime and ProcessRunner against real child processes and real files.

Every agent runs under its shim (see ``kandevd/runtime/shim.py``; the shim
itself, records and adoption are tested in ``test_shim.py``).

Nothing here sleeps to wait for something to happen: tests wait on the
runtime's own signals (on_done, slot listeners) or on a child announcing
itself over a unix socket. Children asked to sleep are the only sleepers.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import select
import signal
import socket
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kandevd.agents import echo_argv
from kandevd.runtime import (
    AgentRuntime,
    ExecutionControl,
    ExecutionResult,
    ExecutionSpec,
    InProcessRunner,
    ProcessRunner,
    RuntimeFull,
    RuntimeStopped,
)
from kandevd.runtime import process as process_module
from kandevd.runtime.output import (
    MAX_COST_CENTS,
    MAX_EVALUATION_BYTES,
    AgentReport,
    parse_report,
    parse_summary_line,
)
from kandevd.runtime.records import read_record, record_alive
from tests.support.runtime import CHILD_ENV, WAIT_S, Recorder, runtimes

# A child that (optionally) ignores SIGTERM, then tells the test its pid over a
# unix socket, then sleeps: the test knows exactly when the child is running.
READY_CHILD = r"""
import json, os, signal, socket, sys, time
opts = json.load(sys.stdin)["payload"]
if opts.get("ignore_sigterm"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready child", os.getpid(), flush=True)
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(opts["ready"])
s.sendall(str(os.getpid()).encode())
s.close()
time.sleep(60)
"""


class SlotCounter:
    """A slot listener that counts how often a slot freed."""

    def __init__(self, recorder: Recorder | None = None) -> None:
        self._cond = threading.Condition()
        self.count = 0
        self._recorder = recorder

    def __call__(self) -> None:
        with self._cond:
            self.count += 1
            if self._recorder is not None:
                self._recorder.order.append("slot")
            self._cond.notify_all()

    def wait_for(self, count: int) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: self.count >= count, WAIT_S)


class ReadyListener:
    """A unix socket a READY_CHILD connects to; accept() returns the child's pid."""

    def __init__(self, directory: Path) -> None:
        self.path = str(directory / "ready.sock")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self.path)
        self._sock.listen(8)
        self._sock.settimeout(WAIT_S)

    def accept(self) -> int:
        conn, _ = self._sock.accept()
        with conn:
            conn.settimeout(WAIT_S)
            data = b""
            while chunk := conn.recv(64):
                data += chunk
        return int(data)

    def close(self) -> None:
        self._sock.close()


@pytest.fixture
def ready(tmp_path: Path) -> Iterator[ReadyListener]:
    # unix socket paths are limited to ~108 bytes; pytest's tmp_path can be long.
    directory = Path(tempfile.mkdtemp(prefix="kd-rt-", dir="/tmp"))
    listener = ReadyListener(directory)
    try:
        yield listener
    finally:
        listener.close()
        os.unlink(listener.path)
        directory.rmdir()


@pytest.fixture
def make_runtime() -> Iterator[Callable[..., AgentRuntime]]:
    """Build runtimes that are always stopped (and verified clean) at teardown."""
    with runtimes(verify_clean=True) as make:
        yield make


def spec_for(tmp_path: Path, key: str, payload: dict[str, Any] | None = None, *,
             argv: tuple[str, ...] | list[str] | None = None, timeout_s: float = 30.0,
             kind: str = "run") -> ExecutionSpec:
    return ExecutionSpec(
        key=key,
        kind=kind,
        argv=argv if argv is not None else echo_argv(),
        stdin={"kind": kind, "run_id": key, "session_id": f"sess-{key}", "payload": payload or {}},
        cwd=tmp_path / "runs" / key,
        log_path=tmp_path / "logs" / f"{key}.log",
        timeout_s=timeout_s,
        env=CHILD_ENV,
        run_id=key,
        session_id=f"sess-{key}",
        home=str(tmp_path),
    )


def ready_spec(tmp_path: Path, key: str, listener: ReadyListener, **opts: Any) -> ExecutionSpec:
    return spec_for(tmp_path, key, {"ready": listener.path, **opts},
                    argv=(sys.executable, "-c", READY_CHILD))


def assert_gone(pid: int) -> None:
    """The process has exited (or is about to: a SIGKILL is on its way).

    An agent whose shim died with it (SIGKILL of the group) is reparented and
    reaped by init, so it may linger as a zombie for a moment: a pidfd says
    when it exited, whoever reaps it.
    """
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        readable, _, _ = select.select([pidfd], [], [], WAIT_S)
        assert readable == [pidfd], f"process {pid} is still running"
    finally:
        os.close(pidfd)


# -- process runner through the runtime ------------------------------------


def test_success_records_summary_cost_env_and_private_files(tmp_path: Path, make_runtime):
    runtime = make_runtime()
    done = Recorder()
    spec = spec_for(tmp_path, "run-ok", {"summary": "all good", "cost_cents": 12.5})
    runtime.launch(spec, done)
    result = done.wait("run-ok")

    assert result.outcome == "succeeded" and result.succeeded
    assert result.exit_code == 0
    assert result.summary == "all good"
    assert result.cost_cents == 12.5
    assert result.error is None
    assert result.started_at <= result.ended_at
    assert result.log_path == spec.log_path
    assert done.threads["run-ok"].startswith("kandevd-exec-worker-")  # the pool's
    text = spec.log_path.read_text()
    assert "echo: run run-ok" in text
    assert f"KANDEVD_RUN_ID=run-ok KANDEVD_SESSION_ID=sess-run-ok KANDEVD_HOME={tmp_path}" in text
    assert stat.S_IMODE(spec.log_path.stat().st_mode) == 0o600
    for directory in (spec.cwd, spec.cwd.parent, spec.log_path.parent):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700


def test_non_zero_exit_is_failed_and_stderr_is_logged(tmp_path: Path, make_runtime):
    runtime = make_runtime()
    done = Recorder()
    spec = spec_for(tmp_path, "run-fail", {"exit_code": 3})
    runtime.launch(spec, done)
    result = done.wait("run-fail")

    assert result.outcome == "failed" and not result.succeeded
    assert result.exit_code == 3
    assert result.error == "exit code 3"
    assert result.summary is None
    assert "exiting 3 as asked" in spec.log_path.read_text()  # the child's stderr


def test_timeout_escalates_to_sigkill_when_sigterm_is_ignored(tmp_path: Path, make_runtime):
    runtime = make_runtime(kill_grace_s=0.3)
    done = Recorder()
    spec = spec_for(tmp_path, "run-slow", {"sleep_s": 30, "ignore_sigterm": True}, timeout_s=1.0)
    began = time.monotonic()
    runtime.launch(spec, done)
    result = done.wait("run-slow")

    assert result.outcome == "timed_out"
    assert result.error == "timed out after 1.0s"
    assert result.exit_code == -signal.SIGKILL
    assert time.monotonic() - began < 10
    text = spec.log_path.read_text()
    assert "sending SIGTERM" in text and "sending SIGKILL" in text


def test_stop_execution_terminates_a_silent_child(tmp_path: Path, make_runtime, ready):
    runtime = make_runtime()
    done = Recorder()
    runtime.launch(ready_spec(tmp_path, "run-stop", ready), done)
    pid = ready.accept()
    assert runtime.is_live("run-stop")

    assert runtime.stop_execution("run-stop") is True
    result = done.wait("run-stop")
    assert result.outcome == "stopped"
    assert result.error == "stopped: cancelled"
    assert result.exit_code == -signal.SIGTERM
    assert_gone(pid)
    assert runtime.stop_execution("no-such-key") is False


def test_a_stopped_group_is_continued_to_act_on_sigterm(tmp_path: Path, make_runtime, ready):
    runtime = make_runtime(kill_grace_s=30.0)  # a SIGKILL after the grace would show
    done = Recorder()
    runtime.launch(ready_spec(tmp_path, "frozen", ready), done)
    pid = ready.accept()
    os.killpg(os.getpgid(pid), signal.SIGSTOP)  # shim and agent
    began = time.monotonic()
    assert runtime.stop_execution("frozen")
    result = done.wait("frozen")
    assert (result.outcome, result.exit_code) == ("stopped", -signal.SIGTERM)
    assert time.monotonic() - began < 10


def test_kill_all_now_sigkills_without_grace(tmp_path: Path, make_runtime, ready):
    runtime = make_runtime(kill_grace_s=30.0)  # a grace this long would show
    done = Recorder()
    runtime.launch(ready_spec(tmp_path, "run-kill", ready, ignore_sigterm=True), done)
    pid = ready.accept()
    began = time.monotonic()

    runtime.kill_all_now()
    result = done.wait("run-kill")
    assert result.outcome == "interrupted"
    assert result.exit_code == -signal.SIGKILL
    assert time.monotonic() - began < 10
    assert_gone(pid)
    assert runtime.try_reserve() is None  # nothing new after a forced exit


def test_missing_executable_is_an_error_outcome(tmp_path: Path, make_runtime):
    runtime = make_runtime()
    done = Recorder()
    spec = spec_for(tmp_path, "run-missing", argv=[str(tmp_path / "no-such-agent"), "--flag"])
    runtime.launch(spec, done)
    result = done.wait("run-missing")

    assert result.outcome == "error"
    assert result.exit_code is None
    assert result.error is not None and "executable not found" in result.error
    assert "no-such-agent" in result.error
    assert "executable not found" in spec.log_path.read_text()


def test_last_stdout_line_decides_summary(tmp_path: Path, make_runtime):
    runtime = make_runtime()
    done = Recorder()
    no_newline = ('import sys; print("noise"); '
                  'sys.stdout.write(\'{"summary": "tail", "cost_cents": 2}\')')
    not_last = 'print(\'{"summary": "early"}\'); print("plain text last"); print("   ")'
    runtime.launch(spec_for(tmp_path, "tail", argv=(sys.executable, "-c", no_newline)), done)
    runtime.launch(spec_for(tmp_path, "early", argv=(sys.executable, "-c", not_last)), done)

    tail = done.wait("tail")
    assert (tail.summary, tail.cost_cents) == ("tail", 2.0)
    early = done.wait("early")
    assert early.succeeded and (early.summary, early.cost_cents) == (None, None)


def test_large_stdin_is_written_without_blocking(tmp_path: Path, make_runtime):
    runtime = make_runtime()
    done = Recorder()
    blob = "x" * 300_000  # several pipe buffers
    reads = "import json, sys; d = json.load(sys.stdin); print(len(d['payload']['blob']))"
    runtime.launch(spec_for(tmp_path, "reads", {"blob": blob},
                            argv=(sys.executable, "-c", reads)), done)
    runtime.launch(spec_for(tmp_path, "ignores", {"blob": blob},
                            argv=(sys.executable, "-c", "pass")), done)

    assert done.wait("reads").succeeded
    assert "300000" in (tmp_path / "logs" / "reads.log").read_text()
    assert done.wait("ignores").succeeded


def test_executable_errors_keep_their_texts(tmp_path: Path, make_runtime):
    runtime = make_runtime()
    done = Recorder()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    plain = bin_dir / "plain-file"
    plain.write_text("#!/bin/sh\necho never\n")
    plain.chmod(0o644)
    tool = bin_dir / "tool"
    tool.write_text('#!/bin/sh\necho \'{"summary": "from PATH"}\'\n')
    tool.chmod(0o755)
    cwd = tmp_path / "runs" / "relative"
    cwd.mkdir(parents=True)
    (cwd / "local-plain").write_text("data")
    on_path = {**CHILD_ENV, "PATH": str(bin_dir)}
    cases = {
        "not-exec": (spec_for(tmp_path, "not-exec", argv=[str(plain)]),
                     f"cannot start agent: permission denied: {plain}"),
        "relative": (spec_for(tmp_path, "relative", argv=["./local-plain"]),
                     "cannot start agent: permission denied: ./local-plain"),
        "directory": (spec_for(tmp_path, "directory", argv=[str(bin_dir)]),
                      f"cannot start agent: permission denied: {bin_dir}"),
        "bare-missing": (spec_for(tmp_path, "bare-missing", argv=["kandevd-no-such-agent"]),
                         "cannot start agent: executable not found: kandevd-no-such-agent"),
        "bare-plain": (dataclasses.replace(spec_for(tmp_path, "bare-plain",
                                                    argv=["plain-file"]), env=on_path),
                       "cannot start agent: permission denied: plain-file"),
    }
    for key, (spec, error) in cases.items():
        runtime.launch(spec, done)
        result = done.wait(key)
        assert (result.outcome, result.exit_code, result.error) == ("error", None, error), key
        assert error in spec.log_path.read_text()

    found = dataclasses.replace(spec_for(tmp_path, "bare-found", argv=["tool"]), env=on_path)
    runtime.launch(found, done)
    assert done.wait("bare-found").summary == "from PATH"  # looked up in the child's PATH


def test_the_shim_leads_the_group_and_the_agent_sees_its_input(tmp_path: Path, make_runtime,
                                                              ready):
    runtime = make_runtime()
    done = Recorder()
    spec = ready_spec(tmp_path, "group", ready)
    runtime.launch(spec, done)
    pid = ready.accept()
    leader = os.getpgid(pid)
    assert leader != pid and os.getsid(pid) == leader
    cmdline = Path(f"/proc/{leader}/cmdline").read_bytes().split(b"\0")
    assert cmdline[:2] == [b"/bin/sh", b"-c"] and cmdline[3] == b"kandevd-shim"
    environ = Path(f"/proc/{leader}/environ").read_bytes().split(b"\0")
    assert f"KANDEVD_RUN_ID={spec.run_id}".encode() in environ  # set on the shim itself
    assert f"KANDEVD_INPUT={spec.input_path}".encode() in environ
    assert json.loads(spec.input_path.read_text()) == dict(spec.stdin)
    assert runtime.stop_execution("group")
    assert done.wait("group").outcome == "stopped"


def test_summary_comes_from_this_execution_and_skips_our_notes(tmp_path: Path, make_runtime):
    runtime = make_runtime(kill_grace_s=5.0)
    done = Recorder()
    first = spec_for(tmp_path, "same-log", {"summary": "first run"})
    runtime.launch(first, done)
    assert done.wait("same-log").summary == "first run"
    # A second execution appending to the same log prints nothing of its own...
    quiet = spec_for(tmp_path, "same-log", argv=(sys.executable, "-c", "pass"))
    runtime.launch(quiet, done)
    done.results.clear()
    result = done.wait("same-log")
    assert result.succeeded and (result.summary, result.cost_cents) == (None, None)
    # ...and one killed on timeout keeps what it printed, and the shell does not
    # add a "Terminated" line. Its stdout follows our notes in the log.
    slow = spec_for(tmp_path, "slow-summary", timeout_s=0.5, argv=(
        sys.executable, "-c",
        'import time; print(\'{"summary": "partial", "cost_cents": 7}\', flush=True); '
        "time.sleep(30)"))
    runtime.launch(slow, done)
    timed_out = done.wait("slow-summary")
    assert timed_out.outcome == "timed_out" and timed_out.exit_code == -signal.SIGTERM
    assert (timed_out.summary, timed_out.cost_cents) == ("partial", 7.0)
    lines = slow.log_path.read_text().splitlines()
    assert lines[-2].startswith("[kandevd] timed out after 0.5s: sending SIGTERM")
    assert lines[-1] == '{"summary": "partial", "cost_cents": 7}'
    assert "Terminated" not in lines


def test_stderr_after_the_summary_does_not_hide_it(tmp_path: Path, make_runtime):
    runtime = make_runtime()
    done = Recorder()
    script = ('import sys; print("progress"); print(\'{"summary": "ok", "cost_cents": 2}\'); '
              'sys.stdout.flush(); print("warning: late", file=sys.stderr)')
    for key, record in (("with-record", True), ("no-record", False)):
        spec = spec_for(tmp_path, key, argv=(sys.executable, "-c", script))
        if record:
            spec = dataclasses.replace(spec, record_dir=tmp_path / "records" / key)
        runtime.launch(spec, done)
        result = done.wait(key)
        assert (result.summary, result.cost_cents) == ("ok", 2.0)
        # Both streams in the log: stdout after stderr; no stdout file left.
        assert spec.log_path.read_text().splitlines() == [
            "warning: late", "progress", '{"summary": "ok", "cost_cents": 2}']
        if record:
            assert not (tmp_path / "records" / key / "stdout").exists()
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == [
        "no-record.input.json", "no-record.log", "with-record.input.json", "with-record.log"]


class _StopAtSpawn(ExecutionControl):
    """Requests a stop ``delay_s`` after the runner attached the freshly spawned shim."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s

    def attach(self, pgid: int) -> None:
        super().attach(pgid)
        time.sleep(self.delay_s)  # sweeps the moments of the shim's start-up
        self.request_termination("stopped", "at once")


def test_a_stop_right_after_the_spawn_is_not_lost(tmp_path: Path):
    runner = ProcessRunner(kill_grace_s=30.0)
    for index in range(30):
        spec = spec_for(tmp_path, f"early-{index}", argv=("sleep", "5"))
        control = _StopAtSpawn(index * 0.0005)
        began = time.monotonic()
        try:
            result = runner.run(spec, control)
        finally:
            control.close()
        elapsed = time.monotonic() - began
        assert result.outcome == "stopped", (index, result)
        assert elapsed < 1.0, (index, elapsed)  # not the 30 s kill grace


class _ExitAndStop(ExecutionControl):
    """Requests a stop only once the shim has exited (not reaped): both events at once."""

    def attach(self, pgid: int) -> None:
        super().attach(pgid)
        os.waitid(os.P_PID, pgid, os.WEXITED | os.WNOWAIT)  # the shim exited
        self.request_termination("stopped", "too late")


def test_an_exit_seen_with_a_stop_request_counts_as_the_exit(tmp_path: Path):
    spec = spec_for(tmp_path, "exit-first", argv=(sys.executable, "-c", "import sys; "
                                                   "print('{\"summary\": \"s\"}'); sys.exit(4)"))
    control = _ExitAndStop()
    try:
        result = ProcessRunner(kill_grace_s=30.0).run(spec, control)
    finally:
        control.close()
    assert (result.outcome, result.exit_code, result.error, result.summary) == (
        "failed", 4, "exit code 4", "s")
    assert "SIGTERM" not in spec.log_path.read_text()


def test_launch_when_free_gives_the_slot_back_when_start_fails(tmp_path: Path, make_runtime,
                                                               monkeypatch):
    runtime = make_runtime(max_concurrent=1)
    done = Recorder()

    def no_pipe() -> tuple[int, int]:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(process_module.os, "pipe", no_pipe)
    with pytest.raises(OSError, match="Too many open files"):
        runtime.launch_when_free(spec_for(tmp_path, "emfile"), done, lambda: False)
    with pytest.raises(OSError, match="Too many open files"):
        runtime.launch(spec_for(tmp_path, "emfile"), done)
    monkeypatch.undo()
    assert runtime.active == 0 and runtime.live_keys() == frozenset()
    assert runtime.launch_when_free(spec_for(tmp_path, "after"), done, lambda: False)
    assert done.wait("after").succeeded


def test_a_record_dir_keeps_the_record_and_the_exit_file(tmp_path: Path, make_runtime):
    runtime = make_runtime()
    done = Recorder()
    record_dir = tmp_path / "attempts" / "run-rec" / "tok"
    spec = dataclasses.replace(spec_for(tmp_path, "run-rec", {"exit_code": 3}),
                               record_dir=record_dir)
    record_dir.mkdir(parents=True)
    (record_dir / "exit").write_text("0\n")  # stale: never this execution's status
    runtime.launch(spec, done)
    result = done.wait("run-rec")
    assert (result.outcome, result.exit_code) == ("failed", 3)
    assert (record_dir / "exit").read_text() == "3\n"
    record = read_record(record_dir)
    assert record is not None
    assert (record.key, record.run_id, record.session_id) == ("run-rec", "run-rec",
                                                               "sess-run-rec")
    assert record.started_at == result.started_at and record.timeout_s == 30.0
    assert not record_alive(record)  # it ended (and was reaped)


def test_without_a_record_dir_no_temporary_folder_is_left(tmp_path: Path, make_runtime):
    runtime = make_runtime()
    done = Recorder()
    runtime.launch(spec_for(tmp_path, "tmp-rec"), done)
    assert done.wait("tmp-rec").succeeded
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == [
        "tmp-rec.input.json", "tmp-rec.log"]


def test_parse_summary_line():
    assert parse_summary_line('{"summary": "s", "cost_cents": 3}') == ("s", 3.0)
    assert parse_summary_line('{"summary": 5, "cost_cents": "3"}') == (None, None)
    assert parse_summary_line('{"cost_cents": true}') == (None, None)
    assert parse_summary_line("[1, 2]") == (None, None)
    assert parse_summary_line("not json") == (None, None)
    assert parse_summary_line(None) == (None, None)


def test_the_report_carries_an_optional_evaluation_object() -> None:
    assert parse_report('{"summary": "s", "cost_cents": 1, "evaluation": {"score": 0.9}}') \
        == AgentReport("s", 1.0, {"score": 0.9})
    assert parse_report('{"summary": "s", "evaluation": "good"}') == AgentReport("s")
    big = json.dumps({"evaluation": {"notes": "x" * (MAX_EVALUATION_BYTES + 1)}})
    assert parse_report(big).evaluation is None


def test_a_cost_is_taken_from_zero_to_its_largest_only() -> None:
    """A larger one would make the attempts' sum infinite (no JSON answer carries it)."""
    for taken in (0, 12, 0.5, MAX_COST_CENTS):
        assert parse_report(json.dumps({"cost_cents": taken})).cost_cents == taken
    for refused in (-1, MAX_COST_CENTS * 1.01, 1.7e308, 10 ** 400, True, "3", None):
        line = '{"cost_cents": %s}' % (refused if isinstance(refused, int) and
                                       not isinstance(refused, bool) else
                                       json.dumps(refused))
        assert parse_report(line).cost_cents is None, refused
    assert parse_report('{"cost_cents": Infinity}').cost_cents is None


def test_spec_rejects_shell_strings_and_unknown_kinds(tmp_path: Path):
    with pytest.raises(TypeError):
        spec_for(tmp_path, "k", argv="echo hi")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        spec_for(tmp_path, "k", kind="batch")
    assert spec_for(tmp_path, "k", argv=["a", "b"]).argv == ("a", "b")


# -- the bounded pool -------------------------------------------------------


def test_bound_reservations_and_slot_listener(tmp_path: Path, make_runtime):
    done = Recorder()
    slots = SlotCounter(done)
    runtime = make_runtime(max_concurrent=2, on_slot_free=slots)

    first, second = runtime.try_reserve(), runtime.try_reserve()
    assert first is not None and second is not None
    assert runtime.try_reserve() is None
    assert runtime.active == 2 and runtime.max_concurrent == 2
    assert runtime.running == 0  # (what daemon.status reports: nothing has started)
    with pytest.raises(RuntimeFull, match="all 2 slots"):
        runtime.launch(spec_for(tmp_path, "too-many"), done)

    runtime.release(first)  # an unused slot given back wakes nobody: the releaser found no work
    assert slots.count == 0
    assert runtime.active == 1
    runtime.release(first)  # releasing twice is harmless
    assert runtime.active == 1

    runtime.start(second, spec_for(tmp_path, "bounded"), done)
    slots.wait_for(1)
    assert done.results["bounded"].succeeded
    assert done.order == ["done:bounded", "slot"]  # listener after on_done
    assert runtime.active == 0
    assert not runtime.is_live("bounded")
    with pytest.raises(ValueError):
        runtime.start(second, spec_for(tmp_path, "reuse"), done)  # a spent reservation


def test_duplicate_live_key_is_refused_and_slot_returned(tmp_path: Path, make_runtime):
    gate = threading.Event()
    runtime = make_runtime(runner=InProcessRunner(lambda spec: (0 if gate.wait(WAIT_S) else 1,
                                                                None, None)))
    done = Recorder()
    runtime.launch(spec_for(tmp_path, "dup"), done)
    with pytest.raises(ValueError, match="already live"):
        runtime.launch(spec_for(tmp_path, "dup"), done)
    assert runtime.active == 1 and runtime.running == 1
    assert runtime.live_keys() == frozenset({"dup"})
    gate.set()
    assert done.wait("dup").succeeded


def test_in_process_runner(tmp_path: Path, make_runtime):
    def agent(spec: ExecutionSpec) -> tuple[int, str | None, float | None]:
        if spec.key == "boom":
            raise RuntimeError("kaboom")
        return (0, f"did {spec.key}", 1.5) if spec.key == "ok" else (2, None, None)

    runtime = make_runtime(runner=InProcessRunner(agent))
    done = Recorder()
    for key in ("ok", "bad", "boom"):
        runtime.launch(spec_for(tmp_path, key), done)

    ok, bad, boom = done.wait("ok"), done.wait("bad"), done.wait("boom")
    assert (ok.outcome, ok.summary, ok.cost_cents) == ("succeeded", "did ok", 1.5)
    assert (bad.outcome, bad.exit_code, bad.error) == ("failed", 2, "exit code 2")
    assert boom.outcome == "error" and "kaboom" in (boom.error or "")
    assert done.threads["ok"].startswith("kandevd-exec-worker-")
    assert not (tmp_path / "runs").exists()  # no child, no files


def test_on_done_exceptions_are_logged_not_propagated(tmp_path: Path, make_runtime, caplog):
    slots = SlotCounter()
    runtime = make_runtime(runner=InProcessRunner(lambda spec: (0, None, None)),
                           on_slot_free=slots)

    def explode(result: ExecutionResult) -> None:
        raise RuntimeError("on_done bug")

    with caplog.at_level(logging.ERROR, logger="kandevd.runtime"):
        runtime.launch(spec_for(tmp_path, "explodes"), explode)
        slots.wait_for(1)
    assert runtime.active == 0
    assert any("on_done for execution explodes raised" in r.getMessage() for r in caplog.records)


def test_stop_called_from_on_done_does_not_deadlock(tmp_path: Path, make_runtime):
    runtime = make_runtime(runner=InProcessRunner(lambda spec: (0, None, None)))
    returned = threading.Event()

    def stop_from_worker(result: ExecutionResult) -> None:
        runtime.stop()
        returned.set()

    runtime.launch(spec_for(tmp_path, "self-stop"), stop_from_worker)
    assert returned.wait(WAIT_S)
    runtime.stop()  # joins the worker that began the stop
    with pytest.raises(RuntimeStopped):
        runtime.launch(spec_for(tmp_path, "late"), stop_from_worker)


# -- shutdown -----------------------------------------------------------------


def test_stop_waits_for_short_runs_and_interrupts_long_ones(tmp_path: Path, make_runtime, ready):
    runtime = make_runtime(max_concurrent=2, stop_grace_s=1.5, kill_grace_s=2.0)
    done = Recorder()
    runtime.launch(spec_for(tmp_path, "short", {"sleep_s": 0.2}), done)
    runtime.launch(ready_spec(tmp_path, "long", ready), done)
    pid = ready.accept()

    # Several threads stop at once; every one returns only when all is done.
    returned: list[str] = []
    stoppers = [threading.Thread(target=lambda n=n: (runtime.stop(), returned.append(n)))
                for n in ("a", "b")]
    for thread in stoppers:
        thread.start()
    runtime.stop()
    for thread in stoppers:
        thread.join(WAIT_S)
        assert not thread.is_alive()

    assert sorted(returned) == ["a", "b"]
    assert done.results["short"].outcome == "succeeded"  # finished inside the grace
    long = done.results["long"]
    assert long.outcome == "interrupted"
    assert long.error == "interrupted: daemon shutting down"
    assert_gone(pid)
    assert runtime.active == 0 and runtime.live_keys() == frozenset()
    assert not [t for t in threading.enumerate() if t.name.startswith("kandevd-exec-")]
    assert runtime.try_reserve() is None
    with pytest.raises(RuntimeStopped, match="stopping"):
        runtime.launch(spec_for(tmp_path, "after-stop"), done)
    runtime.stop()  # idempotent


def test_reservation_cannot_start_after_stop(tmp_path: Path, make_runtime):
    runtime = make_runtime(runner=InProcessRunner(lambda spec: (0, None, None)))
    reservation = runtime.try_reserve()
    assert reservation is not None
    runtime.stop()
    with pytest.raises(RuntimeStopped):
        runtime.start(reservation, spec_for(tmp_path, "late"), Recorder())
    assert runtime.active == 0  # the failed start gave the slot back


def test_stdin_object_arrives_as_one_json_line(tmp_path: Path, make_runtime):
    runtime = make_runtime()
    done = Recorder()
    dump = "import sys; print(sys.stdin.read().strip())"
    spec = spec_for(tmp_path, "stdin", {"a": [1, 2]}, argv=(sys.executable, "-c", dump))
    runtime.launch(spec, done)
    assert done.wait("stdin").succeeded
    first = spec.log_path.read_text().splitlines()[0]
    assert json.loads(first) == dict(spec.stdin)


def test_a_signal_death_while_stopping_is_interrupted_not_failed(tmp_path: Path, make_runtime):
    entered, gate = threading.Event(), threading.Event()

    def agent(spec: ExecutionSpec) -> tuple[int, str | None, float | None]:
        if spec.key == "before":
            return (-15, None, None)  # not stopping yet: an ordinary failure
        entered.set()
        assert gate.wait(WAIT_S)
        return (-2, None, None)  # e.g. the terminal's Ctrl-C reached the agent too

    runtime = make_runtime(runner=InProcessRunner(agent), stop_grace_s=WAIT_S)
    done = Recorder()
    runtime.launch(spec_for(tmp_path, "before"), done)
    assert done.wait("before").outcome == "failed"
    runtime.launch(spec_for(tmp_path, "during"), done)
    assert entered.wait(WAIT_S)
    stopper = threading.Thread(target=runtime.stop)
    stopper.start()
    while not runtime.stopping:
        time.sleep(0.01)
    gate.set()
    result = done.wait("during")
    stopper.join(WAIT_S)
    assert (result.outcome, result.exit_code) == ("interrupted", -2)
    assert "killed by signal SIGINT" in (result.error or "")


def test_the_pool_reuses_its_workers_and_stop_joins_them(tmp_path: Path, make_runtime):
    """No thread per execution: a few workers serve many executions, and stop() joins them."""
    runtime = make_runtime(max_concurrent=2, runner=InProcessRunner(lambda spec: (0, None, None)))
    done = Recorder()
    before = {t.ident for t in threading.enumerate()}
    for index in range(20):  # each waits for a free slot: at most 2 at once
        assert runtime.launch_when_free(spec_for(tmp_path, f"r{index}"), done, lambda: False)
    for index in range(20):
        assert done.wait(f"r{index}").outcome == "succeeded"
    workers = {t for t in threading.enumerate()
               if t.name.startswith("kandevd-exec-worker-") and t.ident not in before}
    assert 1 <= len(workers) <= 2
    assert set(done.threads.values()) <= {t.name for t in workers}
    runtime.stop()
    assert not any(t.is_alive() for t in workers)


class _WorkerDeath(BaseException):
    """Not an Exception: nothing in the runtime catches it, so the worker dies."""


def test_a_dead_worker_never_runs_its_execution_again(tmp_path: Path, make_runtime):
    calls: list[str] = []

    def agent(spec: ExecutionSpec) -> tuple[int, str | None, float | None]:
        calls.append(spec.key)
        if spec.key == "dies":
            raise _WorkerDeath()
        return (0, None, None)

    done = Recorder()
    slots = SlotCounter()
    runtime = make_runtime(max_concurrent=1, runner=InProcessRunner(agent), on_slot_free=slots)
    unraisable: list[Any] = []
    previous_hook = threading.excepthook
    threading.excepthook = unraisable.append  # the dying worker's traceback, kept quiet
    try:
        runtime.launch(spec_for(tmp_path, "dies"), done)
        slots.wait_for(1)  # its slot frees as the worker dies
        assert runtime.active == 0
        runtime.launch(spec_for(tmp_path, "after"), done)  # a replacement worker runs it
        assert done.wait("after").outcome == "succeeded"
    finally:
        threading.excepthook = previous_hook
    assert calls == ["dies", "after"]  # the dead worker's execution ran once
    dead = done.results["dies"]  # and was settled: an error, never left live
    assert dead.outcome == "error" and "_WorkerDeath" in (dead.error or "")
    assert [type(u.exc_value) for u in unraisable] == [_WorkerDeath]
