"""Loop lifecycle: states, idempotent start/stop, joins, the self-join guard, parent stop.

The stateful test drives Loops through random sequences of start, stop from
several threads at once, wake, a tick that blocks until the test releases it,
a tick that fans out handlers (one of which fails), a tick and a handler that
try to stop their own loop, and the parent stop signal. After every step it
checks what the ``kandevd.lifecycle`` docstring promises, and at the end of
every example that no thread of any loop is left alive.
"""

from __future__ import annotations

import itertools
import logging
import sqlite3
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kandevd.lifecycle import (
    MIN_WAIT_S,
    FanOut,
    Loop,
    LoopSelfJoinError,
    LoopState,
    LoopStateError,
    StopSignal,
)

TIMEOUT = 10.0
IDLE_S = 3600.0  # ticks only happen on start() and wake(), never on their own
_names = itertools.count()


def eventually(predicate: Callable[[], Any], what: str) -> None:
    """Poll a condition that has no event of its own (a Loop state), bounded."""
    deadline = time.monotonic() + TIMEOUT
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.001)


def loop_threads(name: str) -> list[threading.Thread]:
    """Live threads belonging to the loop ``name``: its own and its fan-out handlers."""
    return [t for t in threading.enumerate()
            if t.name == f"kandevd-{name}" or t.name.startswith(f"{name}:")]


class ProbeLoop(Loop):
    """A loop whose next tick does what the test asks: return, block, fan out, self-stop.

    Every tick and handler is counted under one condition, so the test can
    wait for "the tick is parked on the gate" and check "nothing is active"
    at the instant ``stop()`` returns.
    """

    def __init__(self, *, parent: StopSignal | None = None) -> None:
        super().__init__(f"probe{next(_names)}", parent=parent)
        self.cond = threading.Condition()
        self.mode = "quick"  # quick | block | fanout | self_stop
        self.fan = 2
        self.gate = threading.Event()
        self.entered = 0
        self.finished = 0
        self.in_tick = False
        self.active_handlers = 0
        self.self_stop_errors: list[BaseException] = []
        self.results: list[dict[str, Any]] = []

    def tick(self, now: datetime) -> float:
        assert isinstance(now, datetime)
        with self.cond:
            mode = self.mode
            self.in_tick = True
            self.entered += 1
            self.cond.notify_all()
        try:
            if mode == "block":
                self.gate.wait(TIMEOUT)
            elif mode == "fanout":
                handlers = [(f"h{i}", self._handler) for i in range(self.fan)]
                self.results.append(self.fanout.run([*handlers, ("boom", self._boom)]))
            elif mode == "self_stop":
                self._try_stop()
                self.results.append(self.fanout.run([("stopper", self._try_stop)]))
        finally:
            with self.cond:
                self.in_tick = False
                self.finished += 1
                self.cond.notify_all()
        return IDLE_S

    def _park(self) -> None:
        with self.cond:
            self.active_handlers += 1
            self.cond.notify_all()
        try:
            self.gate.wait(TIMEOUT)
        finally:
            with self.cond:
                self.active_handlers -= 1
                self.cond.notify_all()

    def _handler(self) -> str:
        self._park()
        return "ok"

    def _boom(self) -> None:
        self._park()
        raise ValueError("boom")

    def _try_stop(self) -> None:
        try:
            self.stop()
        except BaseException as exc:
            self.self_stop_errors.append(exc)

    def wait_for(self, predicate: Callable[[], bool], what: str) -> None:
        with self.cond:
            if not self.cond.wait_for(predicate, TIMEOUT):
                raise AssertionError(f"timed out waiting for {what}")

    def idle(self) -> bool:
        """No tick and no handler running (read under the counters' lock)."""
        with self.cond:
            return not self.in_tick and self.active_handlers == 0


