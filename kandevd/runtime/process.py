"""One agent execution: a child process in its own process group, its log, its end.

This module knows nothing about slots or pools (that is ``runtime.py``); it
runs exactly one execution to completion in the calling thread and always
returns an :class:`ExecutionResult`, never raises for anything the child or
the file system does.

Life of one :meth:`ProcessRunner.run`::

    prepare (cwd, log file, stdin JSON and its copy              --fail-->  outcome "error"
             <log>.input.json, named by $KANDEVD_INPUT)                         (no child)
        |
    spawn (own session = own process group)  --fail-->  outcome "error"
        |
    pump: one selector over stdout (copied into the log), stdin (written
          without blocking), the control's wake pipe, and a pidfd for the
          child's exit.  Nothing sleeps; every wait is a select() with the
          next deadline as its timeout.
        |   timeout / stop request:  SIGTERM to the group, kill grace, SIGKILL
        |
    leader exited -> drain what stdout still holds -> SIGKILL stragglers left
    in the group -> reap -> ExecutionResult

Outcomes: ``succeeded`` (exit 0), ``failed`` (any other exit), ``timed_out``,
``stopped`` (someone stopped this execution), ``interrupted`` (the runtime is
shutting down), ``error`` (it could not even start).
"""

from __future__ import annotations

import json
import logging
import math
import os
import selectors
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from kandevd.timeutil import utc_now

log = logging.getLogger("kandevd.runtime.process")

SUCCEEDED = "succeeded"
FAILED = "failed"
TIMED_OUT = "timed_out"
STOPPED = "stopped"
INTERRUPTED = "interrupted"
ERROR = "error"

OUTCOMES = frozenset({SUCCEEDED, FAILED, TIMED_OUT, STOPPED, INTERRUPTED, ERROR})
#: Outcomes a caller may ask for through :meth:`ExecutionControl.request_termination`.
TERMINATION_OUTCOMES = frozenset({TIMED_OUT, STOPPED, INTERRUPTED})
KINDS = frozenset({"run", "launch", "turn"})

DEFAULT_KILL_GRACE_S = 5.0
_READ_CHUNK = 64 * 1024
# The last stdout line is only remembered up to this size: a summary line is
# small, and an agent printing megabytes without a newline must not grow memory.
_MAX_TRACKED_LINE = 1024 * 1024
_LOG_PREFIX = "[kandevd] "


@dataclass(frozen=True)
class ExecutionSpec:
    """Everything needed to run one agent execution, decided before it starts.

    ``argv`` is an argument vector, never a shell string: an agent's prompt or
    payload must not be able to inject commands. Lists are accepted and
    stored as tuples; string paths are stored as :class:`Path`.
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
        if not self.timeout_s > 0:  # also rejects NaN
            raise ValueError(f"ExecutionSpec.timeout_s must be > 0, not {self.timeout_s!r}")


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
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._request: tuple[str, str] | None = None
        self._requested = threading.Event()
        self._kill_now = False
        self._pgid: int | None = None
        self._closed = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    @property
    def wake_fd(self) -> int:
        """Readable whenever a termination was requested (for selectors)."""
        return self._wake_r

    @property
    def requested(self) -> tuple[str, str] | None:
        """``(outcome, reason)`` of the first termination request, or None."""
        with self._lock:
            return self._request

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
            try:
                os.write(self._wake_w, b"\0")
            except BlockingIOError:  # pipe full: the runner is already awake
                pass
            return True

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
        """Forget the process group (before reaping the leader)."""
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


def termination_error(outcome: str, reason: str, spec: ExecutionSpec) -> str:
    """The human readable ``error`` text for an execution ended on request."""
    if outcome == TIMED_OUT:
        return f"timed out after {float(spec.timeout_s)}s"
    return f"{outcome}: {reason}" if reason else outcome


def parse_summary_line(line: str | None) -> tuple[str | None, float | None]:
    """``(summary, cost_cents)`` from the agent's last stdout line (contract 5)."""
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


def make_private_dirs(path: Path) -> None:
    """Create ``path`` and any missing parents with mode 0o700.

    ``Path.mkdir(parents=True, mode=...)`` applies the mode only to the last
    component; run folders can hold prompts and secrets, so every directory we
    create is private. Existing directories are left as they are.
    """
    missing: list[Path] = []
    current = path
    while not current.exists():
        missing.append(current)
        if current.parent == current:
            break
        current = current.parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:
            pass
    if not path.is_dir():
        raise NotADirectoryError(f"not a directory: {path}")


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


class _LastLine:
    """Remembers the last non-empty line of a byte stream fed in chunks."""

    def __init__(self) -> None:
        self._partial = bytearray()
        self._overflow = False
        self.last: bytes | None = None

    def feed(self, chunk: bytes) -> None:
        lines = chunk.split(b"\n")
        for complete in lines[:-1]:
            self._partial += complete
            self._end_line()
        self._append(lines[-1])

    def finish(self) -> str | None:
        self._end_line()
        return self.last.decode("utf-8", errors="replace") if self.last is not None else None

    def _append(self, piece: bytes) -> None:
        if self._overflow:
            return
        self._partial += piece
        if len(self._partial) > _MAX_TRACKED_LINE:
            self._partial.clear()
            self._overflow = True

    def _end_line(self) -> None:
        if self._overflow:
            self.last = b"<line too long>"
        elif self._partial.strip():
            self.last = bytes(self._partial.strip())
        self._partial.clear()
        self._overflow = False


