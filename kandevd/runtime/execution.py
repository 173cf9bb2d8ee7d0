"""One agent execution as the runtime speaks of it: its spec, its result, its control.

A runner (:class:`Runner`: :mod:`kandevd.runtime.process`, or the in-process
double of :mod:`kandevd.runtime.inprocess`) executes one spec in the calling
thread and always returns an :class:`ExecutionResult`; the pool
(:mod:`kandevd.runtime.pool`) decides when.

Outcomes: ``succeeded`` (exit 0), ``failed`` (any other exit), ``timed_out``,
``stopped`` (someone stopped this execution), ``interrupted`` (the runtime is
shutting down), ``error`` (it could not even start), ``detached`` (the runner
stopped waiting without touching the process, which keeps running for the
next daemon instance to adopt).
"""

from __future__ import annotations

import functools
import logging
import os
import select
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

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
    #: A queued run's attempt number (0: none). A runner that ``frames_logs`` opens
    #: and closes the attempt in its log itself (``==== attempt N started/ended``),
    #: with the log open anyway, instead of the queue opening it twice more.
    attempt: int = 0

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
        # (A Path is kept as it is: wrapping it again parses it again, on every run.)
        if not isinstance(self.cwd, Path):
            object.__setattr__(self, "cwd", Path(self.cwd))
        if not isinstance(self.log_path, Path):
            object.__setattr__(self, "log_path", Path(self.log_path))
        if self.record_dir is not None and not isinstance(self.record_dir, Path):
            object.__setattr__(self, "record_dir", Path(self.record_dir))
        if not self.timeout_s > 0:  # also rejects NaN
            raise ValueError(f"ExecutionSpec.timeout_s must be > 0, not {self.timeout_s!r}")

    @functools.cached_property
    def input_path(self) -> Path:
        """``<log stem>.input.json`` beside the log (a turn's ``NN-<kind>.input.json``): the
        stdin object on disk, named by ``$KANDEVD_INPUT``."""
        return input_path_of(self.log_path)


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
    #: The agent's optional ``evaluation`` object (its last stdout line, contract 5).
    evaluation: dict[str, Any] | None = None
    #: The keeper's name of the execution: the exit it keeps until the outcome is
    #: recorded (:meth:`kandevd.runtime.pool.AgentRuntime.settle`); None for others.
    execution_id: str | None = None
    #: The runner closed the attempt in its log (``spec.attempt``): nobody else does.
    framed: bool = False

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
        #: The SIGTERM-to-SIGKILL grace the request asks for (None: the runner's own).
        self.kill_grace_s: float | None = None
        #: A later, shorter deadline for the SIGKILL (monotonic), see :meth:`hasten_kill`.
        self.hasten_at: float | None = None
        self._requested = threading.Event()
        self._detach = False
        self._kill_now = False
        self._pgid: int | None = None
        self._pidfd: int | None = None
        self._closed = False
        #: Told of every request (see :meth:`listen`), outside the lock.
        self._listener: Callable[[], None] | None = None
        #: The self-pipe, made when first needed (most executions never wait on it).
        self._wake_r = self._wake_w = -1

    @property
    def wake_fd(self) -> int:
        """Readable whenever a termination or detach was requested (for selectors).

        Made on first use (OSError when no descriptor is left), or by the first wake-up,
        whichever comes first: a wake-up before anyone waits is not lost."""
        with self._lock:
            self._pipe()
            return self._wake_r

    def _pipe(self) -> None:
        if self._wake_r < 0 and not self._closed:
            read, write = os.pipe()
            os.set_blocking(read, False)
            os.set_blocking(write, False)
            self._wake_r, self._wake_w = read, write

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

    def request_termination(self, outcome: str, reason: str,
                            kill_grace_s: float | None = None) -> bool:
        """Ask the runner to end the execution with ``outcome`` (SIGKILL ``kill_grace_s``
        after the SIGTERM when given, else after the runner's own grace).

        Returns True when this call made the (first) request, False when one
        was already made or the execution is over.
        """
        if outcome not in TERMINATION_OUTCOMES:
            raise ValueError(f"not a termination outcome: {outcome!r}")
        with self._lock:
            if self._closed or self._request is not None:
                return False
            self._request = (outcome, reason)
            self.kill_grace_s = kill_grace_s
            self._requested.set()
            self._wake()
            listener = self._listener
        if listener is not None:
            listener()
        return True

    def hasten_kill(self, kill_grace_s: float) -> None:
        """An execution being terminated gets SIGKILL no later than ``kill_grace_s`` from
        now (a fence may not wait for the grace of an earlier stop)."""
        with self._lock:
            if self._closed:
                return
            self.kill_grace_s = kill_grace_s if self.kill_grace_s is None \
                else min(self.kill_grace_s, kill_grace_s)
            self.hasten_at = time.monotonic() + kill_grace_s
            self._wake()
            listener = self._listener
        if listener is not None:
            listener()

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
            listener = self._listener
        if listener is not None:
            listener()
        return True

    def notify(self) -> None:
        """Wake the runner waiting on :attr:`wake_fd` (something it waits for happened)."""
        with self._lock:
            if not self._closed:
                self._wake()

    def listen(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` after each termination, kill-hastening or detach request
        (for an execution no thread waits for: its runner hands it to one then)."""
        with self._lock:
            self._listener = listener

    def _wake(self) -> None:
        try:
            self._pipe()
            os.write(self._wake_w, b"\0")
        except BlockingIOError:  # pipe full: the runner is already awake
            pass
        except OSError:  # no pipe could be made: nobody waits on one (wake_fd fails too)
            pass

    def kill_now(self) -> None:
        """SIGKILL the process group at once (forced exit); no grace, no waiting."""
        with self._lock:
            self._kill_now = True
            pgid, pidfd = self._pgid, self._pidfd
        if pgid is not None:
            _kill_group(pgid, pidfd)

    def attach(self, pgid: int, pidfd: int | None = None) -> None:
        """Record the live process group; called by the runner right after spawn.

        The runner must :meth:`detach` before it reaps the leader, so a pid the
        kernel hands out again is never signalled by mistake; or it passes the
        leader's ``pidfd`` (held until it detaches), which tells whether the group
        is still the leader's when someone else reaps it (the keeper).
        """
        with self._lock:
            self._pgid, self._pidfd = pgid, pidfd
            kill = self._kill_now
        if kill:
            _kill_group(pgid, pidfd)

    def detach(self) -> None:
        """Forget the process group (before reaping the leader, or when leaving it)."""
        with self._lock:
            self._pgid = None
            self._pidfd = None

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
            self._listener = None
            fds, self._wake_r, self._wake_w = (self._wake_r, self._wake_w), -1, -1
        for fd in fds:
            if fd < 0:
                continue
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


def input_path_of(log_path: Path) -> Path:
    """Where the input of the execution logged at ``log_path`` is kept (beside its log)."""
    return log_path.with_name(log_path.stem + ".input.json")


def termination_error(outcome: str, reason: str, spec: ExecutionSpec) -> str:
    """The human readable ``error`` text for an execution ended on request."""
    return termination_text(outcome, reason, spec.timeout_s)


def termination_text(outcome: str, reason: str, timeout_s: float) -> str:
    if outcome == TIMED_OUT:
        return f"timed out after {float(timeout_s)}s"
    return f"{outcome}: {reason}" if reason else outcome


def describe_exit(exit_code: int) -> str:
    """``exit code N`` or ``killed by signal SIGX`` (for a negative code)."""
    if exit_code >= 0:
        return f"exit code {exit_code}"
    return f"killed by signal {_signal_name(-exit_code)}"


#: The signals a stop sends (SIGTERM from systemd or kill, SIGINT from a terminal's
#: Ctrl-C, SIGHUP when the terminal closes, SIGKILL at last).
STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGKILL})


def ended_by_stop_signal(exit_code: int | None) -> bool:
    """Did a stop signal end the agent: killed by one, or exiting ``128 + N`` for one?

    The second form is how an agent that handles SIGTERM (a shell's trap, a Python
    handler) conventionally reports it, so both count alike.
    """
    if exit_code is None:
        return False
    number = -exit_code if exit_code < 0 else exit_code - 128
    return number in STOP_SIGNALS


def signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to a process group; False when the group is already gone."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        log.warning("not permitted to signal process group %d with %s", pgid, sig)
        return False
    return True



def _kill_group(pgid: int, pidfd: int | None) -> None:
    """SIGKILL the group of leader ``pgid``; with its pidfd, only while the leader has not
    ended (after that its pid, and so the group's id, may be someone else's)."""
    if pidfd is not None:
        try:
            if select.select([pidfd], [], [], 0)[0]:
                return  # ended: its keeper kills what is left of its group
        except (OSError, ValueError):
            return
    signal_group(pgid, signal.SIGKILL)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)