class LoopMachine(RuleBasedStateMachine):
    """A model of one Loop: its expected state, and whether a tick is parked on the gate."""

    def __init__(self) -> None:
        super().__init__()
        self.loops: list[ProbeLoop] = []
        self._new_loop()

    def _new_loop(self) -> None:
        self.parent = StopSignal()
        self.loop = ProbeLoop(parent=self.parent)
        self.loops.append(self.loop)
        self.expected = LoopState.STOPPED
        self.blocked: str | None = None  # "block" or "fanout" while a tick is parked

    # -- rules --------------------------------------------------------------------
    @rule()
    def start(self) -> None:
        loop = self.loop
        before = loop.entered
        loop.start()
        assert loop.state is LoopState.RUNNING
        if self.expected is LoopState.STOPPED:
            loop.wait_for(lambda: loop.finished > before, "the first tick after start()")
        else:  # a no-op: no new thread, no extra tick
            assert len([t for t in loop_threads(loop.name) if t.name.startswith("kandevd-")]) == 1
        self.expected = LoopState.RUNNING

    @precondition(lambda self: self.blocked is None)
    @rule()
    def wake(self) -> None:
        loop = self.loop
        before = loop.finished
        loop.wake()
        if self.expected is LoopState.RUNNING:
            loop.wait_for(lambda: loop.finished > before, "the tick wake() asked for")

    @precondition(lambda self: self.expected is LoopState.RUNNING and self.blocked is None)
    @rule(fanout=st.booleans(), fan=st.integers(min_value=0, max_value=3))
    def park_a_tick(self, fanout: bool, fan: int) -> None:
        """The next tick blocks on the gate (itself, or in the handlers it fanned out)."""
        loop = self.loop
        loop.gate.clear()
        loop.fan = fan
        loop.mode = "fanout" if fanout else "block"
        before = loop.entered
        loop.wake()
        loop.wait_for(lambda: loop.entered > before, "the parked tick to start")
        if fanout:
            loop.wait_for(lambda: loop.active_handlers == fan + 1, "every handler to park")
        loop.mode = "quick"
        self.blocked = "fanout" if fanout else "block"

    @precondition(lambda self: self.blocked is not None)
    @rule()
    def release(self) -> None:
        loop = self.loop
        target = loop.entered
        loop.gate.set()
        loop.wait_for(lambda: loop.finished == target and loop.active_handlers == 0,
                      "the released tick to return")
        if self.blocked == "fanout":
            result = loop.results[-1]
            assert isinstance(result.pop("boom"), ValueError)  # isolated, not raised
            assert set(result.values()) <= {"ok"}
        self.blocked = None
        assert loop.state is LoopState.RUNNING  # a failing handler never kills the loop

    @rule(callers=st.integers(min_value=1, max_value=4))
    def stop(self, callers: int) -> None:
        """stop() from several threads at once: one transition, all return after the join."""
        loop = self.loop
        seen: list[tuple[BaseException | None, bool, bool]] = []
        seen_lock = threading.Lock()

        def stopper() -> None:
            error: BaseException | None = None
            try:
                loop.stop()
            except BaseException as exc:
                error = exc
            alive = any(t.is_alive() for t in loop_threads(loop.name))
            with seen_lock:
                seen.append((error, loop.idle(), alive))

        threads = [threading.Thread(target=stopper, name=f"stopper-{loop.name}-{i}")
                   for i in range(callers)]
        for thread in threads:
            thread.start()
        if self.blocked is not None:
            eventually(lambda: loop.state is LoopState.STOPPING, "state stopping")
            assert all(t.is_alive() for t in threads), "stop() returned before the tick did"
            assert not loop.idle()
            loop.gate.set()
        for thread in threads:
            thread.join(TIMEOUT)
            assert not thread.is_alive()
        assert seen == [(None, True, False)] * callers
        assert loop.state is LoopState.STOPPED
        self.expected = LoopState.STOPPED
        self.blocked = None

    @precondition(lambda self: self.expected is LoopState.RUNNING and self.blocked is None)
    @rule()
    def stop_from_inside(self) -> None:
        """A tick and a fanned-out handler calling stop() on their own loop get an error."""
        loop = self.loop
        before = loop.finished
        loop.self_stop_errors.clear()
        loop.mode = "self_stop"
        loop.wake()
        loop.wait_for(lambda: loop.finished > before, "the self-stopping tick")
        loop.mode = "quick"
        assert [type(e) for e in loop.self_stop_errors] == [LoopSelfJoinError] * 2
        assert "own thread" in str(loop.self_stop_errors[0])
        assert loop.state is LoopState.RUNNING

    @rule()
    def parent_stop(self) -> None:
        """The parent signal drains like stop(): the tick and its handlers finish first."""
        loop = self.loop
        own = [t for t in loop_threads(loop.name) if t.name.startswith("kandevd-")]
        self.parent.set()
        if self.expected is LoopState.RUNNING:
            # Stopping, or already stopped when its thread was quick to end.
            assert loop.state in (LoopState.STOPPING, LoopState.STOPPED)
            with pytest.raises(LoopStateError, match=r"while stopping|parent stop signal"):
                loop.start()
            [thread] = own
            if self.blocked is not None:
                assert thread.is_alive() and not loop.idle()
                assert loop.state is LoopState.STOPPING
                loop.gate.set()
            thread.join(TIMEOUT)
            assert not thread.is_alive()
            assert loop.idle()
            assert not loop_threads(loop.name)
            # The parent's stop ends as stop() does, with nobody joining it.
            assert loop.state is LoopState.STOPPED
            loop.stop()  # a no-op now
        assert loop.state is LoopState.STOPPED
        with pytest.raises(LoopStateError, match="parent stop signal"):
            loop.start()
        assert loop.state is LoopState.STOPPED
        self._new_loop()  # the parent is one-shot: carry on with a fresh pair

    # -- invariants ------------------------------------------------------------------
    @invariant()
    def state_matches_model(self) -> None:
        assert self.loop.state is self.expected
        if self.expected is LoopState.STOPPED:
            assert not loop_threads(self.loop.name)

    def teardown(self) -> None:
        for loop in self.loops:
            loop.gate.set()
            loop.stop()
        names = {loop.name for loop in self.loops}
        left = [t.name for t in threading.enumerate()
                if any(t.name == f"kandevd-{n}" or t.name.startswith(f"{n}:") for n in names)
                or t.name.startswith("stopper-")]
        assert left == [], f"threads left alive: {left}"


