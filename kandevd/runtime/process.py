"""One agent execution: a shim-supervised process group, its log, its end.

This module knows nothing about slots or pools (that is ``runtime.py``); it
runs exactly one execution to completion in the calling thread and always
returns an :class:`ExecutionResult`, never raises for anything the child or
the file system does.

Every agent runs under a shim (see :mod:`kandevd.runtime.shim`): a tiny
``/bin/sh`` that leads the execution's session and process group, runs the
agent as its child with stdin from ``<log>.input.json``, its stderr appended
to the log file and its stdout to a file of its own (``<record_dir>/stdout``),
and writes the agent's exit status to ``<record_dir>/exit``. No pipe
connects the daemon to the agent, so nothing is lost when the daemon dies:
the agent runs on, its status lands on disk, and the next daemon instance
adopts it (:meth:`ProcessRunner.adopt`) or records its outcome from the files.

Life of one :meth:`ProcessRunner.run`::

    prepare (cwd, log file, stdin JSON in <log>.input.json,     --fail-->  outcome "error"
             named by $KANDEVD_INPUT; executable looked up)                    (no child)
        |
    exit file: <record_dir>/exit, or without a record folder a temporary
               <log>.exit-<random> beside the log (removed at the end);
    stdout file: <record_dir>/stdout, or <log>.stdout-<random> likewise
        |
    spawn the shim (own session = own process group)  --fail-->  outcome "error"
    write <record_dir>/record.json (pid, start time, deadline, ...)
        |
    wait: one select() over a pidfd of the shim and the control's wake
          pipe, with the next deadline as its timeout; nothing polls.
        |   timeout / stop request:  SIGTERM to the group, kill grace, SIGKILL
        |   detach request:          stop waiting, touch nothing -> "detached"
        |
    shim exited -> SIGKILL stragglers left in the group -> reap the shim ->
    status from the exit file (else the shim's own status) ->
    summary from the stdout file, which is then appended to the log and
    emptied and moved out of the record folder, or removed without one
    (:func:`collect_stdout`) -> ExecutionResult

Summary and cost: the summary line (CONTRACT.md section 5) is the *last
non-empty line of the agent's stdout*, read from the stdout file, so nothing
the agent writes to stderr afterwards hides it. Only the last MiB of the file
is read; a last line longer than that counts as ``<line too long>`` (no
summary).

The log: while the agent runs it holds the agent's stderr and the daemon's
``[kandevd] `` notes; once the execution ended, the agent's whole stdout is
appended after them. So the log holds both streams, but *stdout after
stderr*, not interleaved in the order they were written. An execution left
running (detached) is merged by whoever learns its end: the adopting runner
or :func:`kandevd.runtime.records.outcome_from_record`. With a record folder
the merge is idempotent: the summary is first saved as
``<record_dir>/summary.json`` (with the log's size before the merge), then
the stdout file is appended, emptied and moved out of the folder, so a
daemon dying mid-merge neither loses the summary nor duplicates the output
when the merge runs again.

A SIGTERM sent right after the spawn can be lost: between ``sh`` forking the
agent's subshell and that subshell resetting the shim's no-op trap, the
signal runs the inherited trap and the agent never sees it. So a termination
that begins less than 200 ms after the spawn sends SIGTERM to the group again
50 ms and 150 ms later (while the shim runs); the select timeouts schedule it.

Outcomes: ``succeeded`` (exit 0), ``failed`` (any other exit), ``timed_out``,
``stopped`` (someone stopped this execution), ``interrupted`` (the runtime is
shutting down), ``error`` (it could not even start), ``detached`` (the runner
stopped waiting without touching the process, which keeps running for the
next daemon instance to adopt).
"""

from __future__ import annotations

import json
import logging
import math
import os
import selectors
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from kandevd.fsutil import ensure_dir
from kandevd.runtime import recycle, shim
from kandevd.timeutil import after, utc_now

if TYPE_CHECKING:
    from kandevd.runtime.records import ExecutionRecord

log = logging.getLogger("kandevd.runtime.process")

