"""RunnerProcess: ``kandevd runner``, the foreground process of a runner.

Three threads around one AgentRuntime (the same keeper and execution record as
the daemon's, in the runner's own home): the poll thread takes an execution
whenever a slot is free and starts the runner's own profile of that name; the
report thread streams each execution's log to the server and, once it ended,
its outcome (kept until the server has it: an outage only delays it); the
heartbeat says what runs here and stops what the server cancelled or no longer
counts as this runner's. Out of touch with the server for more than half of its
``dead_after_s``, the runner stops its agents itself: the server ends them as a
silent runner's after ``dead_after_s``, and no run may execute twice at once. A
fourth thread watches for that, on its own: a request in flight (a heartbeat may
wait 10 s for its answer) must not hold the watch back.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TypeVar

from kandevd import exits
from kandevd.config import Config
from kandevd.gateway.protocol import (
    HEARTBEAT_S,
    MAX_LOG_CHUNK,
    MAX_POLL_SLOTS,
    Execution,
)
from kandevd.paths import HomeLayout
from kandevd.remote.client import (
    GatewayClient,
    NameTaken,
    Rejected,
    TokenRefused,
    Unreachable,
)
from kandevd.remote.held import HeldFiles, Kept
from kandevd.remote.jobs import SAFE_ID, Job, ending_of
from kandevd.runtime import AgentRuntime, ExecutionResult, Reservation
from kandevd.runtime.attempts import attempt_dir
from kandevd.runtime.execution import input_path_of
from kandevd.runtime.specs import agent_execution
from kandevd.timeutil import utc_now

log = logging.getLogger("kandevd.runner")

#: How long a poll asks the server to wait for work (a stop waits for it at most).
POLL_WAIT_S = 10.0
#: How often the report thread looks at the logs.
REPORT_S = 0.25
#: The longest wait between two tries of an unreachable server.
MAX_BACKOFF_S = 30.0
#: How long a stop waits for the last outcomes to reach the server.
FINAL_REPORT_S = 10.0

T = TypeVar("T")


class RunnerProcess:
    def __init__(self, client: GatewayClient, config: Config, layout: HomeLayout,
                 runtime_for: Callable[[float, Callable[[], None]], AgentRuntime], *,
                 stop: threading.Event,
                 sweep: Callable[[frozenset[int]], object] = lambda keep: None,
                 fence_keeper: Callable[[float], object] = lambda until: None) -> None:
        """``runtime_for(dead_after_s, on_slot_free)``: the runtime (its keeper attached),
        calling ``on_slot_free`` whenever a slot frees; ``sweep(keep)``: stop the agents a
        crash of this runner left, but those of ``keep`` (adopted); ``fence_keeper(t)``:
        the keeper stops every agent at ``t`` (monotonic) unless told a later one (a
        frozen runner)."""
        self.client = client
        self.config = config
        self.layout = layout
        self.runtime_for = runtime_for
        #: The runtime, once its keeper is attached (:meth:`_attach`).
        self.runtime: AgentRuntime
        self._attached = False
        self.sweep = sweep
        self.fence_keeper = fence_keeper
        self.files = HeldFiles(layout)
        self.stop = stop
        self.refused = threading.Event()
        #: The refusal was of this process, not of the token: another home serves it.
        self.name_taken = False
        self.dead_after_s = 30.0
        self.heartbeat_s = HEARTBEAT_S
        self._jobs: dict[str, Job] = {}
        self._lock = threading.Lock()
        self._report = threading.Event()
        self._last_ok = time.monotonic()
        self._down_since: float | None = None
        #: Set once the last reports are sent (or given up): the other threads end.
        self._closed = threading.Event()
        #: Set by the runtime whenever a slot frees (the poll thread waits for one).
        self._slot_freed = threading.Event()

    # -- the process ----------------------------------------------------------------
    def run(self) -> int:
        """Serve until stopped; the exit code (77: the token was refused)."""
        kept = self._take_back()
        self.sweep(frozenset(item.pid for item in kept if item.pid is not None))
        with self._lock:
            held = [job.held for job in self._jobs.values()]
        answer = self._until_through(partial(self.client.hello, held))
        if answer is None:
            if self._attached:  # (taken back: left to the keeper, as at a crash)
                self.runtime.stop(keep_agents=True)
            return self._refused_code() if self.refused.is_set() else 0
        self.dead_after_s = float(answer.get("dead_after_s") or 30.0)
        self.heartbeat_s = min(HEARTBEAT_S, float(answer.get("heartbeat_s") or HEARTBEAT_S),
                               self.dead_after_s / 4)
        self.files.remember(self.dead_after_s)
        if not self._attached:
            self._attach(self.dead_after_s)
        self.runtime.release_unclaimed()  # (exits of executions not taken back)
        for gone in answer.get("gone") or []:  # not this runner's any more: stopped
            self._stop_one(gone, "no longer this runner's (the server ended it)")
        log.info("runner %s serving %s (labels %s; %d slot(s))", answer.get("runner"),
                 self.client.base, ",".join(answer.get("labels") or []) or "-",
                 self.runtime.max_concurrent)
        threads = [threading.Thread(target=self._polls, name="kandevd-runner-poll"),
                   threading.Thread(target=self._reports, name="kandevd-runner-report"),
                   threading.Thread(target=self._heartbeats, name="kandevd-runner-beat"),
                   threading.Thread(target=self._watch, name="kandevd-runner-fence")]
        for thread in threads:
            thread.start()
        self.stop.wait()
        log.info("runner stopping: its agents are being stopped, their outcomes reported")
        # At once, not after the poll in flight (up to its wait): each agent ends
        # interrupted and the server re-queues its run; what a last poll hands over is
        # given back unstarted (the stop is set).
        self.runtime.stop()
        # (the server answers the poll it holds at once; None: not said yet)
        said = self._goodbye() if not self._pending() and not self.refused.is_set() \
            else None
        threads[0].join()
        self._report.set()
        deadline = time.monotonic() + FINAL_REPORT_S
        while self._pending() and time.monotonic() < deadline and not self.refused.is_set():
            time.sleep(REPORT_S)
        self._closed.set()
        for thread in threads[1:]:
            thread.join()
        self.runtime.stop()
        if not self.refused.is_set() and not self._pending() and said is not False:
            self._goodbye()  # (again: a last poll may have handed something back since)
        return self._refused_code() if self.refused.is_set() else 0

    def _goodbye(self) -> bool:
        """Every outcome is the server's: it may show this runner offline now, and it
        answers the poll it holds for it at once (said again after a last poll that
        handed something over). Whether the server took it."""
        try:
            self.client.bye()
        except (Unreachable, TokenRefused, Rejected):
            return False  # (silent, it is offline after dead_after_s, as after a crash)
        return True

    def _refused_code(self) -> int:
        """75 when another runner home serves this runner's name (try again once it is
        gone), 77 when the token itself was refused."""
        return exits.TEMPFAIL if self.name_taken else exits.NOPERM

    def _take_back(self) -> list[Kept]:
        """What a previous run of this runner left: its agents adopted, their ends read."""
        if not self.files.saved():
            return []
        self._attach(self.files.dead_after_s() or 30.0)
        kept = self.files.take_back(self.runtime, self._log_path, self._ended)
        with self._lock:
            for item in kept:
                self._jobs[item.execution["id"]] = Job(item.execution, item.log_path,
                                                       result=item.result)
        return kept

    def _attach(self, dead_after_s: float) -> None:
        self.runtime = self.runtime_for(dead_after_s, self._slot_freed.set)
        self._attached = True

    def _log_path(self, key: str) -> Path:
        return self.layout.run_logs / f"{key}.log"

    def _ended(self, key: str, result: ExecutionResult) -> None:
        with self._lock:
            job = self._jobs.get(key)
        if job is not None:
            job.result = result
            self._report.set()

    # -- polls ----------------------------------------------------------------------
    def _polls(self) -> None:
        while not self.stop.is_set():
            self._slot_freed.clear()
            reservations = self._free_slots()
            if not reservations:
                self._slot_freed.wait(REPORT_S)  # (REPORT_S: a stop is noticed soon)
                continue
            try:
                handed = self._call(partial(self.client.poll, POLL_WAIT_S, len(reservations)))
            except (Unreachable, Rejected):
                handed = []
                self.stop.wait(self._backoff())
            except TokenRefused:  # (the stop is set)
                handed = []
            except Exception:  # (a bug: said, and the next poll after a pause)
                log.exception("a poll failed")
                handed = []
                self.stop.wait(1.0)
            for reservation, execution in zip(reservations, handed, strict=False):
                self._start(reservation, execution)
            for reservation in reservations[len(handed):]:
                self.runtime.release(reservation)
            if self.refused.is_set():
                return

    def _free_slots(self) -> list[Reservation]:
        """Every slot free now, reserved (a poll takes as many executions)."""
        taken: list[Reservation] = []
        while len(taken) < MAX_POLL_SLOTS and (reservation := self.runtime.try_reserve()):
            taken.append(reservation)
        return taken

    def _start(self, reservation: Reservation, execution: Execution) -> None:
        run_id, key = execution["run_id"], execution["id"]
        if not (SAFE_ID.fullmatch(str(key)) and SAFE_ID.fullmatch(str(run_id))):
            self.runtime.release(reservation)  # (they become file names here)
            log.error("an execution with unusable ids was refused: %r / %r", key, run_id)
            return
        job = Job(execution, self._log_path(key))
        with self._lock:
            self._jobs[execution["id"]] = job
        profile = self.config.agents.get(execution["profile"])
        now = utc_now()
        if self.stop.is_set() or profile is None or execution["kind"] not in ("run", "turn"):
            self.runtime.release(reservation)
            why = "interrupted" if self.stop.is_set() else "error"
            error = "the runner was stopping" if self.stop.is_set() else \
                f"this runner has no agent profile {execution['profile']!r}" \
                if profile is None else f"unknown execution kind {execution['kind']!r}"
            job.result = ExecutionResult(key=key, outcome=why, exit_code=None,
                                         summary=None, cost_cents=None, error=error,
                                         started_at=now, ended_at=now, log_path=job.log_path)
            log.warning("run %s: %s", run_id, error)
            self._report.set()
            return
        stdin = execution["stdin"]
        session_id = str(stdin.get("session_id") or f"ses_{uuid.uuid4().hex}")
        spec = agent_execution(
            profile, self.layout, kind=execution["kind"], key=key, run_id=run_id,
            session_id=session_id, stdin={**stdin, "session_id": session_id},
            log_path=job.log_path, record_dir=attempt_dir(self.layout.attempts, run_id, key))

        def done(result: ExecutionResult) -> None:
            job.result = result
            self._report.set()

        try:
            self.files.keep(execution)  # (a restarted runner takes it back from there)
            self.runtime.start(reservation, spec, done)
        except Exception as exc:
            self.runtime.release(reservation)
            done(ExecutionResult(key=key, outcome="error", exit_code=None, summary=None,
                                 cost_cents=None, error=f"could not start the agent: {exc}",
                                 started_at=now, ended_at=now, log_path=job.log_path))
        log.info("%s %s started (profile %s)", execution["kind"], run_id, execution["profile"])

    # -- reports --------------------------------------------------------------------
    def _reports(self) -> None:
        while not self._closed.is_set() and not self.refused.is_set():
            self._report.wait(REPORT_S)
            self._report.clear()
            with self._lock:
                jobs = list(self._jobs.values())
            for job in jobs:
                try:
                    self._report_one(job)
                except (Unreachable, TokenRefused):  # (said by _call)
                    self._closed.wait(self._backoff())  # then tried again
                    break
                except Exception:  # one bad report must not end the reports
                    log.exception("reporting %s failed; tried again", job.execution["id"])
                    self._closed.wait(1.0)
                    break

    def _report_one(self, job: Job) -> None:
        ended = job.result  # read before the log: all of its output is in it then
        while not job.refused:
            try:
                with job.log_path.open("rb") as handle:
                    handle.seek(job.sent)
                    chunk = handle.read(MAX_LOG_CHUNK)
            except FileNotFoundError:
                chunk = b""
            if not chunk:
                break
            ex = job.execution
            try:
                job.sent = self._call(partial(self.client.send_log, ex["id"], ex["run_id"],
                                              job.sent, chunk))
            except Rejected:  # not this runner's any more: its agent is stopped, and
                job.refused = True  # its end still sent (the server ignores it)
                self._stop_one(ex["id"], "the server refused its output (no longer "
                               "this runner's)")
        if ended is None:
            return None
        try:
            recorded = self._call(lambda: self.client.end(
                job.execution["id"], job.execution["run_id"], ending_of(ended)))
        except Rejected:
            recorded = False
        if not recorded:
            log.info("run %s: the server no longer expected its outcome (%s)",
                     job.execution["run_id"], ended.outcome)
        self._forget(job)
        return None

    def _forget(self, job: Job) -> None:
        with self._lock:
            self._jobs.pop(job.execution["id"], None)
        self.files.forget(job.execution["id"])
        if job.result is not None:
            self.runtime.settle([job.result])  # (the keeper may forget its exit)
            # Its log is the server's now (sent before the end), its input came from it: the
            # copies here go, or a busy runner's home grows without end. (Its working
            # folder stays: what the agent left there is the machine's owner's.)
            for path in (job.log_path, input_path_of(job.log_path)):
                try:
                    path.unlink(missing_ok=True)
                except OSError as exc:
                    log.warning("cannot remove %s (%s)", path, exc)

    def _pending(self) -> bool:
        with self._lock:
            return bool(self._jobs)

    # -- heartbeats -----------------------------------------------------------------
    def _heartbeats(self) -> None:
        # (on after a stop, while the last outcomes are reported: the runner is alive)
        next_beat = time.monotonic() + self.heartbeat_s
        while not self._closed.wait(min(1.0, self.heartbeat_s)):
            if self.refused.is_set():
                return
            if time.monotonic() < next_beat:
                continue
            next_beat = time.monotonic() + self.heartbeat_s
            with self._lock:  # (every one it holds, ended or not: not yet reported)
                held = [job.held for job in self._jobs.values()]
            try:
                answer = self._call(partial(self.client.heartbeat, held))
            except (Unreachable, TokenRefused, Rejected):
                continue
            except Exception:
                log.exception("a heartbeat failed; the next one is sent as usual")
                continue
            for execution_id in (answer.get("cancel") or []) + (answer.get("unknown") or []):
                self._stop_one(execution_id, "cancelled on the server"
                               if execution_id in (answer.get("cancel") or [])
                               else "no longer this runner's (the server ended it)")

    def _watch(self) -> None:
        """The fence, looked at every tenth of ``dead_after_s`` (at most every second)
        whatever a request is doing meanwhile."""
        while True:
            self._fence(time.monotonic())
            if self._closed.wait(self._look_s()):
                return

    def _look_s(self) -> float:
        return min(1.0, self.dead_after_s / 10)

    def _fence(self, now: float) -> None:
        """Out of touch for over half of ``dead_after_s``: stop every agent here.

        Counted from the sending of the last request that got an answer: the server
        heard it no earlier, so it counts the silence from no earlier either."""
        silent = now - self._last_ok
        if self.refused.is_set():
            return  # (refused, not out of reach: the runner is stopping its agents)
        if silent <= self.dead_after_s / 2:
            # The keeper's own, should this process freeze: two looks after this one's.
            self.fence_keeper(self._last_ok + self.dead_after_s / 2 + 2 * self._look_s())
            return
        with self._lock:
            live = [job for job in self._jobs.values()
                    if job.result is None and not job.fenced]
        for job in live:  # (said once; one not started yet is tried again next look)
            job.fenced = self._stop_one(
                job.execution["id"], f"the server was out of reach for {silent:.0f}s "
                f"(more than half of dead_after_s, {self.dead_after_s:g}s)")

    def _stop_one(self, execution_id: str, reason: str) -> bool:
        """Stop that execution's agent; whether a stop was asked of a live one."""
        with self._lock:
            job = self._jobs.get(execution_id)
        if job is None or job.result is not None:
            return False
        stopping = self.runtime.stop_execution(job.execution["id"], reason)
        if stopping:
            log.warning("run %s stopped: %s", job.execution["run_id"], reason)
        return stopping

    # -- the server -----------------------------------------------------------------
    def _call(self, request: Callable[[], T]) -> T:
        """One request; an outage is logged once (when it starts and when it ends)."""
        sent = time.monotonic()
        try:
            answer = request()
        except TokenRefused as exc:
            if not self.refused.is_set():
                if isinstance(exc, NameTaken):
                    self.name_taken = True
                    log.error("the server refused this runner: %s", exc)
                else:
                    log.error("the server refused this runner's token: %s", exc)
            self.refused.set()
            self.stop.set()
            raise
        except Unreachable as exc:
            if self._down_since is None:
                self._down_since = time.monotonic()
                log.warning("the server cannot be reached (%s); trying again", exc)
            raise
        with self._lock:  # (several threads ask; the latest sending counts)
            self._last_ok = max(self._last_ok, sent)
        if self._down_since is not None:
            log.info("the server is reachable again (after %.0fs)",
                     time.monotonic() - self._down_since)
            self._down_since = None
        return answer

    def _until_through(self, request: Callable[[], T]) -> T | None:
        """``request`` tried until it gets through (None: stopped or refused first)."""
        while not self.stop.is_set():
            try:
                return self._call(request)
            except TokenRefused:
                return None
            except Unreachable:
                self.stop.wait(self._backoff())
        return None

    def _backoff(self) -> float:
        down = time.monotonic() - (self._down_since or time.monotonic())
        return min(MAX_BACKOFF_S, max(1.0, down / 4))