LoopMachine.TestCase.settings = settings(max_examples=30, stateful_step_count=15,
                                         deadline=None)
TestLoopMachine = LoopMachine.TestCase


# -- plain examples of the same promises ----------------------------------------------


class Counting(Loop):
    def __init__(self, delays: list[Any] | None = None, **kwargs: Any) -> None:
        super().__init__(f"count{next(_names)}", **kwargs)
        self.delays = list(delays or [])
        self.calls: list[datetime] = []
        self.ticked = threading.Condition()
        self.stopped_in: str | None = None

    def tick(self, now: datetime) -> Any:
        with self.ticked:
            self.calls.append(now)
            self.ticked.notify_all()
        return self.delays.pop(0) if self.delays else IDLE_S

    def wait_ticks(self, count: int) -> None:
        with self.ticked:
            assert self.ticked.wait_for(lambda: len(self.calls) >= count, TIMEOUT)

    def on_stopped(self) -> None:
        self.stopped_in = threading.current_thread().name


def test_tick_is_a_plain_method_callable_without_a_thread() -> None:
    loop = Counting(delays=[7.5])
    before = set(threading.enumerate())
    moment = datetime(2026, 12, 2, 13, 0)
    assert loop.tick(moment) == 7.5
    assert loop.calls == [moment]
    assert set(threading.enumerate()) == before
    assert loop.state is LoopState.STOPPED
    loop.stop()  # stopping a loop that never started is a no-op


def test_base_loop_requires_a_tick() -> None:
    with pytest.raises(TypeError, match="abstract method"):
        Loop("bare")  # type: ignore[abstract]


