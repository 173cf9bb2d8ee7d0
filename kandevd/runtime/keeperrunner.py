"""The keeper runner: each execution started by the home's keeper, its end heard from it.

For one execution the daemon writes the agent's input, creates its stdout
file and opens its log, and hands the three descriptors to the keeper with
the argv and environment; the keeper spawns the agent directly (no shell),
journals the spawn and later the exit, and enforces the time limit itself,
daemon or not. This side waits for the exit on the execution's control (a
stop, a detach and the keeper's events all wake it), then merges the agent's
stdout into the log and reads its summary. The exit stays in the keeper's
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
from datetime import datetime
from pathlib import Path
from typing import Any

from kandevd.agents.profiles import executable_problem
from kandevd.fsutil import ensure_dir
from kandevd.keeper import protocol
from kandevd.keeper.agents import foreign_exit_of
from kandevd.runtime.agentfiles import (
    execution_id,
    merge_stdout,
    open_empty,
    resolve,
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
from kandevd.runtime.output import (
    NO_REPORT,
    AgentReport,
    LogSink,
    attempt_ended,
    attempt_started,
    unlink_stdout,
)
from kandevd.runtime.process import DETACHED_ERROR, ProcessRunner
from kandevd.runtime.records import ExecutionRecord, kept_outcome, write_record
from kandevd.timeutil import after, parse_rfc3339, rfc3339, utc_now

log = logging.getLogger("kandevd.runtime.process")

#: After the agent's pidfd says it ended, how long the keeper's word is waited for.
_EXIT_WORD_S = 2.0
#: While the keeper is there its word ends the wait; after this long without one the
#: agent's pidfd is watched too (a keeper that is alive but wedged).
_KEEPER_WORD_S = 5.0


class KeeperRunner:
    #: A run's attempt is opened and closed in its log here (``ExecutionSpec.attempt``).
    frames_logs = True

    def __init__(self, client: KeeperClient, kill_grace_s: float) -> None:
        self.client = client
        self.kill_grace_s = kill_grace_s
        self.legacy = ProcessRunner(kill_grace_s)

    # -- a new execution ---------------------------------------------------------------

    def run(self, spec: ExecutionSpec, control: ExecutionControl) -> ExecutionResult:
        started_at = utc_now()
        try:
            ensure_dir(spec.log_path.parent)
            sink = LogSink.open(spec.log_path)
        except OSError as exc:
            return self._result(spec, started_at, ERROR,
                                error=f"cannot open log file {spec.log_path}: {exc}")
        try:
            if spec.attempt:
                sink.note(attempt_started(spec.attempt, started_at))
            result = self._run(spec, control, sink, started_at)
            # (A death by a stop signal nobody here asked for may yet turn out to be the
            # shutdown's: the runtime decides, and the ending is noted after it.)
            if spec.attempt and result.outcome != DETACHED and not (
                    result.outcome == FAILED and ended_by_stop_signal(result.exit_code)):
                sink.note(attempt_ended(spec.attempt, result.ended_at, result.outcome,
                                        result.error))
                result = dataclasses.replace(result, framed=True)
            return result
        finally:
            sink.close()

    def _run(self, spec: ExecutionSpec, control: ExecutionControl, sink: LogSink,
             started_at: datetime) -> ExecutionResult:
        def refuse(message: str, outcome: str = ERROR) -> ExecutionResult:
            if outcome == ERROR:
                log.error("execution %s: %s", spec.key, message)
            sink.note(message if outcome == ERROR else f"not started: {message}")
            return self._result(spec, started_at, outcome, error=message)

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
            ensure_dir(spec.cwd)
        except OSError as exc:
            return refuse(f"cannot create working directory {spec.cwd}: {exc}")
        problem = executable_problem(spec.argv[0], spec.cwd, search_path)
        if problem is not None:
            return refuse(problem)
        path = resolve(spec.argv[0], spec.cwd, search_path)
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
        meta = _meta(spec, started_at, out_path, log_offset)
        handle = Handle(execution, meta)
        handle.wake = functools.partial(_on_event, handle, control, self.client,
                                        spec.kind == "turn" and spec.record_dir is not None)
        try:
            try:
                self.client.spawn(handle, path=path, argv=list(spec.argv), env=env,
                                  cwd=str(spec.cwd), stdio=[fd_in, fd_out, sink.fd],
                                  timeout_s=float(spec.timeout_s), grace=self.kill_grace_s)
            finally:
                os.close(fd_in)
            if spec.kind == "turn" and spec.record_dir is not None:
                self._write_turn_record(spec, handle, control)
            waited = self._wait(spec, control, handle)
            control.detach()
            if handle.refused is not None:
                self.client.forget(execution)
                unlink_stdout(out_path)
                return refuse(handle.refused)
            if waited == DETACHED:
                self.client.forget(execution)
                log.info("execution %s detached: agent pid %d keeps running", spec.key,
                         handle.pid)
                return self._result(spec, started_at, DETACHED, error=DETACHED_ERROR)
            _note_termination(sink, handle, self.kill_grace_s, spec.timeout_s)
            report = merge_stdout(fd_out, sink)
        except KeeperUnavailable as exc:
            self.client.forget(execution)
            unlink_stdout(out_path)
            return refuse(f"cannot start agent {spec.argv[0]}: {exc}")
        finally:
            os.close(fd_out)
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

    def _wait(self, spec: ExecutionSpec, control: ExecutionControl, handle: Handle) -> str:
        """Until the agent ended (or was refused, or is left running: DETACHED)."""
        stop_sent: tuple[str, str] | None = None
        grace_sent: float | None = None
        gone = False  # the agent's pidfd says it ended
        watch_pidfd = False  # the keeper has been silent a while: watch the agent too
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

    # -- an execution an earlier daemon started --------------------------------------------

    def adopt(self, spec: ExecutionSpec, control: ExecutionControl,
              record: ExecutionRecord) -> ExecutionResult:
        if record.keeper_id is None:  # started by an older version, under its shim
            return self.legacy.adopt(spec, control, record)
        handle = self.client.handle(record.keeper_id)
        if handle is None or handle.exit is not None:
            ended = kept_outcome(record)
            return ended if ended is not None else self._result(
                spec, record.started_at, ERROR, error="the agent's exit status is unknown")
        handle.wake, handle.owned = control.notify, True
        handle.wake()
        log.info("execution %s adopted: agent pid %d (started by the keeper)", spec.key,
                 record.pid)
        waited = self._wait(spec, control, handle)
        control.detach()
        if waited == DETACHED:
            self.client.forget(handle.id)
            return self._result(spec, record.started_at, DETACHED, error=DETACHED_ERROR)
        sink = LogSink.open_or_disabled(record.log_path)
        try:
            _note_termination(sink, handle, self.kill_grace_s, record.timeout_s)
        finally:
            sink.close()
        result = kept_outcome(_with_exit(record, handle))
        if result is None:
            return self._result(spec, record.started_at, ERROR,
                                error="the agent's exit status is unknown",
                                execution=handle.id)
        return result

    # -- after the outcome is recorded --------------------------------------------------------

    def settle_ids(self, ids: list[str]) -> None:
        """These outcomes are recorded: the keeper forgets their exits, their stdout goes."""
        for execution in ids:
            handle = self.client.handle(execution)
            if handle is not None and handle.meta.get("stdout_path"):
                unlink_stdout(Path(handle.meta["stdout_path"]))
        if ids:
            try:
                self.client.acknowledge(ids)
            except KeeperUnavailable as exc:
                log.warning("could not tell the keeper %d exit(s) are recorded (%s); it "
                            "reports them again, and they are recorded once", len(ids), exc)

    def release_unclaimed(self) -> None:
        released = self.client.release_unowned()
        if released:
            log.info("the keeper's record of %d execution(s) of an earlier instance that "
                     "nothing took up is released", len(released))

    def record_for(self, record_dir: Path) -> ExecutionRecord | None:
        """The keeper's record of the execution whose record folder is ``record_dir``."""
        handle = self.client.handle(record_dir.name)
        if handle is None or handle.meta.get("record_dir") != str(record_dir):
            return None
        return _with_exit(record_of(handle), handle)


