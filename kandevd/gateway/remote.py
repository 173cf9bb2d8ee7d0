"""RemoteRuns: the queued runs that runners on other machines take, from claim to outcome.

A runner's poll claims the oldest due run of an agent whose ``runs_on`` its
labels cover (``claimed_by = 'runner:<name>'``: the queue's own claim, so one
claimed run per agent holds across the daemon and every runner). The runner
streams the agent's output into the run's log here and reports how it ended;
that outcome is recorded exactly as a local execution's
(:meth:`RunQueue.record_remote`). A runner silent for ``dead_after_s`` has its
claims rescued as a crashed daemon's are (re-queued, the attempt counted); a
late report of one of them matches no claim and changes nothing. A cancelled
run is stopped on its runner (the next heartbeat says so, to whichever daemon
it is sent); until the runner says it ended, its agent takes no other run
(``runner_stops``: every daemon on the store sees it, a restarted one too).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from kandevd.bus import EventBus
from kandevd.fsutil import append_note, ensure_dir
from kandevd.gateway.endings import UnknownExecution, append_from, ending_result
from kandevd.gateway.protocol import Ending, Execution, Held
from kandevd.gateway.turns import TurnBoard, is_turn
from kandevd.paths import HomeLayout
from kandevd.runqueue.outcomes import note_ended
from kandevd.runqueue.service import RunQueue
from kandevd.runs.labels import covers
from kandevd.runs.model import Claim
from kandevd.runtime import ERROR, INTERRUPTED, STOPPED
from kandevd.runtime.output import attempt_started
from kandevd.store.runners import RunnerRow, Runners, claimed_by
from kandevd.timeutil import utc_now

log = logging.getLogger("kandevd.gateway")

#: Outcomes a runner may report (the runtime's words).
OUTCOMES = frozenset({"succeeded", "failed", "timed_out", "stopped", "interrupted", "error"})
#: How often a runner's ``last_seen_at`` is written (it is kept in memory meanwhile).
SEEN_WRITE_S = 5.0


class NotRecorded(Exception):
    """An outcome the database refused now: the runner sends it again (503)."""


@dataclass
class Remote:
    """One execution a runner holds."""

    claim: Claim
    runner: str
    log_path: Path
    #: Bytes of the agent's output received so far (the runner's offsets).
    received: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: When it was handed over or taken back (monotonic): a runner that stops naming
    #: it in its heartbeats lost it (a poll answer that never arrived, say).
    handed_at: float = field(default_factory=time.monotonic)


#: A runner that has not named an execution this long after taking it lost it.
LOST_AFTER_S = 15.0
#: A runner that gave a run back as it stops is handed nothing for this long (or until
#: its next hello): its poll in flight would otherwise take that run again at once.
LEAVING_S = 60.0


class RemoteRuns:
    """Thread-safe: the gateway's request threads and its watch loop share it."""

    def __init__(self, queue: RunQueue, runners: Runners, turns: TurnBoard, bus: EventBus,
                 layout: HomeLayout, *, dead_after_s: float,
                 clock: Callable[[], datetime] = utc_now,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.queue = queue
        self.runners = runners
        self.layout = layout
        self.dead_after_s = dead_after_s
        self.clock = clock
        self.monotonic = monotonic
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._live: dict[str, Remote] = {}
        self._seen: dict[str, float] = {}  # runner -> monotonic time of its last request
        self._seen_written: dict[str, float] = {}
        self._started = monotonic()
        #: The scheduled turns of schedules with ``runs_on``, any daemon's (gateway/turns.py).
        self.turns = turns
        #: (often enough that another daemon's watch sees the runner alive)
        self._seen_every = min(SEEN_WRITE_S, dead_after_s / 4)
        self.stopping = False
        #: The daemon is stopping: nothing more is handed out, but runners are still
        #: heard (heartbeats, logs, outcomes) until the gateway stops.
        self.holding = False
        #: runner -> when (monotonic) it gave a run back because it stops.
        self._leaving: dict[str, float] = {}
        #: runner -> how many hellos this daemon heard: a poll held since an earlier one
        #: is a process's that is gone (killed, then started again at once).
        self._hellos: dict[str, int] = {}
        for topic in ("run.queued", "run.finished", "run.cancelled", "agent.updated",
                      "agent.created", "turn.waiting"):
            bus.subscribe(topic, self._changed)

    # -- what the runner asks -------------------------------------------------------
    def seen(self, runner: RunnerRow) -> None:
        """A request of ``runner`` arrived (it is alive)."""
        now = self.monotonic()
        with self._lock:
            self._seen[runner.name] = now
            write = now - self._seen_written.get(runner.name, -SEEN_WRITE_S) \
                >= self._seen_every
            if write:
                self._seen_written[runner.name] = now
        if write:
            self.runners.seen(runner.name, self.clock())

    def _heard_from(self, name: str) -> float:
        """Seconds since this daemon last heard from runner ``name``."""
        now = self.monotonic()
        with self._lock:
            return now - self._seen.get(name, now)

    def hello(self, runner: RunnerRow, held: list[Held]) -> list[str]:
        """A runner (re)started holding ``held``: those still claimed for it are its again,
        and its claims it no longer holds are rescued at once (it lost them: a crash);
        returns the ids it named that are not its any more (it should stop them)."""
        self.seen(runner)
        with self._work:
            self._leaving.pop(runner.name, None)  # (it serves again)
            self._hellos[runner.name] = self._hellos.get(runner.name, 0) + 1
            self._work.notify_all()  # (what the gone process left waiting answers empty)
        named = {(item["run_id"], item["id"]) for item in held}
        self._stops_ended(runner.name, [token for token in self.runners.stops_of(runner.name)
                                        if token not in {item["id"] for item in held}],
                          f"cancelled; runner {runner.name} restarted without it")
        lost = [claim for claim in self.runners.claims_of(runner.name) if claim not in named]
        if lost:
            with self._lock:
                for _run_id, token in lost:
                    self._live.pop(token, None)
            self.queue.rescue_remote(lost, f"runner {runner.name} restarted without it")
        self.turns.lose(runner.name, f"runner {runner.name} restarted without it",
                        keep=frozenset(item["id"] for item in held))
        turns = self.turns.held(runner.name)
        return [item["id"] for item in held if item["id"] not in turns
                and (is_turn(item["id"]) or self._adopt(runner, item) is None)]

    def bye(self, runner: RunnerRow) -> None:
        """``runner`` stopped gracefully: offline at once, unless it still holds work
        (then its silence ends that work, after ``dead_after_s``, as after a crash).
        The poll it may still have waiting here answers at once, empty, as do its next
        ones until its next hello: it stops."""
        with self._work:
            self._leaving[runner.name] = self.monotonic()
            self._work.notify_all()
        if self.runners.claims_of(runner.name) or self.turns.held(runner.name) \
                or self.runners.stops_of(runner.name):
            log.info("runner %s stopped holding work: offline once silent for %gs",
                     runner.name, self.dead_after_s)
            return
        self.runners.offline(runner.name, self.clock())
        with self._lock:
            self._seen.pop(runner.name, None)
            self._seen_written.pop(runner.name, None)
        log.info("runner %s stopped (offline)", runner.name)

    def heartbeat(self, runner: RunnerRow, held: list[Held]) -> tuple[list[str], list[str]]:
        """``(cancel, unknown)``: executions to stop (cancelled runs), and those that are
        not the runner's any more (rescued while it was silent: stop them too)."""
        self.seen(runner)
        stopping = self.runners.stops_of(runner.name)  # (cancelled by any daemon)
        self._lost(runner, frozenset(item["id"] for item in held), stopping)
        turns = self.turns.held(runner.name)
        cancel, unknown = [token for token, turn in turns.items() if turn.cancel], []
        for item in held:
            if item["id"] in turns:
                continue
            if item["id"] in stopping:
                cancel.append(item["id"])
                continue
            remote = None if is_turn(item["id"]) else \
                self._find(runner, item["id"], item["run_id"])
            if remote is None:
                unknown.append(item["id"])
        self.turns.heard(runner.name)  # (told of the turns a stopping daemon ended)
        return cancel, unknown

    def _lost(self, runner: RunnerRow, named: frozenset[str],
              stopping: dict[str, datetime]) -> None:
        """What ``runner`` was handed long enough ago and no longer names: it never got
        it, or dropped it. Its runs are rescued (counted), its turns end, and the
        cancelled runs it was stopping free their agents."""
        before = self.monotonic() - LOST_AFTER_S
        long_ago = self.clock() - timedelta(seconds=LOST_AFTER_S)
        self._stops_ended(runner.name, [token for token, since in stopping.items()
                                        if token not in named and since < long_ago],
                          f"cancelled; runner {runner.name} no longer runs it")
        why = f"runner {runner.name} no longer holds it"
        with self._lock:
            lost = [r for token, r in self._live.items() if r.runner == runner.name
                    and token not in named and r.handed_at < before]
            for remote in lost:
                self._live.pop(remote.claim.token, None)
        if lost:
            self.queue.rescue_remote([(r.claim.run.id, r.claim.token) for r in lost], why)
        self.turns.lose(runner.name, why, keep=named,
                        handed_before=self.clock() - timedelta(seconds=LOST_AFTER_S))

    def poll(self, runner: RunnerRow, wait_s: float, slots: int = 1) -> list[Execution]:
        """Claim up to ``slots`` runs for ``runner`` (one statement), waiting up to
        ``wait_s`` for the first; none: nothing to run."""
        self.seen(runner)
        deadline = self.monotonic() + wait_s
        with self._work:
            hello = self._hellos.get(runner.name, 0)
        while True:
            if self._is_leaving(runner.name) or self._hellos.get(runner.name, 0) != hello:
                return []  # (it stops, or it is gone: a new process said hello since)
            if self._heard_from(runner.name) > self.dead_after_s / 2:
                # Silent since it asked (no heartbeat) for as long as makes the runner
                # stop its own agents: nothing is handed into what may be a dead
                # connection, well before the watch rescues its runs (and the run it
                # would take again, each time an attempt counted).
                return []
            if not self.holding:
                handed = self.turns.take(runner.name, runner.labels, slots)
                claims = self._claim(runner, slots - len(handed)) \
                    if len(handed) < slots else []
                if handed or claims:
                    return handed + [self._hand_over(runner, claim) for claim in claims]
            with self._work:
                left = deadline - self.monotonic()
                if left <= 0 or self.stopping:
                    return []
                # (a change wakes it; the look again after at most a second also catches
                # a due retry or an ended cooldown). Waiting is no sign of life: the
                # runner may be gone since it asked (its heartbeats say it is alive).
                self._work.wait(min(left, 1.0))

    def append_log(self, runner: RunnerRow, execution_id: str, run_id: str, offset: int,
                   data: bytes) -> int:
        """Append the agent's output from ``offset`` (bytes already here are skipped);
        how much has been received. LogGap: a gap (the runner resends from there)."""
        self.seen(runner)
        if is_turn(execution_id):
            return self.turns.append(runner.name, execution_id, offset, data)
        remote = self._find(runner, execution_id, run_id)
        if remote is None:
            raise UnknownExecution(execution_id)
        return append_from(remote.log_path, remote, offset, data)

    def end(self, runner: RunnerRow, execution_id: str, run_id: str, ending: Ending) -> bool:
        """Record how the execution ended; False when its claim no longer holds (rescued,
        or recorded already): nothing changes then."""
        self.seen(runner)
        if is_turn(execution_id):
            return self.turns.end(runner.name, execution_id, ending)
        stopping = execution_id in self.runners.stops_of(runner.name)  # (cancelled: a read)
        remote = self._find(runner, execution_id, run_id)
        if remote is None:
            if stopping:  # (cancelled before this daemon started: its end line is due)
                self._stops_ended(runner.name, [execution_id],
                                  f"cancelled; it ended on runner {runner.name}")
            return False
        result = ending_result(remote.claim.run.id, remote.log_path, ending)  # never raises
        if result.outcome == STOPPED and not stopping:  # (not cancelled: its end
            # is not known to be wanted; a failed attempt, under the retry policy)
            result = replace(result, outcome=ERROR, error=f"stopped on runner "
                             f"{runner.name}: {result.error or 'no reason given'}")
        with self._lock:
            if self._live.pop(execution_id, None) is None:
                return False  # (another request recorded it meanwhile)
        # The end line first, as for a local run (once: a resent outcome adds none).
        note_ended(remote.claim, result, once=True)
        if stopping:  # (its agent may take its next run)
            self.runners.stops_ended(runner.name, [execution_id])
        if result.outcome == INTERRUPTED:  # the runner stopped gracefully: uncounted
            with self._work:  # (its poll in flight answers now, empty)
                self._leaving[runner.name] = self.monotonic()
                self._work.notify_all()
            self.queue.release_remote(remote.claim, "interrupted: runner "
                                      f"{runner.name} stopped during the execution")
        elif not self.queue.record_remote(remote.claim, result):
            # the database refused it: the runner keeps it and sends it again
            with self._lock:
                self._live.setdefault(execution_id, remote)
            raise NotRecorded(run_id)
        log.debug("run %s ended on runner %s: %s", run_id, runner.name, result.outcome)
        return True

    # -- the watch ------------------------------------------------------------------
    def watch(self) -> int:
        """Rescue the claims of runners silent for ``dead_after_s``; how many.

        Silent: neither this daemon nor any other on the store (``last_seen_at``,
        written by whichever daemon's gateway the runner talks to) heard from it."""
        now, wall = self.monotonic(), self.clock()
        rescued = 0
        seen = {row.name: row.last_seen_at for row in self.runners.all()}
        holding = self.runners.running()
        stopping = set(self.runners.stopping().values())
        for name in holding.keys() | stopping:
            with self._lock:
                silent = now - self._seen.get(name, self._started)
            stored = seen.get(name)
            if stored is not None and (wall - stored).total_seconds() < silent:
                # Another daemon heard it later than this one did; what it stored is
                # written every _seen_every at most, so it may be that much older.
                silent = (wall - stored).total_seconds() - self._seen_every
            if silent < self.dead_after_s:
                continue
            if name in stopping:  # (it stopped them itself, out of touch that long)
                self._stops_ended(name, None, f"cancelled; runner {name} was silent for "
                                  f"{silent:.0f}s")
            last = now - silent
            claims = self.runners.claims_of(name)
            with self._lock:
                for remote in [r for r in self._live.values() if r.runner == name]:
                    self._live.pop(remote.claim.token, None)
            gone = "" if name in seen else "removed, then "  # (its token refused since)
            why = f"runner {name} was {gone}silent for {now - last:.0f}s during the execution"
            done = self.queue.rescue_remote(claims, why) if claims else {}
            rescued += len(done)
            if name in holding:
                log.warning("runner %s silent for %.0fs: %d run(s) it held rescued", name,
                            now - last, len(done))
        return rescued

    def _stops_ended(self, name: str, tokens: list[str] | None, why: str) -> None:
        """Those cancelled runs (None: all of runner ``name``'s) no longer run there: their
        agents may take their next runs; an attempt with no end line gets one."""
        for run_id in self.runners.stops_ended(name, tokens):
            self.queue.restorer.end_attempt_in_log(run_id, why, outcome=STOPPED)

    def _is_leaving(self, name: str) -> bool:
        with self._work:
            since = self._leaving.get(name)
            if since is not None and self.monotonic() - since >= LEAVING_S:
                del self._leaving[name]
                since = None
            return since is not None

    def hold(self) -> None:
        """Hand out nothing more (the daemon is stopping); polls wait as when there is
        no work, so runners neither poll in a loop nor take the server for gone."""
        with self._work:
            self.holding = True

    def stop(self) -> None:
        """Pollers answer now (the gateway is stopping)."""
        with self._work:
            self.stopping = True
            self._work.notify_all()

    # -- inside -----------------------------------------------------------------------
    def _changed(self, _topic: str, _data: Any) -> None:
        """(A cancel is read from the store, runner_stops, by whichever daemon.)"""
        with self._work:
            self._work.notify_all()

    def _claim(self, runner: RunnerRow, slots: int) -> list[Claim]:
        # (A cancelled run's agent is busy until its runner stopped it: the claim
        # itself leaves it out, runner_stops.)
        agents = frozenset(agent for agent, needed in self.runners.remote_agents().items()
                           if covers(runner.labels, needed))
        if not agents:
            return []
        return self.queue.claim_for_runner(claimed_by(runner.name), agents, slots)

    def _hand_over(self, runner: RunnerRow, claim: Claim) -> Execution:
        run = claim.run
        remote = self._remote(runner, claim)
        append_note(remote.log_path, attempt_started(run.attempt, self.clock())
                    + f" on runner {runner.name}")
        with self._lock:
            self._live[claim.token] = remote
        log.debug("run %s claimed by runner %s (agent %s)", run.id, runner.name, run.agent_id)
        return {"id": claim.token, "run_id": run.id, "kind": "run", "profile": claim.profile,
                "attempt": run.attempt,
                "stdin": {"kind": "run", "run_id": run.id, "agent_id": run.agent_id,
                          "task_id": run.task_id, "workspace_id": run.workspace_id,
                          "reason": run.reason, "payload": run.payload}}

    def _remote(self, runner: RunnerRow, claim: Claim) -> Remote:
        log_path = self.layout.run_logs / f"{claim.run.id}.log"
        ensure_dir(log_path.parent)
        return Remote(claim, runner.name, log_path, handed_at=self.monotonic())

    def _find(self, runner: RunnerRow, execution_id: str, run_id: str) -> Remote | None:
        with self._lock:
            remote = self._live.get(execution_id)
        if remote is not None:
            return remote if remote.runner == runner.name and \
                remote.claim.run.id == run_id else None
        return self._adopt(runner, {"id": execution_id, "run_id": run_id})

    def _adopt(self, runner: RunnerRow, item: Held) -> Remote | None:
        """An execution this daemon did not hand out (it restarted since): the runner's
        again if its claim still holds and is the runner's."""
        if (item["run_id"], item["id"]) not in self.runners.claims_of(runner.name):
            return None
        claim = self.queue.claim_in_force(item["run_id"], item["id"])
        if claim is None:
            return None
        remote = self._remote(runner, claim)
        remote.received = -1  # unknown here: the next chunk's offset is taken as it comes
        with self._lock:
            return self._live.setdefault(claim.token, remote)