def test_wake_interrupts_a_long_wait_and_on_stopped_runs_in_the_loop_thread() -> None:
    loop = Counting()
    loop.start()
    loop.wait_ticks(1)
    loop.wake()
    loop.wait_ticks(2)
    loop.stop()
    assert loop.stopped_in == f"kandevd-{loop.name}"
    assert loop.ticks == len(loop.calls) == 2


def test_a_failing_tick_is_logged_and_retried(caplog: pytest.LogCaptureFixture) -> None:
    class Flaky(Counting):
        error_backoff_s = MIN_WAIT_S

        def tick(self, now: datetime) -> Any:
            value = super().tick(now)
            if len(self.calls) == 1:
                raise RuntimeError("first tick fails")
            if len(self.calls) == 2:
                return None  # not a number of seconds: a tick bug, treated like a failure
            return value

    loop = Flaky()
    with caplog.at_level(logging.ERROR, logger=loop.log.name):
        loop.start()
        loop.wait_ticks(3)
        loop.stop()
    assert loop.state is LoopState.STOPPED
    assert sum("tick failed" in r.getMessage() for r in caplog.records) == 2


def test_an_infinite_delay_still_wakes_and_stops() -> None:
    loop = Counting(delays=[float("inf")])
    loop.start()
    loop.wait_ticks(1)
    loop.wake()
    loop.wait_ticks(2)
    loop.stop()
    assert loop.state is LoopState.STOPPED


def test_a_clock_that_jumps_ahead_ends_the_wait_of_a_loop_that_checks_it() -> None:
    """A laptop that slept: its monotonic clock stood still while the wall clock
    moved on. A loop with ``clock_check_s`` ticks once a check sees the clock past
    its wait's end; one without it (as before) would wait out the hour."""
    jumped = threading.Event()

    def clock() -> datetime:
        moment = datetime(2026, 12, 7, 12, 0)
        return moment + timedelta(hours=2) if jumped.is_set() else moment

    class Checking(Counting):
        clock_check_s = 0.02

    loop = Checking(delays=[IDLE_S], clock=clock)
    loop.start()
    try:
        loop.wait_ticks(1)
        jumped.set()
        with loop.ticked:  # (TIMEOUT: 10 s, against the hour the wait would have been)
            woke = loop.ticked.wait_for(lambda: len(loop.calls) >= 2, TIMEOUT)
    finally:
        loop.wake()
        loop.stop()
    assert woke, "the wait went on after the clock had passed its end"
    assert loop.calls[1] - loop.calls[0] == timedelta(hours=2)


def test_a_loop_that_checks_the_clock_still_waits_while_it_stands_still() -> None:
    """A clock that does not move (a test's, or no sleep at all): the checks alone end
    no wait; a wake still does."""
    moment = datetime(2026, 12, 7, 12, 0)

    class Checking(Counting):
        clock_check_s = 0.01

    loop = Checking(delays=[IDLE_S], clock=lambda: moment)
    loop.start()
    loop.wait_ticks(1)
    with loop.ticked:
        assert not loop.ticked.wait_for(lambda: len(loop.calls) >= 2, 0.2)
    loop.wake()
    loop.wait_ticks(2)
    loop.stop()
    assert loop.ticks == 2


def test_stop_from_the_tick_raises_instead_of_deadlocking() -> None:
    errors: list[BaseException] = []

    class SelfStopping(Counting):
        def tick(self, now: datetime) -> Any:
            try:
                self.stop()
            except LoopSelfJoinError as exc:
                errors.append(exc)
            return super().tick(now)

    loop = SelfStopping()
    loop.start()
    loop.wait_ticks(1)
    assert loop.state is LoopState.RUNNING
    loop.stop()
    assert len(errors) == 1 and loop.name in str(errors[0])


def test_a_parent_set_before_start_keeps_the_loop_from_starting() -> None:
    parent = StopSignal()
    parent.set()
    parent.set()  # one-shot: a second set is a no-op
    loop = Counting(parent=parent)  # subscribing to a fired signal is seen at once
    with pytest.raises(LoopStateError, match="parent stop signal"):
        loop.start()
    assert loop.state is LoopState.STOPPED and not loop_threads(loop.name)


