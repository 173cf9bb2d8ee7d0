"""The keeper runner: each execution started by the home's keeper, its end heard from it.

For one execution the daemon writes the agent's input, creates its stdout
file and opens its log, and hands the three descriptors to the keeper with
the argv and environment (:meth:`KeeperRunner.begin`); the keeper spawns the
agent directly (no shell), journals the spawn and later the exit, and enforces
the time limit itself, daemon or not. :meth:`KeeperRunner.finish` then merges
the agent's stdout into the log and reads its summary: where the keeper's word
of the exit arrived, when nothing else is left to do (no thread waits for
most executions, see :mod:`kandevd.runtime.threadless`), else in a thread that
waits for the exit on the execution's control (a stop, a detach and the
keeper's events all wake it). The exit stays in the keeper's
journal, and the stdout file on disk, until :meth:`settle` says the outcome
is recorded: a daemon that dies in between learns the outcome again, never
by running the agent again. Executions an older version started under its
shim are waited for the old way (:class:`~kandevd.runtime.process.ProcessRunner`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import select
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from kandevd.fsutil import ensure_dir, make_dir
from kandevd.keeper import protocol
from kandevd.keeper.agents import foreign_exit_of
from kandevd.runtime.agentfiles import (
    Programs,
    execution_id,
    merge_stdout,
    open_empty,
    stdout_path,
    write_input,
)
from kandevd.runtime.execution import (
    DETACHED,
    ERROR,
    FAILED,
    INTERRUPTED,
    SUCCEEDED,
    ExecutionControl,
    ExecutionResult,
    ExecutionSpec,
    describe_exit,
    ended_by_stop_signal,
    termination_error,
    termination_text,
)
from kandevd.runtime.keeperclient import Handle, KeeperClient, KeeperUnavailable
from kandevd.runtime.keeperrecords import (
    KeeperAdoption,
    meta_of,
    note_termination,
    record_of,
)
from kandevd.runtime.output import (
    NO_REPORT,
    AgentReport,
    LogSink,
    attempt_ended,
    attempt_started,
    unlink_stdout,
)
from kandevd.runtime.process import DETACHED_ERROR, ProcessRunner
from kandevd.runtime.records import write_record
from kandevd.timeutil import utc_now

log = logging.getLogger("kandevd.runtime.process")

#: After the agent's pidfd says it ended, how long the keeper's word is waited for.
_EXIT_WORD_S = 2.0
#: While the keeper is there its word ends the wait; after this long without one the
#: agent's pidfd is watched too (a keeper that is alive but wedged).
_KEEPER_WORD_S = 5.0


#: Of a threadless execution (:class:`Begun`): nobody told yet; a thread waits for it;
#: it ended, finished where the word came; it never started (its caller was told).
_PENDING, _WAITED, _ENDED, _DONE = "pending", "waited", "ended", "done"
#: A stdout file larger than this is merged into the log by a thread of its own, not
#: in the keeper's reader (which other executions' events wait for).
_QUICK_STDOUT = 256 * 1024


@dataclass(eq=False)
class Begun:
    """An execution whose agent the keeper was asked for, until :meth:`KeeperRunner.finish`."""

    spec: ExecutionSpec
    sink: LogSink
    started_at: datetime
    handle: Handle
    fd_out: int
    out_path: Path
    on_ready: Callable[[Begun, bool], None] | None
    state: str = _PENDING
    #: The keeper said nothing of it for a while: watch the agent's pidfd at once.
    silent: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class KeeperRunner(KeeperAdoption):
    #: A run's attempt is opened and closed in its log here (``ExecutionSpec.attempt``).
    frames_logs = True

    def __init__(self, client: KeeperClient, kill_grace_s: float) -> None:
        self.client = client
        self.kill_grace_s = kill_grace_s
        self.legacy = ProcessRunner(kill_grace_s)
        self._programs = Programs()

    # -- a new execution ---------------------------------------------------------------

    def run(self, spec: ExecutionSpec, control: ExecutionControl) -> ExecutionResult:
        begun = self.begin(spec, control)
        if isinstance(begun, ExecutionResult):
            return begun
        return self.finish(begun, control)

    def threadless(self, spec: ExecutionSpec) -> bool:
        """Can ``spec`` start without a thread waiting for it (:meth:`begin` with
        ``on_ready``)? Not a scheduled turn that keeps a record folder: its record is
        written once the agent is spawned, by a thread."""
        return not (spec.kind == "turn" and spec.record_dir is not None)

    def begin(self, spec: ExecutionSpec, control: ExecutionControl,
              on_ready: Callable[[Begun, bool], None] | None = None
              ) -> Begun | ExecutionResult:
        """Write the execution's files and ask the keeper for its agent; the result at
        once when it cannot start. :meth:`finish` ends what this began.

        With ``on_ready`` nobody needs to wait for the agent: ``on_ready(begun, True)``
        comes once the keeper's word leaves nothing to wait for (call :meth:`finish`,
        which then returns at once, in that thread), or ``on_ready(begun, False)`` once
        a thread must wait in :meth:`finish` (a stop or detach was asked, the keeper is
        lost or silent, or ending it may take a while); exactly one of the two.
        """
        started_at = utc_now()
        try:
            try:  # (its folder is there but for the first run: made only when missing)
                sink = LogSink.open(spec.log_path)
            except FileNotFoundError:
                ensure_dir(spec.log_path.parent)
                sink = LogSink.open(spec.log_path)
        except OSError as exc:
            return self._result(spec, started_at, ERROR,
                                error=f"cannot open log file {spec.log_path}: {exc}")
        try:
            if spec.attempt:
                sink.note(attempt_started(spec.attempt, started_at))
            begun = self._spawn(spec, control, sink, started_at, on_ready)
        except BaseException:
            sink.close()
            raise
        if isinstance(begun, ExecutionResult):
            try:
                return self._framed(spec, sink, begun)
            finally:
                sink.close()
        return begun

    def finish(self, begun: Begun, control: ExecutionControl) -> ExecutionResult:
        """Wait for what :meth:`begin` started to end; its result."""
        try:
            return self._framed(begun.spec, begun.sink, self._after_spawn(begun, control))
        finally:
            begun.sink.close()

    def hurry(self, begun: Begun) -> None:
        """``begun`` has waited without a thread for a while: a thread waits for it now,
        watching its agent's pidfd too (the keeper may be alive but wedged)."""
        with begun.lock:
            if begun.state != _PENDING:
                return
            begun.state, begun.silent = _WAITED, True
        if begun.on_ready is not None:
            begun.on_ready(begun, False)

    def _framed(self, spec: ExecutionSpec, sink: LogSink, result: ExecutionResult
                ) -> ExecutionResult:
        """The attempt's end noted in its log (``spec.attempt``), unless left to others.

        (A death by a stop signal nobody here asked for may yet turn out to be the
        shutdown's: the runtime decides, and the ending is noted after it.)"""
        if spec.attempt and result.outcome != DETACHED and not (
                result.outcome == FAILED and ended_by_stop_signal(result.exit_code)):
            sink.note(attempt_ended(spec.attempt, result.ended_at, result.outcome,
                                    result.error))
            return dataclasses.replace(result, framed=True)
        return result

    def _refuse(self, spec: ExecutionSpec, sink: LogSink, started_at: datetime,
                message: str, outcome: str = ERROR) -> ExecutionResult:
        if outcome == ERROR:
            log.error("execution %s: %s", spec.key, message)
        sink.note(message if outcome == ERROR else f"not started: {message}")
        return self._result(spec, started_at, outcome, error=message)

    def _spawn(self, spec: ExecutionSpec, control: ExecutionControl, sink: LogSink,
               started_at: datetime, on_ready: Callable[[Begun, bool], None] | None
               ) -> Begun | ExecutionResult:
        def refuse(message: str, outcome: str = ERROR) -> ExecutionResult:
            return self._refuse(spec, sink, started_at, message, outcome)

        request = control.requested
        if request is not None:  # stopped before it even started: start nothing
            return refuse(termination_error(request[0], request[1], spec), request[0])
        if control.detach_requested and spec.record_dir is not None:
            return refuse("interrupted: the daemon stopped before the agent started",
                          INTERRUPTED)
        env = {**spec.env, "KANDEVD_RUN_ID": spec.run_id,  # (added to the daemon's)
               "KANDEVD_SESSION_ID": spec.session_id, "KANDEVD_HOME": spec.home,
               "KANDEVD_INPUT": str(spec.input_path)}
        search_path = env.get("PATH", self.client.environ.get("PATH"))
        try:
            make_dir(spec.cwd)
        except OSError as exc:
            return refuse(f"cannot create working directory {spec.cwd}: {exc}")
        problem, path = self._programs.find(spec.argv[0], spec.cwd, search_path)
        if problem is not None:
            return refuse(problem)
        execution = execution_id(spec)
        out_path = stdout_path(spec, execution)
        log_offset = sink.size()
        try:
            stdin = (json.dumps(dict(spec.stdin)) + "\n").encode()
        except (TypeError, ValueError) as exc:
            return refuse(f"stdin object is not JSON serializable: {exc}")
        try:
            fd_in = write_input(spec.input_path, stdin)
        except OSError as exc:
            return refuse(f"cannot write agent input {spec.input_path}: {exc}")
        try:
            if spec.kind != "run":  # (a queued run's folder is made at the daemon's start)
                ensure_dir(out_path.parent)
            fd_out = open_empty(out_path)
        except OSError as exc:
            os.close(fd_in)
            return refuse(f"cannot create the agent's stdout file {out_path}: {exc}")
        handle = Handle(execution, meta_of(spec, started_at, out_path, log_offset))
        begun = Begun(spec, sink, started_at, handle, fd_out, out_path, on_ready)
        if on_ready is None:
            handle.wake = functools.partial(_on_event, handle, control, self.client,
                                            spec.kind == "turn" and spec.record_dir is not None)
        else:
            handle.wake = functools.partial(self._event, begun, control, True)
            control.listen(functools.partial(self._event, begun, control, False))
        try:
            self.client.spawn(handle, path=path, argv=list(spec.argv), env=env,
                              cwd=str(spec.cwd), stdio=[fd_in, fd_out, sink.fd],
                              timeout_s=float(spec.timeout_s), grace=self.kill_grace_s)
        except KeeperUnavailable as exc:
            message = f"cannot start agent {spec.argv[0]}: {exc}"
            with begun.lock:
                taken = begun.state != _PENDING
                begun.state = begun.state if taken else _DONE
            if taken:  # (a stop came first: the thread that waits for it learns this)
                handle.refused = message
                handle.wake()
                return begun
            self.client.forget(execution)
            os.close(fd_out)
            unlink_stdout(out_path)
            return refuse(message)
        finally:
            os.close(fd_in)
        return begun

    def _event(self, begun: Begun, control: ExecutionControl, from_keeper: bool) -> None:
        """The keeper said something of a threadless execution (``from_keeper``), or a
        stop or detach was asked of it: tell ``on_ready`` when nothing is left to wait
        for, or when a thread must wait for it; else (spawned) only note the agent."""
        handle = begun.handle
        with begun.lock:
            pending = begun.state == _PENDING
            if pending:
                if handle.exit is not None or handle.refused is not None:
                    begun.state = _ENDED if _quick_to_end(begun) else _WAITED
                elif (control.requested is not None or control.detach_requested
                      or self.client.lost):
                    begun.state = _WAITED
                else:
                    if handle.spawned:
                        control.attach(handle.pid, handle.pidfd)
                    return
                ended = begun.state == _ENDED
        if not pending:
            if from_keeper:  # (a thread may wait for it: wake it)
                _on_event(handle, control, self.client, False)
            return
        assert begun.on_ready is not None
        begun.on_ready(begun, ended)

    def _after_spawn(self, begun: Begun, control: ExecutionControl) -> ExecutionResult:
        spec, sink, handle, started_at = begun.spec, begun.sink, begun.handle, begun.started_at
        try:
            if spec.kind == "turn" and spec.record_dir is not None:
                self._write_turn_record(spec, handle, control)
            waited = self._wait(spec, control, handle, begun.silent)
            control.detach()
            if handle.refused is not None:
                self.client.forget(handle.id)
                unlink_stdout(begun.out_path)
                return self._refuse(spec, sink, started_at, handle.refused)
            if waited == DETACHED:
                self.client.forget(handle.id)
                log.info("execution %s detached: agent pid %d keeps running", spec.key,
                         handle.pid)
                return self._result(spec, started_at, DETACHED, error=DETACHED_ERROR)
            note_termination(sink, handle, self.kill_grace_s, spec.timeout_s)
            report = merge_stdout(begun.fd_out, sink)
        finally:
            os.close(begun.fd_out)
        return self._ended(spec, started_at, handle, report)

    def _write_turn_record(self, spec: ExecutionSpec, handle: Handle,
                           control: ExecutionControl) -> None:
        """A scheduled turn keeps its ``record.json`` in its folder, naming the keeper's
        journal: the scheduler's restart repair reads turns from their folders."""
        while not handle.spawned and handle.refused is None and handle.exit is None:
            select.select([control.wake_fd], [], [], 1.0)
            control.drain_wake()
        if not handle.spawned or spec.record_dir is None:
            return
        record = dataclasses.replace(record_of(handle), record_dir=spec.record_dir,
                                     journal=protocol.folder(self.client.home)
                                     / protocol.JOURNAL, ended=None)
        try:
            ensure_dir(spec.record_dir)
            write_record(record)
        except (OSError, ValueError) as exc:
            log.warning("execution %s: cannot write its record in %s (%s); it cannot be "
                        "adopted after a restart", spec.key, spec.record_dir, exc)

    def _wait(self, spec: ExecutionSpec, control: ExecutionControl, handle: Handle,
              silent: bool = False) -> str:
        """Until the agent ended (or was refused, or is left running: DETACHED).
        ``silent``: the keeper said nothing for a while already (watch the pidfd now)."""
        stop_sent: tuple[str, str] | None = None
        grace_sent: float | None = None
        gone = False  # the agent's pidfd says it ended
        watch_pidfd = silent  # the keeper has been silent a while: watch the agent too
        attached = False
        while handle.exit is None and handle.refused is None:
            if handle.spawned and not attached:  # (a forced exit kills it from here)
                control.attach(handle.pid, handle.pidfd)
                attached = True
            request = control.requested
            if request is not None and handle.spawned:
                grace = self.kill_grace_s if control.kill_grace_s is None \
                    else control.kill_grace_s
                if control.kill_requested:
                    grace = 0.0
                if stop_sent is None or grace_sent is None or grace < grace_sent:
                    stop_sent, grace_sent = request, grace
                    try:
                        self.client.stop(handle, request[0], request[1], grace)
                    except KeeperUnavailable as exc:  # (a keeper that replaces it is told)
                        log.warning("execution %s: cannot ask the keeper to stop it (%s)",
                                    spec.key, exc)
            elif control.detach_requested and handle.spawned and request is None:
                return DETACHED
            watched = [control.wake_fd]
            if handle.pidfd is not None and not gone and (watch_pidfd or self.client.lost):
                watched.append(handle.pidfd)
            timeout = _EXIT_WORD_S if gone else None if len(watched) > 1 else _KEEPER_WORD_S
            ready, _, _ = select.select(watched, [], [], timeout)
            control.drain_wake()
            if handle.pidfd is not None and handle.pidfd in ready:
                gone = True  # ended: the keeper's word comes within moments
            elif not ready and not gone:
                watch_pidfd = True
            elif not ready and gone and handle.exit is None:
                # The keeper is gone and no other took over: learn the exit here.
                code = foreign_exit_of(handle.pid, handle.start, handle.pidfd)
                log.warning("execution %s: the keeper did not report the exit of agent %d; "
                            "read here (exit %s)", spec.key, handle.pid, code)
                handle.exit = {"code": code, "by": stop_sent[0] if stop_sent else None,
                               "reason": stop_sent[1] if stop_sent else "", "killed": False}
        return "ended"

    def _ended(self, spec: ExecutionSpec, started_at: datetime, handle: Handle,
               report: AgentReport) -> ExecutionResult:
        ended = handle.exit or {}
        code = ended.get("code")
        by = ended.get("by")
        if by:
            outcome, error = str(by), termination_text(str(by), str(ended.get("reason") or ""),
                                                       spec.timeout_s)
        elif code == 0:
            outcome, error = SUCCEEDED, None
        elif code is None:
            outcome, error = ERROR, "the agent's exit status was lost with its keeper"
        else:
            outcome, error = FAILED, describe_exit(int(code))
        level = {SUCCEEDED: logging.DEBUG, FAILED: logging.INFO}.get(outcome, logging.WARNING)
        log.log(level, "execution %s ended: %s (exit %s)", spec.key, outcome, code)
        return self._result(spec, started_at, outcome, exit_code=code, error=error,
                            report=report, execution=handle.id)

    @staticmethod
    def _result(spec: ExecutionSpec, started_at: datetime, outcome: str, *,
                exit_code: int | None = None, error: str | None = None,
                report: AgentReport = NO_REPORT, execution: str | None = None
                ) -> ExecutionResult:
        return ExecutionResult(
            key=spec.key, outcome=outcome, exit_code=exit_code, summary=report.summary,
            cost_cents=report.cost_cents, error=error, started_at=started_at,
            ended_at=max(utc_now(), started_at), log_path=spec.log_path,
            journaled=execution is not None, evaluation=report.evaluation,
            execution_id=execution)


def _on_event(handle: Handle, control: ExecutionControl, client: KeeperClient,
              wake_on_spawn: bool) -> None:
    """The keeper said something of ``handle`` (in its reader's thread). A spawn is
    attached to the control here; the waiting runner is woken only when it has
    something to do: an exit, a refusal, a stop or detach waiting for the spawn, a
    turn's record to write."""
    if handle.spawned and handle.exit is None and handle.refused is None:
        control.attach(handle.pid, handle.pidfd)
        if not (wake_on_spawn or control.requested is not None or control.detach_requested
                or client.lost):
            return
    control.notify()


def _quick_to_end(begun: Begun) -> bool:
    """Can the keeper's last word be finished in the thread it came on? Not a death by a
    stop signal (the runtime may wait to learn whether the shutdown's), nor an exit
    status lost, nor a large stdout to merge."""
    ended = begun.handle.exit or {}
    code = ended.get("code")
    if begun.handle.refused is None and (code is None or ended_by_stop_signal(int(code))):
        return False
    try:
        return os.fstat(begun.fd_out).st_size <= _QUICK_STDOUT
    except OSError:
        return False