SUCCEEDED = "succeeded"
FAILED = "failed"
TIMED_OUT = "timed_out"
STOPPED = "stopped"
INTERRUPTED = "interrupted"
ERROR = "error"
DETACHED = "detached"

OUTCOMES = frozenset({SUCCEEDED, FAILED, TIMED_OUT, STOPPED, INTERRUPTED, ERROR, DETACHED})
#: Outcomes a caller may ask for through :meth:`ExecutionControl.request_termination`.
TERMINATION_OUTCOMES = frozenset({TIMED_OUT, STOPPED, INTERRUPTED})
KINDS = frozenset({"run", "launch", "turn"})

DEFAULT_KILL_GRACE_S = 5.0
_LOG_PREFIX = "[kandevd] "
#: Poll interval of the fallback for kernels without pidfd_open.
_POLL_S = 0.05
#: Longest single select(): a deadline years away must not overflow the timeout.
_MAX_WAIT_S = 3600.0
#: A termination begun this soon after the spawn repeats its SIGTERM (see the docstring).
_EARLY_TERM_S = 0.2
#: When it repeats it, counted from the first SIGTERM.
_TERM_REPEATS_S = (0.05, 0.15)
#: Chunk size when the stdout file is appended to the log.
_COPY_CHUNK = 1024 * 1024
DETACHED_ERROR = "detached: left running for the next daemon instance to adopt"


@dataclass(frozen=True)
class ExecutionSpec:
    """Everything needed to run one agent execution, decided before it starts.

    ``argv`` is an argument vector, never a shell string: an agent's prompt or
    payload must not be able to inject commands. Lists are accepted and
    stored as tuples; string paths are stored as :class:`Path`.

    ``record_dir`` (optional) is the folder where the execution's
    ``record.json``, the shim's ``exit`` file and the agent's ``stdout``
    (until it is merged into the log) are kept, so a later daemon instance
    can adopt the agent or learn its outcome. The runner creates it and never
    deletes it; its owner does. Without one the shim's exit and stdout files
    are temporary files beside the log, removed when the execution ended
    (such an execution cannot be adopted, so it is never detached).
    """

    key: str
    kind: str
    argv: tuple[str, ...]
    stdin: Mapping[str, Any]
    cwd: Path
    log_path: Path
    timeout_s: float
    env: Mapping[str, str] = field(default_factory=dict)
    session_id: str = ""
    run_id: str = ""
    home: str = ""
    record_dir: Path | None = None

    def __post_init__(self) -> None:
        # Reject bad specs at construction so the mistake surfaces at the
        # caller, not as a puzzling "error" outcome minutes later.
        if not self.key:
            raise ValueError("ExecutionSpec.key must not be empty")
        if self.kind not in KINDS:
            raise ValueError(
                f"ExecutionSpec.kind must be one of {sorted(KINDS)}, not {self.kind!r}")
        if isinstance(self.argv, str):
            raise TypeError("ExecutionSpec.argv must be an argument list, not a shell string")
        object.__setattr__(self, "argv", tuple(self.argv))
        if not self.argv:
            raise ValueError("ExecutionSpec.argv must not be empty")
        object.__setattr__(self, "cwd", Path(self.cwd))
        object.__setattr__(self, "log_path", Path(self.log_path))
        if self.record_dir is not None:
            object.__setattr__(self, "record_dir", Path(self.record_dir))
        if not self.timeout_s > 0:  # also rejects NaN
            raise ValueError(f"ExecutionSpec.timeout_s must be > 0, not {self.timeout_s!r}")

    @property
    def input_path(self) -> Path:
        """``<log>.input.json``: the stdin object on disk, named by ``$KANDEVD_INPUT``."""
        return self.log_path.with_name(self.log_path.stem + ".input.json")


