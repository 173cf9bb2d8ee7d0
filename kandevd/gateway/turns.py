"""Scheduled turns on runners: the turns of a schedule with ``runs_on``, handed to a
runner carrying its labels, their output into the turn's log, their end to the session.

A session thread hands its turn over (:class:`RemoteTurns`, a TurnRuntime) and waits
for its end as for a local one; the turn waits here until a runner's poll takes it.
The session's stop reaches it (a turn not taken yet ends ``stopped`` at once; a
taken one is stopped on its runner at the runner's next heartbeat), and so does
its ``timeout_s``. A runner that goes silent, or comes back without it, ends the
turn ``error`` naming the runner; a daemon that stops ends every turn here
``interrupted`` (its session is recorded as a shutdown's).
"""

from __future__ import annotations

import math
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from kandevd.fsutil import ensure_dir
from kandevd.gateway.protocol import Ending, Execution
from kandevd.runs.labels import covers
from kandevd.runtime import (
    DETACHED,
    ERROR,
    INTERRUPTED,
    OUTCOMES,
    STOPPED,
    ExecutionResult,
    ExecutionSpec,
)
from kandevd.timeutil import parse_rfc3339, utc_now


@dataclass
class Turn:
    spec: ExecutionSpec
    profile: str
    labels: tuple[str, ...]
    on_done: Callable[[ExecutionResult], None]
    token: str = field(default_factory=lambda: f"turn.{uuid.uuid4().hex}")
    runner: str | None = None
    #: When a runner took it (monotonic): a runner that stops naming it is told.
    handed_at: float = 0.0
    received: int = 0
    cancel: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class TurnBoard:
    """The turns waiting for a runner and those runners hold; thread-safe."""

    def __init__(self, wake: Callable[[], None],
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self._wake = wake
        self._monotonic = monotonic
        self._lock = threading.Lock()
        self._waiting: list[Turn] = []
        self._held: dict[str, Turn] = {}
        self._closed = False

    def add(self, turn: Turn) -> bool:
        with self._lock:
            if self._closed:
                return False
            self._waiting.append(turn)
        self._wake()
        return True

    def take(self, runner: str, labels: tuple[str, ...], slots: int) -> list[Execution]:
        """The oldest waiting turns ``runner``'s labels cover, up to ``slots``."""
        with self._lock:
            taken = [t for t in self._waiting if covers(labels, t.labels)][:slots]
            for turn in taken:
                self._waiting.remove(turn)
                turn.runner, turn.handed_at = runner, self._monotonic()
                self._held[turn.token] = turn
        return [{"id": t.token, "run_id": t.spec.run_id, "kind": "turn", "profile": t.profile,
                 "attempt": 0, "stdin": dict(t.spec.stdin)} for t in taken]

    def find(self, runner: str, token: str) -> Turn | None:
        with self._lock:
            turn = self._held.get(token)
        return turn if turn is not None and turn.runner == runner else None

    def end(self, runner: str, token: str, ending: Ending) -> bool:
        with self._lock:
            turn = self._held.get(token)
            if turn is None or turn.runner != runner:
                return False
        result = ending_result(turn.spec.key, turn.spec.log_path, ending)  # (never raises)
        with self._lock:
            if self._held.pop(token, None) is None:
                return False  # (ended meanwhile by another request or the watch)
        turn.on_done(result)
        return True

    def stop(self, key: str) -> bool:
        """Stop the turn of ``key``: one still waiting ends now; a held one is stopped at
        its runner's next heartbeat."""
        with self._lock:
            waiting = next((t for t in self._waiting if t.spec.key == key), None)
            if waiting is not None:
                self._waiting.remove(waiting)
            held = next((t for t in self._held.values() if t.spec.key == key), None)
            if held is not None:
                held.cancel = True
        if waiting is not None:
            _end(waiting, STOPPED, "stopped before a runner took it")
        return waiting is not None or held is not None

    def cancelled(self, runner: str) -> list[str]:
        with self._lock:
            return [t.token for t in self._held.values() if t.runner == runner and t.cancel]

    def lose(self, runner: str, why: str, keep: frozenset[str] = frozenset(),
             handed_before: float | None = None) -> int:
        """End ``runner``'s turns (but ``keep``; ``handed_before``: only those it took
        before that monotonic time) with ``why`` (it went silent, came back without them,
        or no longer names them); how many."""
        with self._lock:
            lost = [t for t in self._held.values() if t.runner == runner
                    and t.token not in keep
                    and (handed_before is None or t.handed_at < handed_before)]
            for turn in lost:
                del self._held[turn.token]
        for turn in lost:
            _end(turn, ERROR, why)
        return len(lost)

    def holders(self) -> set[str]:
        """The runners that hold a turn."""
        with self._lock:
            return {t.runner for t in self._held.values() if t.runner is not None}

    def held_by(self, runner: str) -> int:
        with self._lock:
            return sum(t.runner == runner for t in self._held.values())

    def close(self, why: str) -> None:
        """The daemon stops: every turn here ends ``interrupted``."""
        with self._lock:
            self._closed = True
            every = [*self._waiting, *self._held.values()]
            self._waiting, self._held = [], {}
        for turn in every:
            _end(turn, INTERRUPTED, why)


class RemoteTurns:
    """The TurnRuntime of a schedule with ``runs_on``: its turns go to the board."""

    remote = True

    def __init__(self, board: TurnBoard, labels: tuple[str, ...], profile: str) -> None:
        self.board = board
        self.labels = labels
        self.profile = profile

    def launch_when_free(self, spec: ExecutionSpec, on_done: Callable[[ExecutionResult], None],
                         cancelled: Callable[[], bool]) -> bool:
        if cancelled():
            return False
        turn = Turn(spec, self.profile, self.labels, on_done)
        try:
            ensure_dir(spec.log_path.parent)  # (its output arrives in chunks from the runner)
        except OSError as exc:
            _end(turn, ERROR, f"cannot create the turn's log folder: {exc}")
            return True
        return self.board.add(turn)

    def stop_execution(self, key: str, reason: str) -> bool:
        return self.board.stop(key)

    def detach_execution(self, key: str) -> bool:
        return self.board.stop(key)  # (nothing here to leave running for the next start)

    def settle_ids(self, ids: list[str]) -> None:
        return None


def _end(turn: Turn, outcome: str, error: str) -> None:
    now = utc_now()
    turn.on_done(ExecutionResult(key=turn.spec.key, outcome=outcome, exit_code=None,
                                 summary=None, cost_cents=None, error=error, started_at=now,
                                 ended_at=now, log_path=turn.spec.log_path))


def ending_result(key: str, log_path: Path, ending: Ending) -> ExecutionResult:
    """An execution's end as its runner reported it, every field checked (an unknown
    outcome is an error, a bad number or time is left out)."""
    now = utc_now()
    outcome = ending.get("outcome")
    outcome = outcome if isinstance(outcome, str) and outcome in OUTCOMES \
        and outcome != DETACHED else ERROR
    code, evaluation = ending.get("exit_code"), ending.get("evaluation")
    started = _time(ending.get("started_at"), now)
    return ExecutionResult(
        key=key, outcome=outcome,
        exit_code=code if isinstance(code, int) and not isinstance(code, bool)
        and -(2 ** 31) <= code < 2 ** 31 else None,
        summary=_text(ending.get("summary")), cost_cents=_cost(ending.get("cost_cents")),
        error=_text(ending.get("error")), started_at=started,
        ended_at=max(started, _time(ending.get("ended_at"), now)),
        log_path=log_path, evaluation=evaluation if isinstance(evaluation, dict) else None)


def _cost(value: Any) -> float | None:
    if not isinstance(value, int | float) or isinstance(value, bool):
        return None
    try:
        cost = float(value)
    except OverflowError:
        return None
    return cost if math.isfinite(cost) and cost >= 0 else None


def append_from(path: Path, holder: Turn | Any, offset: int, data: bytes) -> int:
    """Append ``data`` (the runner's bytes from ``offset``) to ``path``, skipping what
    ``holder.received`` says arrived already (-1: unknown, take the offset); how much
    has arrived. LogGap when ``offset`` is past it."""
    with holder.lock:
        if holder.received < 0:
            holder.received = offset
        if offset > holder.received:
            raise LogGap(holder.received)
        fresh = data[holder.received - offset:]
        if fresh:
            with path.open("ab") as handle:
                handle.write(fresh)
            holder.received += len(fresh)
        return int(holder.received)


class LogGap(ValueError):
    """A log chunk that starts past what was received: resend from ``received``."""

    def __init__(self, received: int) -> None:
        super().__init__(f"the chunk starts past the {received} bytes received")
        self.received = received


def _text(value: Any) -> str | None:
    return value[:4000] if isinstance(value, str) else None


def _time(value: Any, default: datetime) -> datetime:
    try:
        return parse_rfc3339(value) if isinstance(value, str) else default
    except (ValueError, OverflowError):
        return default
