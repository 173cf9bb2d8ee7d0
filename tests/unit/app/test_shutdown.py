"""ShutdownCoordinator and SignalWiring: the order, the failures, the store closed last.

The central promise: the store is closed by the coordinator only after every
loop has joined, even when a loop's tick is stuck inside a store transaction;
the stop waits for that tick (no deadline), and the tick's work is committed.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import textwrap
import threading
from datetime import datetime
from pathlib import Path

import pytest

from kandevd.app.shutdown import ShutdownCoordinator, SignalWiring
from kandevd.lifecycle import Loop, LoopState, StopSignal
from kandevd.store.base import StoreClosedError
from kandevd.store.open import open_store
from kandevd.store.sqlite import Store

TIMEOUT = 10.0
NOW = "2026-12-02T13:00:00.000000Z"


class StoreWorkLoop(Loop):
    """A tick that opens a write transaction, then parks until the test releases it."""

    def __init__(self, store: Store, parent: StopSignal) -> None:
        super().__init__("storework", parent=parent)
        self.store = store
        self.in_transaction = threading.Event()
        self.release = threading.Event()
        self.done: list[str] = []

    def tick(self, now: datetime) -> float:
        if self.done:
            return 3600.0
        with self.store.transaction() as conn:
            conn.execute("INSERT INTO workspaces (id, name, office_workflow_id, created_at, "
                         "updated_at) VALUES ('ws-tick', 'from the tick', '', ?, ?)", (NOW, NOW))
            self.in_transaction.set()
            assert self.release.wait(TIMEOUT)
        self.done.append("tick committed")
        return 3600.0


def test_store_closes_only_after_a_loop_blocked_in_store_work_has_joined(tmp_path: Path) -> None:
    store = open_store(tmp_path / "kandevd.db")
    parent = StopSignal()
    loop = StoreWorkLoop(store, parent)
    order: list[str] = []
    reached_loop_stop = threading.Event()

    def stop_loop() -> None:
        reached_loop_stop.set()
        loop.stop()
        order.append("loop joined")

    def close_store() -> None:
        order.append("closing store")
        store.close()

    coordinator = ShutdownCoordinator([
        ("signal loops", parent.set), ("stop storework loop", stop_loop),
        ("close store", close_store),
    ])
    loop.start()
    assert loop.in_transaction.wait(TIMEOUT)
    stopper = threading.Thread(target=coordinator.shutdown, name="test-coordinator")
    stopper.start()
    assert reached_loop_stop.wait(TIMEOUT)

    # The coordinator is inside loop.stop(), which has no deadline: it waits.
    stopper.join(0.2)
    assert stopper.is_alive()
    assert coordinator.started
    assert loop.state is LoopState.STOPPING
    assert not store.closed and order == []

    loop.release.set()
    stopper.join(TIMEOUT)
    assert not stopper.is_alive()
    assert order == ["loop joined", "closing store"]
    assert loop.done == ["tick committed"]
    assert loop.state is LoopState.STOPPED
    assert store.closed and coordinator.failures == []
    with pytest.raises(StoreClosedError):
        store.query("SELECT 1")
    reopened = Store(tmp_path / "kandevd.db")
    try:
        assert [r["id"] for r in reopened.query("SELECT id FROM workspaces")] == ["ws-tick"]
    finally:
        reopened.close()


def test_steps_run_in_order_once_failures_are_collected(
        caplog: pytest.LogCaptureFixture) -> None:
    ran: list[str] = []

    def step(name: str, fail: bool = False):
        def run() -> None:
            ran.append(name)
            if fail:
                raise RuntimeError(f"{name} broke")
        return run

    coordinator = ShutdownCoordinator([
        ("intake", step("intake")), ("loops", step("loops", fail=True)),
        ("runtime", step("runtime")), ("store", step("store", fail=True)),
    ])
    with caplog.at_level(logging.DEBUG, logger="kandevd.shutdown"):
        failures = coordinator.shutdown()
        again = coordinator.shutdown()  # a second caller waits for the first; nothing reruns
    assert ran == ["intake", "loops", "runtime", "store"]
    assert [(name, str(exc)) for name, exc in failures] == [("loops", "loops broke"),
                                                             ("store", "store broke")]
    assert again is failures
    messages = [r.getMessage() for r in caplog.records if r.name == "kandevd.shutdown"]
    assert messages[0] == "Graceful shutdown started"
    assert messages[-1] == "Graceful shutdown complete"
    assert messages.count("Graceful shutdown started") == 1
    assert any("2 failed step(s): loops, store" in m for m in messages)


def test_concurrent_shutdown_callers_all_return_after_the_last_step() -> None:
    gate = threading.Event()
    finished = threading.Event()

    def slow_last_step() -> None:
        assert gate.wait(TIMEOUT)
        finished.set()

    coordinator = ShutdownCoordinator([("slow", slow_last_step)])
    returned_before_finish: list[bool] = []

    def caller() -> None:
        coordinator.shutdown()
        returned_before_finish.append(not finished.is_set())

    callers = [threading.Thread(target=caller) for _ in range(3)]
    for thread in callers:
        thread.start()
    gate.set()
    for thread in callers:
        thread.join(TIMEOUT)
    assert returned_before_finish == [False, False, False]


SIGNAL_SCRIPT = textwrap.dedent("""
    import logging, sys, threading
    from kandevd.app.shutdown import MainThreadWaiter, SignalWiring

    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(message)s")
    requested = threading.Event()
    forced = []
    wiring = SignalWiring(requested, lambda: False, on_force=lambda: forced.append(1))
    wiring.install()
    # As the daemon's main thread waits: an Event.wait() here could hold the Event's
    # lock when the handler's set() needs it, and the process would hang.
    waiter = MainThreadWaiter()
    waiter.install()
    print("ready", flush=True)
    waiter.wait(requested)
    print("stop requested", flush=True)
    sys.stdin.readline()  # parked 'in the stop' until the second signal arrives
    print("not forced", flush=True)
""")


@pytest.mark.parametrize(("first", "second"), [(signal.SIGINT, signal.SIGINT),
                                               (signal.SIGTERM, signal.SIGINT),
                                               (signal.SIGINT, signal.SIGTERM)])
def test_first_signal_only_sets_the_flag_the_second_forces_exit_1(
        first: signal.Signals, second: signal.Signals) -> None:
    proc = subprocess.Popen([sys.executable, "-c", SIGNAL_SCRIPT], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    guard = threading.Timer(3 * TIMEOUT, proc.kill)  # a hung child fails, not hangs, the test
    guard.start()
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(first)
        assert proc.stdout.readline().strip() == "stop requested"
        proc.send_signal(second)
        _out, err = proc.communicate(timeout=TIMEOUT)
    finally:
        guard.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1
    lines = err.strip().splitlines()
    # The handler logs nothing (a blocked log handler must not hold the main thread in
    # it); it only records which signal came, for the shutdown worker to log.
    assert lines == ["kandevd: Received second shutdown signal, forcing exit"]


def test_install_and_restore_put_back_the_previous_handlers() -> None:
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    requested = threading.Event()
    wiring = SignalWiring(requested, lambda: False)
    wiring.install()
    try:
        assert signal.getsignal(signal.SIGTERM) == wiring._handle
        signal.raise_signal(signal.SIGTERM)  # the handler only records the request
        assert requested.wait(TIMEOUT)
    finally:
        wiring.restore()
    assert {sig: signal.getsignal(sig) for sig in before} == before