@dataclass(frozen=True)
class ExecutionResult:
    """How one execution ended. ``exit_code`` is negative when a signal ended it."""

    key: str
    outcome: str
    exit_code: int | None
    summary: str | None
    cost_cents: float | None
    error: str | None
    started_at: datetime
    ended_at: datetime
    log_path: Path
    #: The runner read ``exit_code`` from the shim's exit file and had written the
    #: execution's record: the record folder already tells this outcome to a restart,
    #: so nobody needs to read both files back to learn that.
    journaled: bool = False

    @property
    def succeeded(self) -> bool:
        """True only for a clean exit 0 that nobody interrupted."""
        return self.outcome == SUCCEEDED

    @property
    def duration_s(self) -> float:
        """Wall time of the execution in seconds."""
        return (self.ended_at - self.started_at).total_seconds()


class ExecutionControl:
    """The runtime's handle on one execution while a runner executes it.

    Requests are made from other threads (a cancel RPC, shutdown); the runner
    reacts to them in its own thread. A self-pipe wakes the runner's select()
    at once, so a silent child is stopped without any polling. The first
    termination request wins: a shutdown arriving after a cancel does not turn
    a ``stopped`` execution into an ``interrupted`` one.

    A detach request (:meth:`request_detach`) asks the runner to stop waiting
    and leave the process running. A runner that cannot leave it (an
    in-process one, an execution without a record folder, one already being
    terminated) ignores it, so a termination may still follow.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._request: tuple[str, str] | None = None
        self._requested = threading.Event()
        self._detach = False
        self._kill_now = False
        self._pgid: int | None = None
        self._closed = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    @property
    def wake_fd(self) -> int:
        """Readable whenever a termination or detach was requested (for selectors)."""
        return self._wake_r

    @property
    def requested(self) -> tuple[str, str] | None:
        """``(outcome, reason)`` of the first termination request, or None."""
        with self._lock:
            return self._request

    @property
    def detach_requested(self) -> bool:
        """True once :meth:`request_detach` was accepted."""
        with self._lock:
            return self._detach

    @property
    def kill_requested(self) -> bool:
        """True once :meth:`kill_now` was called (a forced exit)."""
        with self._lock:
            return self._kill_now

    def request_termination(self, outcome: str, reason: str) -> bool:
        """Ask the runner to end the execution with ``outcome``.

        Returns True when this call made the (first) request, False when one
        was already made or the execution is over.
        """
        if outcome not in TERMINATION_OUTCOMES:
            raise ValueError(f"not a termination outcome: {outcome!r}")
        with self._lock:
            if self._closed or self._request is not None:
                return False
            self._request = (outcome, reason)
            self._requested.set()
            self._wake()
            return True

    def request_detach(self) -> bool:
        """Ask the runner to stop waiting and leave the process running.

        False when a termination was already requested (it goes on), a detach
        was already requested, or the execution is over.
        """
        with self._lock:
            if self._closed or self._request is not None or self._detach:
                return False
            self._detach = True
            self._wake()
            return True

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:  # pipe full: the runner is already awake
            pass

    def wait_requested(self, timeout: float | None = None) -> bool:
        """Block until a termination is requested (for runners without fds)."""
        return self._requested.wait(timeout)

    def kill_now(self) -> None:
        """SIGKILL the process group at once (forced exit); no grace, no waiting."""
        with self._lock:
            self._kill_now = True
            pgid = self._pgid
        if pgid is not None:
            _signal_group(pgid, signal.SIGKILL)

    def attach(self, pgid: int) -> None:
        """Record the live process group; called by the runner right after spawn.

        The runner must :meth:`detach` before it reaps the leader, so a pid the
        kernel hands out again is never signalled by mistake.
        """
        with self._lock:
            self._pgid = pgid
            kill = self._kill_now
        if kill:
            _signal_group(pgid, signal.SIGKILL)

    def detach(self) -> None:
        """Forget the process group (before reaping the leader, or when leaving it)."""
        with self._lock:
            self._pgid = None

    def drain_wake(self) -> None:
        """Empty the wake pipe so select() does not spin on it."""
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        """Release the pipe; later requests are refused. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._pgid = None
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass


class Runner(Protocol):
    """Executes one spec in the calling thread and always returns a result."""

    def run(self, spec: ExecutionSpec, control: ExecutionControl) -> ExecutionResult:
        """Run ``spec`` to its end, honouring termination requests on ``control``."""
        ...

    def adopt(self, spec: ExecutionSpec, control: ExecutionControl,
              record: ExecutionRecord) -> ExecutionResult:
        """Wait for an execution an earlier daemon instance started (see ``record``)."""
        ...


def termination_error(outcome: str, reason: str, spec: ExecutionSpec) -> str:
    """The human readable ``error`` text for an execution ended on request."""
    return _termination_text(outcome, reason, spec.timeout_s)


def _termination_text(outcome: str, reason: str, timeout_s: float) -> str:
    if outcome == TIMED_OUT:
        return f"timed out after {float(timeout_s)}s"
    return f"{outcome}: {reason}" if reason else outcome


def describe_exit(exit_code: int) -> str:
    """``exit code N`` or ``killed by signal SIGX`` (for a negative code)."""
    if exit_code >= 0:
        return f"exit code {exit_code}"
    return f"killed by signal {_signal_name(-exit_code)}"


def parse_summary_line(line: str | None) -> tuple[str | None, float | None]:
    """``(summary, cost_cents)`` from the agent's last output line (contract 5)."""
    if not line:
        return None, None
    try:
        obj = json.loads(line)
    except ValueError:
        return None, None
    if not isinstance(obj, dict):
        return None, None
    summary = obj.get("summary")
    cost = obj.get("cost_cents")
    summary_value = summary if isinstance(summary, str) else None
    cost_value: float | None = None
    if isinstance(cost, int | float) and not isinstance(cost, bool):
        cost_value = float(cost)
        if not math.isfinite(cost_value) or cost_value < 0:
            cost_value = None  # a cost cannot be negative: it would hide spend from budgets
    return summary_value, cost_value