def record_of(handle: Handle) -> ExecutionRecord:
    """An :class:`ExecutionRecord` from what the keeper keeps of an execution."""
    meta = handle.meta
    started = parse_rfc3339(meta["started_at"])
    return ExecutionRecord(
        record_dir=Path(meta.get("record_dir") or "."), pid=handle.pid, pid_start=handle.start,
        key=str(meta["key"]), run_id=str(meta.get("run_id", "")),
        session_id=str(meta.get("session_id", "")), started_at=started,
        deadline=after(started, float(meta["timeout_s"])), timeout_s=float(meta["timeout_s"]),
        log_path=Path(meta["log_path"]), input_path=Path(meta["input_path"]),
        argv=tuple(meta["argv"]), log_offset=int(meta.get("log_offset", 0)),
        stdout_path=Path(meta["stdout_path"]), keeper_id=handle.id, ended=handle.exit)


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


def _with_exit(record: ExecutionRecord, handle: Handle) -> ExecutionRecord:
    return dataclasses.replace(record, ended=handle.exit)


def _meta(spec: ExecutionSpec, started_at: datetime, out_path: Path, log_offset: int
          ) -> dict[str, Any]:
    return {"key": spec.key, "kind": spec.kind, "run_id": spec.run_id,
            "session_id": spec.session_id, "started_at": rfc3339(started_at),
            "timeout_s": float(spec.timeout_s), "log_path": str(spec.log_path),
            "input_path": str(spec.input_path), "stdout_path": str(out_path),
            "argv": list(spec.argv), "log_offset": log_offset,
            "record_dir": str(spec.record_dir) if spec.record_dir is not None else None}


def _note_termination(sink: LogSink, handle: Handle, grace: float, timeout_s: float) -> None:
    """In the log: how the keeper ended the agent (its stderr came before)."""
    ended = handle.exit or {}
    by = ended.get("by")
    if not by:
        return
    text = termination_text(str(by), str(ended.get("reason") or ""), timeout_s)
    sink.note(f"{text}: SIGTERM sent to process group {handle.pid}")
    if ended.get("killed"):
        sink.note(f"still running {grace:g}s after SIGTERM: SIGKILL sent")


