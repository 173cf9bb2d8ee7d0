"""Scheduled turns on runners: the turns of a schedule with ``runs_on``, handed to a
runner carrying its labels, their output into the turn's log, their end to the session.

A session thread hands its turn over (:class:`RemoteTurns`, a TurnRuntime) and
waits for its end as for a local one. The turn is written to the database
(:mod:`kandevd.store.turns`), so that any daemon's gateway on it can hand it to a
runner and take its output and end; this daemon, its owner, reads those into the
turn's log and gives the end to the session (at once when its own gateway took
them, else at the next look of :class:`TurnWatch`, every second).

The session's stop reaches the turn (one not taken yet ends ``stopped`` at once; a
taken one is stopped on its runner at the runner's next heartbeat), and so does its
``timeout_s``. A runner that goes silent for ``gateway.dead_after_s``, or comes back
without it, ends the turn ``error`` naming the runner; a daemon that stops ends
every turn it owns ``interrupted`` (its session is recorded as a shutdown's).
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

from kandevd.bus import EventBus
from kandevd.fsutil import ensure_dir
from kandevd.gateway.endings import LogGap, UnknownExecution, ending_result
from kandevd.gateway.protocol import Ending, Execution
from kandevd.lifecycle import Loop, StopSignal
from kandevd.runs.labels import covers
from kandevd.runtime import ERROR, INTERRUPTED, STOPPED, ExecutionResult, ExecutionSpec
from kandevd.store.runners import Runners
from kandevd.store.turns import HeldTurn, RemoteTurnRows, WaitingTurn
from kandevd.timeutil import rfc3339, utc_now

log = logging.getLogger("kandevd.gateway")

#: A turn's execution id begins so (a run's is its claim token).
TURN_PREFIX = "turn."
#: How often the owner looks at its turns (ends and output other daemons received).
WATCH_S = 1.0


def is_turn(execution_id: str) -> bool:
    return execution_id.startswith(TURN_PREFIX)


@dataclass
class Turn:
    spec: ExecutionSpec
    profile: str
    labels: tuple[str, ...]
    on_done: Callable[[ExecutionResult], None]
    token: str = field(default_factory=lambda: f"{TURN_PREFIX}{uuid.uuid4().hex}")


class TurnBoard:
    """This daemon's turns on runners, and what every gateway does with any daemon's;
    thread-safe."""

    def __init__(self, rows: RemoteTurnRows, runners: Runners, bus: EventBus, *,
                 dead_after_s: float, clock: Callable[[], datetime] = utc_now) -> None:
        self.rows = rows
        self.runners = runners
        self.bus = bus
        self.dead_after_s = dead_after_s
        self.clock = clock
        self._lock = threading.Lock()
        self._read = threading.Lock()  # one reader of the output at a time
        self._mine: dict[str, Turn] = {}
        self._closed = False
        #: Runners that held a turn the close ended, not heard from since (told nothing).
        self._to_tell: set[str] = set()
        self._told = threading.Condition(self._lock)

    # -- the owner's side -------------------------------------------------------------
    def add(self, turn: Turn) -> bool:
        """Hand ``turn`` over; False: the daemon is stopping. Its row is written first
        and the turn is this daemon's only then, so a look at its turns meanwhile never
        takes it for gone (a runner may take it at once: its end waits in the row)."""
        with self._lock:
            if self._closed:
                return False
        try:
            self.rows.add(WaitingTurn(turn.token, turn.spec.run_id, turn.profile, turn.labels,
                                      dict(turn.spec.stdin)), self.clock())
        except Exception as exc:  # (the database refused it: the turn fails, visibly)
            _end(turn, ERROR, f"the turn could not be handed to a runner: {exc}")
            return True
        with self._lock:
            closed = self._closed
            if not closed:
                self._mine[turn.token] = turn
        if closed:  # (the daemon stopped meanwhile: nobody would read its end)
            self._forget(turn.token)
            return False
        self.bus.publish("turn.waiting")
        return True

    def stop(self, key: str) -> bool:
        """Stop the turn of ``key``: one still waiting ends now; a taken one is stopped
        at its runner's next heartbeat."""
        with self._lock:
            turn = next((t for t in self._mine.values() if t.spec.key == key), None)
        if turn is None:
            return False
        try:
            if not self.rows.withdraw(turn.token):
                self.rows.cancel(turn.token)  # (its runner hears it at its heartbeat)
                return True
        except Exception as exc:  # (the database refused: its runner runs it on)
            log.warning("turn %s: cannot stop it now: %s", turn.token, exc)
            return True
        with self._lock:
            withdrawn = self._mine.pop(turn.token, None)
        if withdrawn is not None:  # (else ended meanwhile)
            _end(turn, STOPPED, "stopped before a runner took it")
        return True

    def watch(self) -> None:
        """Read what other daemons received for this daemon's turns, and end the turns
        of runners silent for ``dead_after_s`` (seen by no daemon)."""
        with self._lock:
            tokens = list(self._mine)
        if not tokens:
            return
        wall = self.clock()
        seen = {row.name: row.last_seen_at for row in self.runners.all()}
        for token, state in self.rows.own(tokens).items():
            if state.runner is None or state.ending is not None:
                continue
            last = seen.get(state.runner)
            silent = (wall - last).total_seconds() if last is not None else None
            if silent is None or silent >= self.dead_after_s:
                why = f"runner {state.runner} was silent for " + \
                    (f"{silent:.0f}s" if silent is not None else "too long") + \
                    " during the turn"
                if self.rows.end(token, state.runner, {"outcome": ERROR, "error": why}):
                    log.warning("turn %s: %s", token, why)
        self.settle()

    def settle(self) -> None:
        """Append the output received for this daemon's turns to their logs, and give
        those that ended to their sessions (each turn on its own: one whose log cannot
        be written does not hold the others)."""
        with self._read:
            with self._lock:
                mine = dict(self._mine)
            states = self.rows.own(list(mine))
            for token, turn in mine.items():
                state = states.get(token)
                try:
                    self._read_output(turn)
                except OSError as exc:  # (its log cannot take it now: read again later)
                    log.warning("turn %s: cannot append its output now: %s", token, exc)
                    if state is not None and state.ending is None:
                        continue
                if state is not None and state.ending is None:
                    continue
                with self._lock:
                    if self._mine.pop(token, None) is None:
                        continue  # (stopped or closed meanwhile)
                if state is None:
                    _end(turn, ERROR, "the turn's record is gone from the database")
                    continue
                try:
                    turn.on_done(ending_result(turn.spec.key, turn.spec.log_path,
                                               state.ending))
                finally:
                    self._forget(token)

    def close(self, why: str) -> None:
        """The daemon stops: every turn it owns ends ``interrupted`` (a runner running
        one is told at its next heartbeat that it is no longer its)."""
        with self._lock:
            self._closed = True
            every, self._mine = list(self._mine.values()), {}
        with self._read:
            try:
                holding = {state.runner for state in self.rows.own(
                    [turn.token for turn in every]).values() if state.runner}
            except Exception:  # (the database went away: none can be told through it)
                holding = set()
            with self._lock:
                self._to_tell = holding
            for turn in every:
                try:
                    self._read_output(turn)
                except OSError as exc:
                    log.warning("turn %s: cannot append its output now: %s", turn.token, exc)
                except Exception as exc:  # (the database went away)
                    log.warning("turn %s: cannot read its output now: %s", turn.token, exc)
                self._forget(turn.token)
                _end(turn, INTERRUPTED, why)

    def heard(self, runner: str) -> None:
        """``runner``'s heartbeat was answered: it knows of the turns the close ended."""
        with self._told:
            if runner in self._to_tell:
                self._to_tell.discard(runner)
                self._told.notify_all()

    def wait_told(self, timeout_s: float) -> bool:
        """Until every runner that held a turn the close ended has had a heartbeat
        answered here (it stops that turn's agent now, not once its server is gone for
        half of dead_after_s), or ``timeout_s``; whether all were."""
        with self._told:
            return self._told.wait_for(lambda: not self._to_tell, timeout_s)

    def _forget(self, token: str) -> None:
        """Delete ``token``'s row, or leave it to the pruning (the database refused)."""
        try:
            self.rows.drop(token)
        except Exception as exc:
            log.warning("turn %s: cannot forget it now (pruned later): %s", token, exc)

    # -- what a gateway does, for any daemon's turns ----------------------------------
    def take(self, runner: str, labels: tuple[str, ...], slots: int) -> list[Execution]:
        """The oldest waiting turns ``runner``'s labels cover, up to ``slots``."""
        handed: list[Execution] = []
        for turn in self.rows.waiting():
            if len(handed) >= slots:
                break
            if covers(labels, turn.labels) and self.rows.hand(turn.token, runner,
                                                              self.clock()):
                handed.append({"id": turn.token, "run_id": turn.run_id, "kind": "turn",
                               "profile": turn.profile, "attempt": 0, "stdin": turn.stdin})
        return handed

    def held(self, runner: str) -> dict[str, HeldTurn]:
        """The turns ``runner`` holds (``cancel``: to be stopped), by execution id."""
        return self.rows.held(runner)

    def append(self, runner: str, token: str, offset: int, data: bytes) -> int:
        """Keep ``runner``'s output of turn ``token`` from ``offset``; how much has
        arrived (LogGap: resend from there; UnknownExecution: not its turn)."""
        kept = self.rows.append(token, runner, offset, data)
        if kept is None:
            raise UnknownExecution(token)
        if kept.gap:
            raise LogGap(kept.received)
        with self._lock:
            turn = self._mine.get(token)
        if turn is not None:  # this daemon's own: into the log at once
            with self._read:
                self._read_output(turn)
        return kept.received

    def end(self, runner: str, token: str, ending: Ending) -> bool:
        """Note how ``runner``'s turn ended; False: not its (or ended already). A turn
        its runner interrupted (it stopped gracefully, or its keeper found it gone)
        waits for a runner again, as a run is re-queued then."""
        why = str(ending.get("error") or "it stopped")
        note = (f"\n==== turn interrupted on runner {runner} ({why}) at "
                f"{rfc3339(self.clock())}; waiting for a runner again ====\n")
        if ending.get("outcome") == INTERRUPTED and \
                self.rows.release(token, runner, note.encode()):
            log.info("turn %s: interrupted on runner %s; waiting for a runner again",
                     token, runner)
            self.bus.publish("turn.waiting")
            return True
        if not self.rows.end(token, runner, dict(ending)):
            return False
        with self._lock:
            mine = token in self._mine
        if mine:
            self.settle()
        return True

    def lose(self, runner: str, why: str, keep: frozenset[str] = frozenset(),
             handed_before: datetime | None = None) -> int:
        """End ``runner``'s turns (but ``keep``; ``handed_before``: only those it took
        before then) with ``why`` (it came back without them, or no longer names them);
        how many."""
        lost = 0
        for token, held in self.rows.held(runner).items():
            if token in keep or (handed_before is not None and held.handed_at >= handed_before):
                continue
            lost += self.rows.end(token, runner, {"outcome": ERROR, "error": why})
        if lost:
            self.settle()
        return lost

    def _read_output(self, turn: Turn) -> None:
        """Append the output chunks received for ``turn`` to its log (under ``_read``)."""
        chunks = self.rows.output(turn.token)
        if not chunks:
            return
        with turn.spec.log_path.open("ab") as handle:
            for _start, data in chunks:
                handle.write(data)
        self.rows.output_read(turn.token, chunks[-1][0])


class TurnWatch(Loop):
    """Every second: this daemon's turns that other daemons' gateways advanced, and
    those of silent runners."""

    def __init__(self, board: TurnBoard, *, parent: StopSignal | None = None) -> None:
        super().__init__("turns", parent=parent, logger=log)
        self.board = board

    def tick(self, now: datetime) -> float:
        self.board.watch()
        return WATCH_S


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