def collect_stdout(stdout_path: Path, log_path: Path, state_path: Path | None = None,
                   keep_as: Path | None = None) -> tuple[str | None, float | None]:
    """``(summary, cost_cents)`` of an ended execution; its stdout file goes into the log.

    The summary comes from the last non-empty line of ``stdout_path`` (the
    last MiB of it); then the file is appended to ``log_path`` and removed,
    or with ``keep_as`` emptied and renamed there (no inode freed; see
    :func:`kandevd.runtime.recycle.spent_stdout_path`).
    With ``state_path`` (``<record_dir>/summary.json``) this may run again
    after a crash at any point: the summary and the log's size are saved
    there before the log is touched, so a second run finds the summary
    even once the stdout file is gone, and appends only what was not
    appended yet (a partial copy is cut off first). Without it (a temporary
    stdout file nobody reads again) it simply runs once. Errors are logged,
    never raised: at worst the output stays in the stdout file.
    """
    state = _read_summary_state(state_path) if state_path is not None else None
    try:
        size = os.stat(stdout_path).st_size
    except OSError:  # merged already (or never written)
        if state is not None:
            return state[0], state[1]
        return None, None
    if state is not None:
        summary, cost, merged_from = state
    else:
        summary, cost = parse_summary_line(shim.last_line(stdout_path))
        merged_from = None
    if size:
        try:
            _append_stdout(stdout_path, log_path, size, summary, cost, merged_from, state_path)
        except OSError as exc:
            log.error("cannot append the agent's stdout %s to its log %s (%s); it is left "
                      "where it is", stdout_path, log_path, exc)
            return summary, cost
    if keep_as is not None:
        try:
            # Emptied first: a crash before the rename leaves an empty stdout file,
            # which a second call merges as nothing (the summary is in state_path).
            os.truncate(stdout_path, 0)
            os.rename(stdout_path, keep_as)
            return summary, cost
        except FileNotFoundError:
            return summary, cost
        except OSError as exc:
            log.debug("the agent's stdout file %s not kept as %s (%s); removed", stdout_path,
                      keep_as, exc)
    try:
        os.unlink(stdout_path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("cannot remove the agent's stdout file %s (%s)", stdout_path, exc)
    return summary, cost


def _append_stdout(stdout_path: Path, log_path: Path, size: int, summary: str | None,
                   cost: float | None, merged_from: int | None,
                   state_path: Path | None) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    try:
        log_size = os.fstat(fd).st_size
        if merged_from is not None and merged_from <= log_size:
            if log_size >= merged_from + size:
                return  # appended completely by an earlier run: only the unlink is left
            os.ftruncate(fd, merged_from)  # a partial copy: cut it off, append again
        elif state_path is not None:
            document = {"summary": summary, "cost_cents": cost, "log_size": log_size}
            fd_state = os.open(state_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC,
                               0o600)
            with os.fdopen(fd_state, "w", encoding="utf-8") as handle:
                json.dump(document, handle)
        with open(stdout_path, "rb") as source:
            while chunk := source.read(_COPY_CHUNK):
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def _read_summary_state(path: Path) -> tuple[str | None, float | None, int] | None:
    """``(summary, cost, log size before the merge)`` from ``summary.json``, or None."""
    try:
        document = json.loads(Path(path).read_bytes())
        summary, cost, log_size = (document["summary"], document["cost_cents"],
                                   document["log_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if summary is not None and not isinstance(summary, str):
        return None
    if cost is not None and (not isinstance(cost, int | float) or isinstance(cost, bool)):
        return None
    if not isinstance(log_size, int) or isinstance(log_size, bool) or log_size < 0:
        return None
    return summary, (float(cost) if cost is not None else None), log_size


def _signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to a process group; False when the group is already gone."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        log.warning("not permitted to signal process group %d with %s", pgid, sig)
        return False
    return True


class _LogSink:
    """The execution's log file as the daemon holds it (the shim's output, our notes)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self.fd = fd
        self._broken = fd < 0

    @classmethod
    def open(cls, path: Path) -> _LogSink:
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC
        return cls(path, os.open(path, flags, 0o600))

    @classmethod
    def open_or_disabled(cls, path: Path) -> _LogSink:
        """The log, or a sink that drops notes when the log cannot be opened."""
        try:
            return cls.open(path)
        except OSError as exc:
            log.error("cannot open log %s (%s); notes about the execution are dropped",
                      path, exc)
            return cls(path, -1)

    def size(self) -> int:
        try:
            return os.fstat(self.fd).st_size
        except OSError:
            return 0

    def write(self, data: bytes) -> None:
        if self._broken:
            return
        view = memoryview(data)
        try:
            while view:
                written = os.write(self.fd, view)
                view = view[written:]
        except OSError as exc:  # disk full and friends: keep the child running
            self._broken = True
            log.error("cannot write log %s (%s); dropping further notes", self.path, exc)

    def note(self, text: str) -> None:
        self.write(f"{_LOG_PREFIX}{text}\n".encode())

    def close(self) -> None:
        if self.fd < 0:
            return
        try:
            os.close(self.fd)
        except OSError:
            pass
        self.fd = -1


@dataclass
class _Wait:
    """How the wait for a shim ended."""

    ended_by: tuple[str, str] | None = None  # the termination we carried out
    detached: bool = False
    killed: bool = False  # we sent SIGKILL


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
                   summary: str | None = None, cost: float | None = None,
                   journaled: bool = False) -> ExecutionResult:
            return ExecutionResult(
                key=spec.key, outcome=outcome, exit_code=exit_code, summary=summary,
                cost_cents=cost, error=error, started_at=started_at, ended_at=utc_now(),
                log_path=spec.log_path, journaled=journaled,
            )

        try:
            ensure_dir(spec.log_path.parent)
            sink = _LogSink.open(spec.log_path)
        except OSError as exc:
            message = f"cannot open log file {spec.log_path}: {exc}"
            log.error("execution %s: %s", spec.key, message)
            return result(ERROR, error=message)
        try:
            return self._run_with_log(spec, control, sink, started_at, result)
        finally:
            sink.close()

    def _run_with_log(self, spec: ExecutionSpec, control: ExecutionControl, sink: _LogSink,
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
        problem = _executable_problem(spec.argv[0], spec.cwd, env.get("PATH"))
        if problem is not None:
            return fail_to_start(problem)

        if spec.record_dir is not None:
            exit_path = spec.record_dir / shim.EXIT_FILE
            stdout_path = spec.record_dir / shim.STDOUT_FILE
            try:
                # Files found there now are not this execution's: a recycled folder
                # was emptied when it was parked, and is emptied again (no file is
                # created), as is any folder already there.
                if not recycle.pool_for(spec.record_dir.parent).take(spec.record_dir):
                    ensure_dir(spec.record_dir)
                recycle.empty(spec.record_dir)
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

    def _spawn_and_wait(self, spec: ExecutionSpec, control: ExecutionControl, sink: _LogSink,
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
        pidfd = _open_pidfd(pid)
        try:
            waited = self._wait(spec.key, control, sink, pid, pidfd,
                                spawned_at + spec.timeout_s, spec.timeout_s,
                                lambda: _has_exited(pid), detachable=detachable,
                                spawned_at=spawned_at)
        except BaseException:
            # Our bug, not the child's: never leave the child behind.
            control.detach()
            _signal_group(pid, signal.SIGKILL)
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
        _signal_group(pid, signal.SIGKILL)
        control.detach()
        shim_status = proc.wait()
        status = shim.read_exit_file(exit_path)
        exit_code = status if status is not None else shim.exit_code_from_status(shim_status)

        if spec.record_dir is not None:
            summary, cost = collect_stdout(stdout_path, spec.log_path,
                                           spec.record_dir / shim.SUMMARY_FILE,
                                           recycle.spent_stdout_path(spec.record_dir))
        else:
            summary, cost = collect_stdout(stdout_path, spec.log_path)
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
        return result(outcome, exit_code=exit_code, error=error, summary=summary, cost=cost,
                      journaled=detachable and status is not None)

    def _write_record(self, spec: ExecutionSpec, pid: int, started_at: datetime,
                      input_path: Path, log_offset: int, *, in_place: bool = False) -> bool:
        """Write ``record.json`` for the shim ``pid``; False when it could not be written."""
        from kandevd.runtime.records import ExecutionRecord, write_record

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
            log_offset=log_offset, stdout_path=spec.record_dir / shim.STDOUT_FILE,
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
        from kandevd.runtime import records

        def result(outcome: str, exit_code: int | None = None, error: str | None = None,
                   summary: str | None = None, cost: float | None = None) -> ExecutionResult:
            return ExecutionResult(
                key=spec.key, outcome=outcome, exit_code=exit_code, summary=summary,
                cost_cents=cost, error=error, started_at=record.started_at,
                ended_at=max(utc_now(), record.started_at), log_path=record.log_path,
            )

        pid = record.pid
        waited = _Wait()
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
        sink = _LogSink.open_or_disabled(record.log_path)
        try:
            # Checked after the pidfd is open, so the pidfd is the shim's own.
            alive = alive and records.record_alive(record)
            if alive:
                control.attach(pid)
                remaining = (record.deadline - utc_now()).total_seconds()
                log.info("execution %s adopted: shim pid %d, %.1fs left before its timeout",
                         spec.key, pid, max(remaining, 0.0))
                try:
                    waited = self._wait(
                        spec.key, control, sink, pid, pidfd, time.monotonic() + remaining,
                        record.timeout_s,
                        lambda: not shim.process_running(pid, record.pid_start),
                        detachable=True)
                finally:
                    control.detach()
                if waited.detached:
                    log.info("execution %s detached again: shim pid %d keeps running",
                             spec.key, pid)
                    return result(DETACHED, error=DETACHED_ERROR)
                # Stragglers of the group, unless the group is gone and its id reused.
                if shim.group_may_be_signalled(pid, record.pid_start):
                    _signal_group(pid, signal.SIGKILL)
        finally:
            sink.close()
            if pidfd is not None:
                os.close(pidfd)

        status = shim.read_exit_status(record.record_dir)
        if waited.ended_by is not None:
            outcome, reason = waited.ended_by
            exit_code = status if status is not None else (
                -signal.SIGKILL if waited.killed else None)
            summary, cost = records.collect_output(record)
            log.warning("execution %s ended: %s (exit %s)", spec.key, outcome, exit_code)
            return result(outcome, exit_code=exit_code, summary=summary, cost=cost,
                          error=_termination_text(outcome, reason, record.timeout_s))
        if status is None:
            log.warning("execution %s: %s", spec.key, records.NO_EXIT_STATUS)
            summary, cost = records.collect_output(record)  # its output belongs in the log
            return result(ERROR, error=records.NO_EXIT_STATUS, summary=summary, cost=cost)
        ended = records.result_for_exit(record, status)
        log.info("execution %s ended: %s (exit %s)", spec.key, ended.outcome, status)
        return ExecutionResult(
            key=spec.key, outcome=ended.outcome, exit_code=ended.exit_code,
            summary=ended.summary, cost_cents=ended.cost_cents, error=ended.error,
            started_at=ended.started_at, ended_at=ended.ended_at, log_path=ended.log_path)

    # -- waiting ----------------------------------------------------------------

    def _wait(self, key: str, control: ExecutionControl, sink: _LogSink, pid: int,
              pidfd: int | None, deadline: float, timeout_s: float,
              exited: Callable[[], bool], *, detachable: bool,
              spawned_at: float | None = None) -> _Wait:
        """Wait until the shim ``pid`` exits or the wait is detached; enforce deadlines.

        ``pidfd`` (readable once the shim exited) is waited on with select;
        only without one is ``exited()`` polled. ``spawned_at`` (monotonic) is
        when we spawned the shim: a termination soon after repeats its SIGTERM.
        An exit seen together with a termination request wins: the execution
        ended on its own (except for a forced exit, whose SIGKILL ended it).
        """
        waited = _Wait()
        kill_at: float | None = None
        repeat_at: list[float] = []  # when SIGTERM goes to the group again
        sel = selectors.DefaultSelector()
        try:
            sel.register(control.wake_fd, selectors.EVENT_READ, "wake")
            if pidfd is not None:
                sel.register(pidfd, selectors.EVENT_READ, "exit")

            def begin_termination(outcome: str, reason: str) -> None:
                nonlocal kill_at
                waited.ended_by = (outcome, reason)
                kill_at = time.monotonic() + self.kill_grace_s
                text = _termination_text(outcome, reason, timeout_s)
                log.warning("execution %s %s: SIGTERM to process group %d", key, text, pid)
                sink.note(f"{text}: sending SIGTERM to process group {pid}")
                _signal_group(pid, signal.SIGTERM)
                # A stopped process would keep SIGTERM pending until the SIGKILL.
                _signal_group(pid, signal.SIGCONT)
                now = time.monotonic()
                if spawned_at is not None and now - spawned_at < _EARLY_TERM_S:
                    # The agent's subshell may have swallowed it (module docstring).
                    repeat_at[:] = [now + delay for delay in _TERM_REPEATS_S]

            while True:
                now = time.monotonic()
                if repeat_at and now >= repeat_at[0] and not waited.killed:
                    del repeat_at[0]
                    _signal_group(pid, signal.SIGTERM)
                if waited.ended_by is None and now >= deadline:
                    begin_termination(TIMED_OUT, "")
                elif kill_at is not None and not waited.killed and now >= kill_at:
                    waited.killed = True
                    log.warning("execution %s ignored SIGTERM for %.1fs: SIGKILL",
                                key, self.kill_grace_s)
                    sink.note(f"still running {self.kill_grace_s}s after SIGTERM: sending SIGKILL")
                    _signal_group(pid, signal.SIGKILL)
                if pidfd is None and exited():
                    return waited
                if waited.ended_by is None:
                    wait: float | None = deadline - now
                elif not waited.killed:
                    wait = (kill_at or now) - now
                else:
                    wait = None
                if repeat_at and not waited.killed:
                    wait = repeat_at[0] - now if wait is None else min(wait, repeat_at[0] - now)
                if pidfd is None:  # no pidfd: the only place we must poll for exit
                    wait = _POLL_S if wait is None else min(wait, _POLL_S)
                if wait is not None:
                    wait = min(max(wait, 0.0), _MAX_WAIT_S)
                events = {ready.data for ready, _mask in sel.select(wait)}
                if "wake" in events:
                    control.drain_wake()
                    request = control.requested
                    if waited.ended_by is None and request is not None and "exit" in events:
                        # Requested as the shim exited: it ended on its own and its
                        # status counts; unless a forced exit's SIGKILL ended it.
                        if control.kill_requested:
                            waited.ended_by = request
                            waited.killed = True
                    elif waited.ended_by is None and request is not None:
                        begin_termination(*request)
                    elif (waited.ended_by is None and detachable and "exit" not in events
                          and control.detach_requested):
                        waited.detached = True
                        return waited
                if "exit" in events:
                    return waited
        finally:
            sel.close()


def _executable_problem(name: str, cwd: Path, path_env: str | None) -> str | None:
    """Why ``name`` cannot be executed (the error text), or None when it can.

    Looked up like ``execvp`` in the child would: a name with a ``/`` is a
    path (relative to the child's ``cwd``), any other is searched in its PATH.
    """
    if "/" in name:
        candidate = Path(name) if os.path.isabs(name) else cwd / name
        if not os.path.exists(candidate):
            return f"cannot start agent: executable not found: {name}"
        if os.path.isdir(candidate) or not os.access(candidate, os.X_OK):
            return f"cannot start agent: permission denied: {name}"
        return None
    search = path_env if path_env is not None else os.defpath
    if name and shutil.which(name, path=search) is not None:
        return None
    if name:  # like execvp: a match that is not executable is "permission denied"
        for directory in search.split(os.pathsep):
            if os.path.exists(os.path.join(directory or ".", name)):
                return f"cannot start agent: permission denied: {name}"
    return f"cannot start agent: executable not found: {name}"


def _open_pidfd(pid: int) -> int | None:
    """A pidfd (readable on exit) when the kernel has them, else None."""
    opener = getattr(os, "pidfd_open", None)
    if opener is None:
        return None
    try:
        return opener(pid)
    except OSError:
        return None


def _has_exited(pid: int) -> bool:
    """True once the child has exited, without reaping it (WNOWAIT)."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return info is not None


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


class InProcessRunner:
    """Runs ``fn(spec) -> (exit_code, summary, cost_cents)`` in the worker thread.

    No child process and no log file: this exists so benchmarks and tests can
    measure the runtime and the queue without paying for process start-up.
    ``fn`` cannot be interrupted; a termination requested before it starts
    means it never starts. Detach requests are ignored (there is nothing to
    leave running) and nothing can be adopted.
    """

    def __init__(self, fn: Callable[[ExecutionSpec], tuple[int, str | None, float | None]]):
        self._fn = fn

    def run(self, spec: ExecutionSpec, control: ExecutionControl) -> ExecutionResult:
        """Call ``fn`` and turn its answer (or its exception) into a result."""
        started_at = utc_now()
        outcome: str
        exit_code: int | None = None
        summary: str | None = None
        cost: float | None = None
        error: str | None = None
        request = control.requested
        if request is not None:
            outcome = request[0]
            error = termination_error(request[0], request[1], spec)
        else:
            try:
                exit_code, summary, cost = self._fn(spec)
            except Exception as exc:  # the function's failure is the execution's failure
                log.exception("in-process execution %s raised", spec.key)
                outcome, error = ERROR, f"in-process agent raised {type(exc).__name__}: {exc}"
            else:
                outcome = SUCCEEDED if exit_code == 0 else FAILED
                error = None if exit_code == 0 else f"exit code {exit_code}"
        return ExecutionResult(
            key=spec.key, outcome=outcome, exit_code=exit_code, summary=summary,
            cost_cents=cost, error=error, started_at=started_at, ended_at=utc_now(),
            log_path=spec.log_path,
        )

    def adopt(self, spec: ExecutionSpec, control: ExecutionControl,
              record: ExecutionRecord) -> ExecutionResult:
        """In-process executions never outlive the daemon: nothing to adopt."""
        raise NotImplementedError("an in-process runner cannot adopt a process")
