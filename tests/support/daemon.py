"""A real ``kandevd serve`` subprocess on a temp home, for integration tests.

The harness waits on events the daemon itself reports (its log lines, read
from its real stderr by a reader thread), never on fixed sleeps.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from kandevd.control.client import Client, call

READY_LINE = "control socket listening on"

# Small, fast defaults for integration tests; a test overrides what it exercises.
FAST_CONFIG: dict[str, Any] = {
    "queue": {"safety_interval_s": 5},
    "runtime": {"max_concurrent": 4, "stop_grace_s": 5},
    "office": {"interval_s": 30},
}


def fast_config(**sections: dict[str, Any]) -> dict[str, Any]:
    """FAST_CONFIG with each of ``sections`` merged into its section."""
    merged = {name: dict(values) for name, values in FAST_CONFIG.items()}
    for name, values in sections.items():
        merged.setdefault(name, {}).update(values)
    return merged


class DaemonProcess:
    def __init__(self, home: Path, config: dict[str, Any] | None = None, *,
                 env: dict[str, str] | None = None, args: list[str] | None = None,
                 command: str = "serve", ready: str = READY_LINE) -> None:
        """``command``: ``serve``, or ``runner`` (a runner's process, ready at ``ready``)."""
        self.command = command
        self.ready = ready
        self.home = Path(home)
        self.home.mkdir(mode=0o700, parents=True, exist_ok=True)
        if config is not None:
            (self.home / "kandevd.yaml").write_text(yaml.safe_dump(config))
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.args = args or []
        self.proc: subprocess.Popen[str] | None = None
        #: Run in the child before exec (``as_ordinary_user()``: file modes bind it).
        self.preexec_fn: Callable[[], None] | None = None
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._reader: threading.Thread | None = None

    # -- process ----------------------------------------------------------------
    def start(self, *, wait_ready: bool = True, timeout: float = 30.0) -> DaemonProcess:
        self.lines = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kandevd", self.command, "--home", str(self.home),
             *self.args],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True, env=self.env, start_new_session=True, preexec_fn=self.preexec_fn,
        )
        self._reader = threading.Thread(target=self._read, args=(self.proc,), daemon=True)
        self._reader.start()
        if wait_ready:
            self.wait_for_line(self.ready, timeout=timeout)
        return self

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_for_line(self, text: str, *, timeout: float = 30.0, after: int = 0) -> str:
        """Block until a log line containing ``text`` appears (index >= ``after``)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self.lines[after:]:
                    if text in line:
                        return line
                if self.proc is not None and self.proc.poll() is not None and \
                        (self._reader is None or not self._reader.is_alive()):
                    raise AssertionError(f"daemon exited ({self.proc.returncode}) before "
                                         f"logging {text!r}:\n{self.log_text}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(f"timed out waiting for {text!r}:\n{self.log_text}")
                self._cond.wait(remaining)

    def count_lines(self, text: str) -> int:
        with self._cond:
            return sum(text in line for line in self.lines)

    def mark(self) -> int:
        with self._cond:
            return len(self.lines)

    @property
    def log_text(self) -> str:
        with self._cond:
            return "\n".join(self.lines)

    def send_signal(self, sig: int = signal.SIGINT) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 60.0) -> int:
        assert self.proc is not None
        code = self.proc.wait(timeout)
        if self._reader is not None:
            self._reader.join(timeout)
        return code

    def stop(self, sig: int = signal.SIGINT, timeout: float = 60.0) -> int:
        self.send_signal(sig)
        return self.wait(timeout)

    def agent_pids(self) -> list[int]:
        """Live agent executions of this home: their shims (KANDEVD_HOME in the environment).

        Each agent runs under a shim that leads its own session (its own process
        group), so killing the daemon's group does not reach them. Only session
        leaders are counted: one per execution, the agent itself being the
        shim's child in the same group.
        """
        marker = f"KANDEVD_HOME={self.home.resolve()}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                environ = (entry / "environ").read_bytes()
            except OSError:
                continue
            if marker in environ.split(b"\0"):
                try:
                    if os.getsid(int(entry.name)) != int(entry.name):
                        continue
                except ProcessLookupError:
                    continue
                found.append(int(entry.name))
        return sorted(found)

    def _kill_agents(self, timeout: float = 10.0) -> None:
        """SIGKILL every agent of this home and wait until none is left.

        Re-scans until a scan finds nothing: SIGKILL takes a moment to land,
        and a child forked just before the daemon died may exec only now.
        """
        deadline = time.monotonic() + timeout
        while pids := self.agent_pids():
            for pid in pids:
                try:
                    os.killpg(pid, signal.SIGKILL)  # an agent leads its own process group
                except (ProcessLookupError, PermissionError):
                    pass
            if time.monotonic() > deadline:
                raise AssertionError(f"agent processes {pids} survived SIGKILL")
            time.sleep(0.01)

    def keeper_pids(self) -> list[int]:
        """The home's keeper (``python -m kandevd.keeper HOME``), if one runs."""
        wanted = [b"-m", b"kandevd.keeper", str(self.home).encode()]
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
                state = (entry / "stat").read_bytes().rsplit(b")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if argv[1:4] == wanted and state != b"Z":
                found.append(int(entry.name))
        return found

    def kill_keeper(self, timeout: float = 10.0) -> list[int]:
        """SIGKILL the home's keeper; its pids (it is gone when this returns)."""
        pids = self.keeper_pids()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout
        while set(pids) & set(self.keeper_pids()):  # (a live daemon may start another)
            if time.monotonic() > deadline:
                raise AssertionError(f"keeper {pids} survived SIGKILL")
            time.sleep(0.01)
        return pids

    def kill9(self) -> None:
        """SIGKILL the daemon's process group, its keeper, then every agent left behind
        (the machine's crash, as far as this home goes)."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)  # dead first: it can start no new agent
        self.kill_keeper()
        self._kill_agents()
        self.wait()

    def kill_daemon_only(self) -> int:
        """SIGKILL the daemon process alone and reap it; its agents keep running."""
        assert self.proc is not None
        self.proc.kill()
        return self.wait()

    def cleanup(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(30)
        self.kill_keeper()
        self._kill_agents()

    # -- talking ----------------------------------------------------------------
    @property
    def socket(self) -> Path:
        return self.home / "kandevd.sock"

    def call(self, method: str, params: dict[str, Any] | None = None) -> Any:
        return call(self.socket, method, params or {})

    def client(self) -> Client:
        return Client(self.socket)

    def db(self) -> sqlite3.Connection:
        """A separate read connection to the daemon's database (WAL allows it)."""
        conn = sqlite3.connect(self.home / "kandevd.db", timeout=10)
        conn.row_factory = sqlite3.Row
        return conn

    def wait_until(self, predicate: Callable[[], Any], *, timeout: float = 30.0,
                   what: str = "condition") -> Any:
        """Re-check ``predicate`` each time the daemon logs a line (or every 50 ms)."""
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"timed out waiting for {what}:\n{self.log_text}")
            with self._cond:
                self._cond.wait(min(remaining, 0.05))