def test_one_parent_stops_every_loop_subscribed_to_it() -> None:
    parent = StopSignal()
    loops = [Counting(parent=parent) for _ in range(3)]
    for loop in loops:
        loop.start()
        loop.wait_ticks(1)
    threads = [t for loop in loops for t in loop_threads(loop.name)]
    parent.set()
    assert parent.wait(0) and parent.is_set()
    assert {loop.state for loop in loops} <= {LoopState.STOPPING, LoopState.STOPPED}
    for thread in threads:
        thread.join(TIMEOUT)
    # each ended in stopped by itself, as stop() ends it
    assert {loop.state for loop in loops} == {LoopState.STOPPED}
    for loop in reversed(loops):  # a stop after the parent's is a no-op
        loop.stop()
    assert {loop.state for loop in loops} == {LoopState.STOPPED}


def test_fanout_runs_handlers_concurrently_and_isolates_failures(
        caplog: pytest.LogCaptureFixture) -> None:
    count = 4
    barrier = threading.Barrier(count + 1, timeout=TIMEOUT)  # only passable if all run at once

    def meet(value: int) -> Callable[[], int]:
        def handler() -> int:
            barrier.wait()
            return value
        return handler

    def failing() -> None:
        barrier.wait()
        raise KeyError("nope")

    fan = FanOut("fan-test", logging.getLogger("kandevd.test"))
    with caplog.at_level(logging.ERROR, logger="kandevd.test"):
        results = fan.run([*((f"h{i}", meet(i)) for i in range(count)), ("bad", failing)])
    assert isinstance(results.pop("bad"), KeyError)
    assert results == {f"h{i}": i for i in range(count)}
    assert any("handler bad failed" in r.getMessage() for r in caplog.records)
    assert not [t for t in threading.enumerate() if t.name.startswith("fan-test:")]
    fan.join()  # nothing left to wait for


def test_fanout_join_waits_for_handlers_started_by_another_thread() -> None:
    fan = FanOut("fan-join", logging.getLogger("kandevd.test"))
    parked, gate = threading.Event(), threading.Event()

    def handler() -> None:
        parked.set()
        gate.wait(TIMEOUT)

    runner = threading.Thread(target=fan.run, args=([("slow", handler)],))
    runner.start()
    assert parked.wait(TIMEOUT)
    assert fan.owns(next(t for t in threading.enumerate() if t.name == "fan-join:slow"))
    joiner = threading.Thread(target=fan.join)
    joiner.start()
    joiner.join(0.05)
    assert joiner.is_alive(), "join() returned while a handler was still running"
    gate.set()
    joiner.join(TIMEOUT)
    runner.join(TIMEOUT)
    assert not joiner.is_alive() and not runner.is_alive()


def test_a_fan_outs_quiet_failures_are_one_line_and_the_others_keep_their_traceback(
        caplog: pytest.LogCaptureFixture) -> None:
    """An Office handler failing for a database outage said a traceback at every tick;
    a real bug (an SQL mistake is an OperationalError too) must keep it."""
    fanout = FanOut("office", logging.getLogger("kandevd.test.fanout"))
    fanout.quiet = lambda exc: "outage" in str(exc)

    def outage() -> None:
        raise sqlite3.OperationalError("outage: the server cannot be reached")

    def bug() -> None:
        raise sqlite3.OperationalError("no such column: nope")

    with caplog.at_level(logging.WARNING, logger="kandevd.test.fanout"):
        results = fanout.run([("quiet", outage), ("loud", bug)])
    assert all(isinstance(result, sqlite3.OperationalError) for result in results.values())
    said = {r.getMessage(): r.exc_info is not None for r in caplog.records}
    assert said == {"office: handler quiet failed: outage: the server cannot be reached": False,
                    "office: handler loud failed": True}