class _LogSink:
    """The execution's log file, written by us (stdout copy, our own notes)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC
        self.fd = os.open(path, flags, 0o600)
        self._broken = False

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
            log.error("cannot write log %s (%s); dropping further output", self.path, exc)

    def note(self, text: str) -> None:
        self.write(f"{_LOG_PREFIX}{text}\n".encode())

    def close(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


class ProcessRunner:
    """The default runner: the agent command as a child process (contract 5)."""

    def __init__(self, kill_grace_s: float = DEFAULT_KILL_GRACE_S) -> None:
        if kill_grace_s < 0:
            raise ValueError("kill_grace_s must be >= 0")
        self.kill_grace_s = kill_grace_s

    def run(self, spec: ExecutionSpec, control: ExecutionControl) -> ExecutionResult:
        """Run the child to its end; see the module docstring for the steps."""
        started_at = utc_now()

        def result(outcome: str, exit_code: int | None = None, error: str | None = None,
                   summary: str | None = None, cost: float | None = None) -> ExecutionResult:
            return ExecutionResult(
                key=spec.key, outcome=outcome, exit_code=exit_code, summary=summary,
                cost_cents=cost, error=error, started_at=started_at, ended_at=utc_now(),
                log_path=spec.log_path,
            )

        try:
            make_private_dirs(spec.log_path.parent)
            sink = _LogSink(spec.log_path)
        except OSError as exc:
            message = f"cannot open log file {spec.log_path}: {exc}"
            log.error("execution %s: %s", spec.key, message)
            return result(ERROR, error=message)
        try:
            return self._run_with_log(spec, control, sink, result)
        finally:
            sink.close()

    def _run_with_log(self, spec: ExecutionSpec, control: ExecutionControl, sink: _LogSink,
                      result: Callable[..., ExecutionResult]) -> ExecutionResult:
        def fail_to_start(message: str) -> ExecutionResult:
            log.error("execution %s: %s", spec.key, message)
            sink.note(message)
            return result(ERROR, error=message)

        try:
            make_private_dirs(spec.cwd)
        except OSError as exc:
            return fail_to_start(f"cannot create working directory {spec.cwd}: {exc}")
        try:
            stdin_bytes = (json.dumps(dict(spec.stdin)) + "\n").encode()
        except (TypeError, ValueError) as exc:
            return fail_to_start(f"stdin object is not JSON serializable: {exc}")

        input_path = spec.log_path.with_name(spec.log_path.stem + ".input.json")
        try:  # the same JSON as stdin, complete on disk before the agent starts
            fd = os.open(input_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as handle:
                handle.write(stdin_bytes)
        except OSError as exc:
            return fail_to_start(f"cannot write agent input {input_path}: {exc}")

        request = control.requested
        if request is not None:  # stopped before it even started: start nothing
            outcome, reason = request
            sink.note(f"not started: {termination_error(outcome, reason, spec)}")
            return result(outcome, error=termination_error(outcome, reason, spec))

        env = dict(os.environ)
        env.update(spec.env)
        env["KANDEVD_RUN_ID"] = spec.run_id
        env["KANDEVD_SESSION_ID"] = spec.session_id
        env["KANDEVD_HOME"] = spec.home
        env["KANDEVD_INPUT"] = str(input_path)
        try:
            proc = subprocess.Popen(
                list(spec.argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=sink.fd, cwd=spec.cwd, env=env, start_new_session=True,
                close_fds=True, shell=False,
            )
        except FileNotFoundError as exc:
            missing = exc.filename if exc.filename is not None else spec.argv[0]
            return fail_to_start(f"cannot start agent: executable not found: {missing}")
        except PermissionError as exc:
            target = exc.filename if exc.filename is not None else spec.argv[0]
            return fail_to_start(f"cannot start agent: permission denied: {target}")
        except (OSError, ValueError, TypeError) as exc:
            return fail_to_start(f"cannot start agent {spec.argv[0]}: {exc}")

        control.attach(proc.pid)
        log.debug("execution %s started: pid %d, %s", spec.key, proc.pid, spec.argv[0])
        try:
            ended_by, last_line = self._pump(spec, control, sink, proc, stdin_bytes)
        except BaseException:
            # Our bug, not the child's: never leave the child behind.
            control.detach()
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
            _close_pipes(proc)
            raise
        control.detach()
        exit_code = proc.wait()  # reap; the leader has exited already
        _close_pipes(proc)

        summary, cost = parse_summary_line(last_line)
        if ended_by is not None:
            outcome, reason = ended_by
            error = termination_error(outcome, reason, spec)
        elif exit_code == 0:
            outcome, error = SUCCEEDED, None
        else:
            outcome = FAILED
            error = (f"exit code {exit_code}" if exit_code > 0
                     else f"killed by signal {_signal_name(-exit_code)}")
        level = logging.INFO if outcome in (SUCCEEDED, FAILED) else logging.WARNING
        log.log(level, "execution %s ended: %s (exit %s)", spec.key, outcome, exit_code)
        return result(outcome, exit_code=exit_code, error=error, summary=summary, cost=cost)

    def _pump(self, spec: ExecutionSpec, control: ExecutionControl, sink: _LogSink,
              proc: subprocess.Popen[bytes], stdin_bytes: bytes,
              ) -> tuple[tuple[str, str] | None, str | None]:
        """Copy output and feed stdin until the leader exits; enforce deadlines.

        Returns the termination that ended it (None when it ended on its own)
        and the last non-empty stdout line.
        """
        assert proc.stdin is not None and proc.stdout is not None
        pid = proc.pid
        out_fd = proc.stdout.fileno()
        in_fd = proc.stdin.fileno()
        os.set_blocking(in_fd, False)
        pending = memoryview(stdin_bytes)
        last = _LastLine()
        ended_by: tuple[str, str] | None = None
        kill_at: float | None = None
        killed = False
        deadline = time.monotonic() + spec.timeout_s

        pidfd = _open_pidfd(pid)
        sel = selectors.DefaultSelector()
        try:
            sel.register(out_fd, selectors.EVENT_READ, "out")
            sel.register(in_fd, selectors.EVENT_WRITE, "in")
            sel.register(control.wake_fd, selectors.EVENT_READ, "wake")
            if pidfd is not None:
                sel.register(pidfd, selectors.EVENT_READ, "exit")
            out_open = True

            def begin_termination(outcome: str, reason: str) -> None:
                nonlocal ended_by, kill_at
                ended_by = (outcome, reason)
                kill_at = time.monotonic() + self.kill_grace_s
                text = termination_error(outcome, reason, spec)
                log.warning("execution %s %s: SIGTERM to process group %d", spec.key, text, pid)
                sink.note(f"{text}: sending SIGTERM to process group {pid}")
                _signal_group(pid, signal.SIGTERM)

            while True:
                now = time.monotonic()
                if ended_by is None and now >= deadline:
                    begin_termination(TIMED_OUT, "")
                elif kill_at is not None and not killed and now >= kill_at:
                    killed = True
                    log.warning("execution %s ignored SIGTERM for %.1fs: SIGKILL",
                                spec.key, self.kill_grace_s)
                    sink.note(f"still running {self.kill_grace_s}s after SIGTERM: sending SIGKILL")
                    _signal_group(pid, signal.SIGKILL)
                if pidfd is None and _has_exited(pid):
                    break
                if ended_by is None:
                    wait = deadline - now
                elif not killed:
                    wait = (kill_at or now) - now
                else:
                    wait = None
                if pidfd is None:  # no pidfd: the only place we must poll for exit
                    wait = 0.05 if wait is None else min(wait, 0.05)
                events = sel.select(None if wait is None else max(wait, 0.0))
                exited = False
                for key, _mask in events:
                    if key.data == "out":
                        chunk = _read(out_fd)
                        if chunk:
                            sink.write(chunk)
                            last.feed(chunk)
                        elif chunk is not None:  # EOF
                            sel.unregister(out_fd)
                            out_open = False
                    elif key.data == "in":
                        pending = _write_some(in_fd, pending)
                        if not pending:
                            sel.unregister(in_fd)
                            proc.stdin.close()
                    elif key.data == "wake":
                        control.drain_wake()
                        request = control.requested
                        if request is not None and ended_by is None:
                            begin_termination(*request)
                    elif key.data == "exit":
                        exited = True
                if exited:
                    break

            # The leader is a zombie now (not reaped, so its pid cannot be
            # reused). What it wrote is already in the pipe: take it without
            # blocking, then make sure nothing of the group outlives it.
            if out_open:
                os.set_blocking(out_fd, False)
            while out_open:
                chunk = _read(out_fd)
                if not chunk:  # EOF, or nothing more written yet
                    break
                sink.write(chunk)
                last.feed(chunk)
            _signal_group(pid, signal.SIGKILL)
        finally:
            sel.close()
            if pidfd is not None:
                os.close(pidfd)
        return ended_by, last.finish()


def _read(fd: int) -> bytes | None:
    """One chunk from the pipe: b"" at EOF, None when nothing is there (spurious wake)."""
    try:
        return os.read(fd, _READ_CHUNK)
    except BlockingIOError:
        return None
    except OSError:
        return b""


def _write_some(fd: int, pending: memoryview) -> memoryview:
    """Write what the pipe takes; an agent that closed stdin gets no more."""
    try:
        written = os.write(fd, pending)
    except BlockingIOError:
        return pending
    except (BrokenPipeError, OSError):
        return pending[len(pending):]
    return pending[written:]


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


def _close_pipes(proc: subprocess.Popen[bytes]) -> None:
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            try:
                stream.close()
            except OSError:
                pass


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
    means it never starts.
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
