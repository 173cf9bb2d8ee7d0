"""The process runner: one agent execution under a shim, from spawn to its end.

Every agent runs under a shim (:mod:`kandevd.runtime.shim`) that leads its
process group and writes the agent's exit status to a file, so no pipe ties
the agent to the daemon: a daemon that dies leaves the agent running and its
status on disk for the next instance to adopt (:meth:`ProcessRunner.adopt`)
or record. The wait is one ``select()`` over a pidfd of the shim and the
control's wake pipe; a timeout or a stop sends SIGTERM to the group, then
SIGKILL after the kill grace. docs/architecture.md ("An execution") draws the
steps; nothing here raises for anything the child or the file system does.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from kandevd.agents.profiles import executable_problem
from kandevd.fsutil import ensure_dir
from kandevd.runtime import attempts, records, shim
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
    signal_group,
    termination_error,
    termination_text,
)
from kandevd.runtime.output import NO_REPORT, AgentReport, LogSink, collect_stdout
from kandevd.runtime.records import ExecutionRecord, write_record
from kandevd.runtime.termination import Waited, has_exited, open_pidfd, wait_for_shim
from kandevd.timeutil import after, utc_now

log = logging.getLogger("kandevd.runtime.process")

DEFAULT_KILL_GRACE_S = 5.0
DETACHED_ERROR = "detached: left running for the next daemon instance to adopt"



# Shims of detached executions that are our children: reaped (without
# blocking) by later runs so they do not linger as zombies.
_detached_lock = threading.Lock()
_detached: list[subprocess.Popen[bytes]] = []


def _keep_detached(proc: subprocess.Popen[bytes]) -> None:
    with _detached_lock:
        _detached.append(proc)


def _reap_detached() -> None:
    if not _detached:
        return
    with _detached_lock:
        _detached[:] = [proc for proc in _detached if proc.poll() is None]


class ProcessRunner:
    """The default runner: the agent command under a shim (contract 5)."""

    def __init__(self, kill_grace_s: float = DEFAULT_KILL_GRACE_S) -> None:
        if kill_grace_s < 0:
            raise ValueError("kill_grace_s must be >= 0")
        self.kill_grace_s = kill_grace_s

    # -- a new execution -------------------------------------------------------

    def run(self, spec: ExecutionSpec, control: ExecutionControl) -> ExecutionResult:
        """Run the agent to its end; see the module docstring for the steps."""
        started_at = utc_now()
        _reap_detached()

        def result(outcome: str, exit_code: int | None = None, error: str | None = None,
                   report: AgentReport = NO_REPORT, journaled: bool = False) -> ExecutionResult:
            return ExecutionResult(
                key=spec.key, outcome=outcome, exit_code=exit_code, summary=report.summary,
                cost_cents=report.cost_cents, error=error, started_at=started_at,
                ended_at=utc_now(), log_path=spec.log_path, journaled=journaled,
                evaluation=report.evaluation,
            )

        try:
            ensure_dir(spec.log_path.parent)
            sink = LogSink.open(spec.log_path)
        except OSError as exc:
            message = f"cannot open log file {spec.log_path}: {exc}"
            log.error("execution %s: %s", spec.key, message)
            return result(ERROR, error=message)
        try:
            return self._run_with_log(spec, control, sink, started_at, result)
        finally:
            sink.close()

    def _run_with_log(self, spec: ExecutionSpec, control: ExecutionControl, sink: LogSink,
                      started_at: datetime, result: Callable[..., ExecutionResult],
                      ) -> ExecutionResult:
        def fail_to_start(message: str) -> ExecutionResult:
            log.error("execution %s: %s", spec.key, message)
            sink.note(message)
            return result(ERROR, error=message)

        log_offset = sink.size()  # the summary is searched after this
        try:
            ensure_dir(spec.cwd)
        except OSError as exc:
            return fail_to_start(f"cannot create working directory {spec.cwd}: {exc}")
        try:
            stdin_bytes = (json.dumps(dict(spec.stdin)) + "\n").encode()
        except (TypeError, ValueError) as exc:
            return fail_to_start(f"stdin object is not JSON serializable: {exc}")

        input_path = spec.input_path
        try:  # the agent's stdin: complete on disk before it starts
            fd = os.open(input_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "wb") as handle:
                handle.write(stdin_bytes)
        except OSError as exc:
            return fail_to_start(f"cannot write agent input {input_path}: {exc}")

        request = control.requested
        if request is not None:  # stopped before it even started: start nothing
            outcome, reason = request
            sink.note(f"not started: {termination_error(outcome, reason, spec)}")
            return result(outcome, error=termination_error(outcome, reason, spec))
        if control.detach_requested and spec.record_dir is not None:
            # Nothing runs yet that could be left running: start nothing.
            error = "interrupted: the daemon stopped before the agent started"
            sink.note(f"not started: {error}")
            return result(INTERRUPTED, error=error)

        env = dict(os.environ)
        env.update(spec.env)
        env["KANDEVD_RUN_ID"] = spec.run_id
        env["KANDEVD_SESSION_ID"] = spec.session_id
        env["KANDEVD_HOME"] = spec.home
        env["KANDEVD_INPUT"] = str(input_path)
        problem = executable_problem(spec.argv[0], spec.cwd, env.get("PATH"))
        if problem is not None:
            return fail_to_start(problem)

        if spec.record_dir is not None:
            exit_path = spec.record_dir / attempts.EXIT_FILE
            stdout_path = spec.record_dir / attempts.STDOUT_FILE
            try:
                attempts.prepare(spec.record_dir)
            except OSError as exc:
                return fail_to_start(
                    f"cannot create the execution's record folder {spec.record_dir}: {exc}")
            # Recorded before the spawn too (pid 0): a daemon killed right after the
            # spawn leaves a record whose shim the next start finds and adopts. (In the
            # recycled folder's empty record.json, when there is one: no new file.)
            self._write_record(spec, 0, started_at, input_path, log_offset, in_place=True)
            return self._spawn_and_wait(spec, control, sink, started_at, result, input_path,
                                        exit_path, stdout_path, env, log_offset)
        # No record folder: temporary exit and stdout files beside the log (whose
        # folder is private), under names nobody can guess. Files, not a folder:
        # mkdir and rmdir would cost more than the rest of the bookkeeping together.
        token = os.urandom(8).hex()
        exit_path = spec.log_path.with_name(f"{spec.log_path.name}.exit-{token}")
        stdout_path = spec.log_path.with_name(f"{spec.log_path.name}.stdout-{token}")
        try:
            return self._spawn_and_wait(spec, control, sink, started_at, result, input_path,
                                        exit_path, stdout_path, env, log_offset)
        finally:
            for temporary in (exit_path, stdout_path):
                try:
                    os.unlink(temporary)
                except OSError:
                    pass

    def _spawn_and_wait(self, spec: ExecutionSpec, control: ExecutionControl, sink: LogSink,
                        started_at: datetime, result: Callable[..., ExecutionResult],
                        input_path: Path, exit_path: Path, stdout_path: Path,
                        env: dict[str, str], log_offset: int) -> ExecutionResult:
        try:
            proc = subprocess.Popen(
                shim.shim_argv(exit_path, input_path, spec.log_path, spec.argv, stdout_path),
                stdin=subprocess.DEVNULL, stdout=sink.fd, stderr=subprocess.STDOUT,
                cwd=spec.cwd, env=env, start_new_session=True, close_fds=True, shell=False,
            )
        except (OSError, ValueError, TypeError) as exc:
            message = f"cannot start agent {spec.argv[0]}: {exc}"
            log.error("execution %s: %s", spec.key, message)
            sink.note(message)
            return result(ERROR, error=message)

        pid = proc.pid
        spawned_at = time.monotonic()
        control.attach(pid)
        log.debug("execution %s started: shim pid %d, %s", spec.key, pid, spec.argv[0])
        # Only an execution with a record can be adopted, so only it may be left running.
        detachable = (spec.record_dir is not None
                      and self._write_record(spec, pid, started_at, input_path, log_offset,
                                             in_place=True))
        pidfd = open_pidfd(pid)
        try:
            waited = wait_for_shim(spec.key, control, sink, pid, pidfd,
                                   spawned_at + spec.timeout_s, spec.timeout_s,
                                   lambda: has_exited(pid), kill_grace_s=self.kill_grace_s,
                                   detachable=detachable, spawned_at=spawned_at)
        except BaseException:
            # Our bug, not the child's: never leave the child behind.
            control.detach()
            signal_group(pid, signal.SIGKILL)
            proc.wait()
            raise
        finally:
            if pidfd is not None:
                os.close(pidfd)
        if waited.detached:
            control.detach()
            _keep_detached(proc)
            log.info("execution %s detached: shim pid %d keeps running", spec.key, pid)
            return result(DETACHED, error=DETACHED_ERROR)

        # The shim is a zombie now (not reaped, so its pid cannot be reused):
        # make sure nothing of its group outlives it, then reap it.
        signal_group(pid, signal.SIGKILL)
        control.detach()
        shim_status = proc.wait()
        status = shim.read_exit_file(exit_path)
        exit_code = status if status is not None else shim.exit_code_from_status(shim_status)

        if spec.record_dir is not None:
            report = collect_stdout(stdout_path, spec.log_path,
                                    spec.record_dir / attempts.SUMMARY_FILE,
                                    attempts.spent_stdout_path(spec.record_dir))
        else:
            report = collect_stdout(stdout_path, spec.log_path)
        if waited.ended_by is not None:
            outcome, reason = waited.ended_by
            error: str | None = termination_error(outcome, reason, spec)
        elif exit_code == 0:
            outcome, error = SUCCEEDED, None
        else:
            outcome, error = FAILED, describe_exit(exit_code)
        # A success is logged by whoever started the execution (the queue's "run ...
        # finished"); one line per run is enough at INFO when thousands run a minute.
        level = {SUCCEEDED: logging.DEBUG, FAILED: logging.INFO}.get(outcome, logging.WARNING)
        log.log(level, "execution %s ended: %s (exit %s)", spec.key, outcome, exit_code)
        return result(outcome, exit_code=exit_code, error=error, report=report,
                      journaled=detachable and status is not None)

    def _write_record(self, spec: ExecutionSpec, pid: int, started_at: datetime,
                      input_path: Path, log_offset: int, *, in_place: bool = False) -> bool:
        """Write ``record.json`` for the shim ``pid``; False when it could not be written."""
        assert spec.record_dir is not None
        pid_start = shim.proc_start_time(pid) if pid else 0
        if pid_start is None:  # cannot happen for an unreaped child; be safe anyway
            log.warning("execution %s: no start time for shim pid %d; it cannot be adopted",
                        spec.key, pid)
            return False
        record = ExecutionRecord(
            record_dir=spec.record_dir, pid=pid, pid_start=pid_start, key=spec.key,
            run_id=spec.run_id, session_id=spec.session_id, started_at=started_at,
            deadline=after(started_at, spec.timeout_s), timeout_s=float(spec.timeout_s),
            log_path=spec.log_path, input_path=input_path, argv=spec.argv,
            log_offset=log_offset, stdout_path=spec.record_dir / attempts.STDOUT_FILE,
        )
        try:
            write_record(record, in_place=in_place)
        except (OSError, ValueError) as exc:
            log.warning("execution %s: cannot write its record in %s (%s); it cannot be "
                        "adopted after a restart", spec.key, spec.record_dir, exc)
            return False
        return True

    # -- an execution an earlier instance started ------------------------------------

    def adopt(self, spec: ExecutionSpec, control: ExecutionControl,
              record: ExecutionRecord) -> ExecutionResult:
        """Wait for the shim of ``record``, which is not our child, as if we had started it.

        The deadline is the record's (a past one terminates at once); stop
        and shutdown requests on ``control`` act as for :meth:`run`.
        """
        def result(outcome: str, exit_code: int | None = None, error: str | None = None,
                   report: AgentReport = NO_REPORT) -> ExecutionResult:
            return ExecutionResult(
                key=spec.key, outcome=outcome, exit_code=exit_code, summary=report.summary,
                cost_cents=report.cost_cents, error=error, started_at=record.started_at,
                ended_at=max(utc_now(), record.started_at), log_path=record.log_path,
                evaluation=report.evaluation,
            )

        pid = record.pid
        waited = Waited()
        pidfd: int | None = None
        opener = getattr(os, "pidfd_open", None)
        alive = True
        if opener is not None:
            try:
                pidfd = opener(pid)
            except ProcessLookupError:
                alive = False
            except OSError:  # no pidfds on this kernel: fall back to polling
                pidfd = None
        sink = LogSink.open_or_disabled(record.log_path)
        try:
            # Checked after the pidfd is open, so the pidfd is the shim's own.
            alive = alive and records.record_alive(record)
            if alive:
                control.attach(pid)
                remaining = (record.deadline - utc_now()).total_seconds()
                log.info("execution %s adopted: shim pid %d, %.1fs left before its timeout",
                         spec.key, pid, max(remaining, 0.0))
                try:
                    waited = wait_for_shim(
                        spec.key, control, sink, pid, pidfd, time.monotonic() + remaining,
                        record.timeout_s,
                        lambda: not shim.process_running(pid, record.pid_start),
                        kill_grace_s=self.kill_grace_s, detachable=True)
                finally:
                    control.detach()
                if waited.detached:
                    log.info("execution %s detached again: shim pid %d keeps running",
                             spec.key, pid)
                    return result(DETACHED, error=DETACHED_ERROR)
                # Stragglers of the group, unless the group is gone and its id reused.
                if shim.group_may_be_signalled(pid, record.pid_start):
                    signal_group(pid, signal.SIGKILL)
        finally:
            sink.close()
            if pidfd is not None:
                os.close(pidfd)

        status = records.read_exit_status(record.record_dir)
        if waited.ended_by is not None:
            outcome, reason = waited.ended_by
            exit_code = status if status is not None else (
                -signal.SIGKILL if waited.killed else None)
            report = records.collect_output(record)
            log.warning("execution %s ended: %s (exit %s)", spec.key, outcome, exit_code)
            return result(outcome, exit_code=exit_code, report=report,
                          error=termination_text(outcome, reason, record.timeout_s))
        if status is None:
            log.warning("execution %s: %s", spec.key, records.NO_EXIT_STATUS)
            report = records.collect_output(record)  # its output belongs in the log
            return result(ERROR, error=records.NO_EXIT_STATUS, report=report)
        ended = records.result_for_exit(record, status)
        log.info("execution %s ended: %s (exit %s)", spec.key, ended.outcome, status)
        return dataclasses.replace(ended, key=spec.key)

    # -- waiting ----------------------------------------------------------------