def run_cli(home: Path, *args: str, env: dict[str, str] | None = None,
            timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kandevd", *args, "--home", str(home)],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def cli_ok(home: Path, *args: str) -> str:
    """The stdout of ``kandevd ARGS``, which must exit 0."""
    result = run_cli(home, *args)
    assert result.returncode == 0, (args, result.stdout, result.stderr)
    return result.stdout


def cli_json(home: Path, *args: str) -> Any:
    """The output of ``kandevd ARGS --json`` (which must exit 0), parsed."""
    return json.loads(cli_ok(home, *args, "--json"))


def enqueue(daemon: DaemonProcess, agent: str = "a1", workspace: str = "ws",
            **payload: Any) -> dict[str, Any]:
    """A manual run of ``agent`` (never coalesced) with ``payload``, enqueued over the socket."""
    return daemon.call("runs.enqueue", {"workspace_id": workspace, "agent_id": agent,
                                        "reason": "manual", "payload": payload,
                                        "coalesce": False})["run"]


def wait_status(daemon: DaemonProcess, run_id: str, *wanted: str,
                timeout: float = 30.0) -> dict[str, Any]:
    """The run once its status is one of ``wanted``."""
    def check() -> dict[str, Any] | None:
        run = daemon.call("runs.get", {"id": run_id})
        return run if run["status"] in wanted else None

    return daemon.wait_until(check, timeout=timeout, what=f"run {run_id} {wanted}")


def seed_agents(daemon: DaemonProcess, workspace: str, agents: list[str], **agent_fields: Any
                ) -> None:
    """Create a workspace and agents directly in SQLite when no model methods exist yet."""
    with daemon.db() as conn:
        now = "2026-01-01T00:00:00.000000Z"
        conn.execute("INSERT INTO workspaces (id, name, office_workflow_id, created_at,"
                     " updated_at) VALUES (?, ?, '', ?, ?) ON CONFLICT DO NOTHING",
                     (workspace, workspace, now, now))
        for agent in agents:
            conn.execute("INSERT INTO agents (id, workspace_id, name, profile, cooldown_s, status,"
                         " created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                         (agent, workspace, agent, agent_fields.get("profile", "default"),
                          agent_fields.get("cooldown_s", 0), agent_fields.get("status", "active"),
                          now, now))


def dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def add_agents(daemon: DaemonProcess, workspaces: dict[str, list[str]], **fields: Any) -> None:
    for workspace, agents in workspaces.items():
        daemon.call("workspaces.create", {"id": workspace, "name": workspace})
        for agent in agents:
            daemon.call("agents.create", {"id": agent, "workspace_id": workspace, "name": agent,
                                          **fields})

COMPLETE = "Graceful shutdown complete"


STARTED = "Graceful shutdown started"


FORCED = "Received second shutdown signal, forcing exit"


#: an agent run that keeps the runtime's stop waiting (stop_grace_s) for a minute
BLOCKING_CONFIG: dict[str, Any] = {**FAST_CONFIG,
                                   "runtime": {"max_concurrent": 4, "stop_grace_s": 60}}


def assert_graceful(daemon: DaemonProcess, code: int) -> None:
    """Exit 0, the contract's first and last lines, and no use of a closed database."""
    assert code == 0, daemon.log_text
    lines = [line for line in daemon.lines if line.strip()]
    assert COMPLETE in lines[-1], daemon.log_text
    assert daemon.count_lines(STARTED) == 1 and daemon.count_lines(COMPLETE) == 1
    assert "database is closed" not in daemon.log_text
    assert "Traceback" not in daemon.log_text
    assert not daemon.socket.exists()  # the listener removed its socket file


def blocked_stop_daemon(make: Callable[..., DaemonProcess]) -> tuple[DaemonProcess, str]:
    """A daemon whose graceful stop cannot finish for 60 s: an agent run is executing.

    The echo agent sleeps 60 s and the runtime waits up to stop_grace_s = 60 s
    for it, so after the first signal the daemon stays in its shutdown.
    """
    daemon = make(BLOCKING_CONFIG)
    daemon.call("workspaces.create", {"id": "ws1", "name": "ws1"})
    daemon.call("agents.create", {"id": "sleeper", "workspace_id": "ws1", "name": "sleeper"})
    run = daemon.call("runs.enqueue", {"workspace_id": "ws1", "agent_id": "sleeper",
                                       "reason": "manual", "payload": {"sleep_s": 60}})["run"]
    daemon.wait_until(lambda: daemon.call("daemon.status")["runtime"]["active"] == 1
                      and daemon.call("runs.get", {"id": run["id"]})["status"] == "claimed",
                      what="the run claimed and executing")
    return daemon, run["id"]


def _drop_dac_override() -> None:
    """In the child, before exec: root without CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH is
    bound by file modes like any user (prctl PR_CAPBSET_DROP; uid 0 gets the bounding
    set at exec)."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def as_ordinary_user() -> Callable[[], None] | None:
    """What makes a mode bind the daemon: nothing for a non-root user; as root, dropping
    the override capabilities (skip when even that is not allowed)."""
    if os.geteuid() != 0:
        return None
    probe = subprocess.run(["true"], preexec_fn=_drop_dac_override, capture_output=True,
                           check=False) if Path("/bin/true").exists() else None
    if probe is None or probe.returncode != 0:
        pytest.skip("running as root and cannot drop CAP_DAC_OVERRIDE to make modes bind")
    return _drop_dac_override
