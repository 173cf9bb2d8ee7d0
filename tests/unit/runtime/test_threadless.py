"""Executions no thread waits for: the keeper's word of an exit finishes them where it
arrives; a stop, a long run, a large stdout or a death by a stop signal hands them to a
worker thread, which ends them as before. A real keeper, real agents."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kandevd.runtime import threadless
from kandevd.runtime.execution import FAILED, STOPPED, SUCCEEDED, ExecutionResult, ExecutionSpec
from kandevd.runtime.keeperclient import KeeperClient
from kandevd.runtime.keeperrunner import KeeperRunner
from kandevd.runtime.pool import AgentRuntime

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pidfds")
WAIT_S = 30.0


class Results:
    """on_done callbacks collected; wait for a key's."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.by_key: dict[str, ExecutionResult] = {}
        self.threads: dict[str, str] = {}

    def on_done(self, result: ExecutionResult) -> None:
        with self.cond:
            self.by_key[result.key] = result
            self.threads[result.key] = threading.current_thread().name
            self.cond.notify_all()

    def wait(self, *keys: str) -> list[ExecutionResult]:
        with self.cond:
            assert self.cond.wait_for(lambda: all(k in self.by_key for k in keys), WAIT_S), \
                f"no result for {[k for k in keys if k not in self.by_key]}"
            return [self.by_key[k] for k in keys]


@pytest.fixture
def runtime(tmp_path: Path) -> Iterator[tuple[AgentRuntime, KeeperClient]]:
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    client = KeeperClient(home)
    client.connect()
    pool = AgentRuntime(4, stop_grace_s=5.0, runner=KeeperRunner(client, kill_grace_s=1.0))
    try:
        yield pool, client
    finally:
        pool.stop()
        client.close(quit_keeper=True)


def spec(tmp_path: Path, key: str, *argv: str) -> ExecutionSpec:
    return ExecutionSpec(key=key, kind="launch", argv=argv, stdin={"key": key},
                         cwd=tmp_path / "work", log_path=tmp_path / "logs" / f"{key}.log",
                         timeout_s=60)


def python(code: str) -> tuple[str, ...]:
    return (sys.executable, "-c", code)


def test_executions_that_end_on_their_own_need_no_thread(
        runtime: tuple[AgentRuntime, KeeperClient], tmp_path: Path) -> None:
    pool, _client = runtime
    results = Results()
    keys = [f"e{i}" for i in range(12)]
    for first in range(0, len(keys), 4):  # (4 slots: a batch at a time)
        for key in keys[first:first + 4]:
            pool.launch(spec(tmp_path, key, "/bin/sh", "-c", 'echo \'{"summary": "done"}\''),
                        results.on_done)
        results.wait(*keys[first:first + 4])
        with pool._cond:  # (each slot frees just after its on_done)
            assert pool._cond.wait_for(lambda: pool.active == 0, WAIT_S)
    got = results.wait(*keys)
    assert [r.outcome for r in got] == [SUCCEEDED] * len(keys)
    assert {r.summary for r in got} == {"done"}
    assert pool._workers_started == 0  # no worker thread was ever started
    assert set(results.threads.values()) == {"kandevd-keeper-reader"}


def test_a_stop_hands_the_execution_to_a_thread_that_stops_the_agent(
        runtime: tuple[AgentRuntime, KeeperClient], tmp_path: Path) -> None:
    pool, client = runtime
    results = Results()
    pool.launch(spec(tmp_path, "long", "/bin/sleep", "60"), results.on_done)
    _wait_spawned(client)
    assert pool.stop_execution("long", "cancelled by a test")
    (result,) = results.wait("long")
    assert result.outcome == STOPPED and result.error == "stopped: cancelled by a test"
    assert pool._workers_started == 1


def test_an_execution_still_running_after_a_while_is_waited_for_by_a_thread(
        runtime: tuple[AgentRuntime, KeeperClient], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(threadless, "THREADLESS_WAIT_S", 0.2)
    monkeypatch.setattr(threadless, "_WATCH_TICK_S", 0.05)
    pool, client = runtime
    results = Results()
    marker = tmp_path / "go"
    pool.launch(spec(tmp_path, "slow", *python(
        f"import os, time\nwhile not os.path.exists({str(marker)!r}): time.sleep(0.02)")),
        results.on_done)
    _wait_spawned(client)
    # (the watcher hands it to a worker after THREADLESS_WAIT_S)
    _until(lambda: pool._workers_started == 1, "a worker took it")
    marker.touch()
    (result,) = results.wait("slow")
    assert result.outcome == SUCCEEDED
    assert results.threads["slow"].startswith("kandevd-exec-worker-")


def test_a_large_stdout_is_merged_by_a_thread(
        runtime: tuple[AgentRuntime, KeeperClient], tmp_path: Path) -> None:
    pool, _client = runtime
    results = Results()
    pool.launch(spec(tmp_path, "loud", *python(
        "import sys\nsys.stdout.write('x' * 400_000 + '\\n{\"summary\": \"loud\"}\\n')")),
        results.on_done)
    (result,) = results.wait("loud")
    assert result.outcome == SUCCEEDED and result.summary == "loud"
    assert results.threads["loud"].startswith("kandevd-exec-worker-")
    assert (tmp_path / "logs" / "loud.log").read_text().count("x") >= 400_000


def test_a_death_by_a_stop_signal_is_decided_by_a_thread(
        runtime: tuple[AgentRuntime, KeeperClient], tmp_path: Path) -> None:
    pool, _client = runtime
    results = Results()
    pool.launch(spec(tmp_path, "term", *python("import os, signal\nos.kill(os.getpid(), "
                                                  "signal.SIGTERM)")), results.on_done)
    (result,) = results.wait("term")
    # Nobody stops the runtime: an ordinary failed attempt, decided off the reader.
    assert result.outcome == FAILED and result.exit_code == -15
    assert results.threads["term"].startswith("kandevd-exec-worker-")


def _wait_spawned(client: KeeperClient) -> None:
    _until(lambda: client.live_count() > 0, "the keeper reported the agent spawned")


def _until(check: Callable[[], bool], what: str) -> None:
    """Polled: the keeper and the watcher say nothing to a test."""
    pause = threading.Event()
    for _ in range(int(WAIT_S / 0.02)):
        if check():
            return
        pause.wait(0.02)
    raise AssertionError(f"never: {what}")
