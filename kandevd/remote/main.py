"""``kandevd runner``: a runner's process from its command line to its exit code.

Its home is its own (mode 0700, locked like a daemon's: one process per home),
with its own config (its ``agents`` profiles, ``runtime.max_concurrent`` slots)
and its own keeper, so the agents run exactly as a daemon runs them.
"""

from __future__ import annotations

import logging
import os
import signal
import ssl
import stat
import threading
from collections.abc import Callable
from pathlib import Path

from kandevd import exits
from kandevd.app.homelock import HomeLock, HomeLocked
from kandevd.config import ConfigError, load_config
from kandevd.fsutil import ensure_dir, replace_atomically
from kandevd.paths import HomeLayout
from kandevd.remote.client import GatewayClient
from kandevd.remote.keeper import RunnerKeeperClient
from kandevd.remote.runner import RunnerProcess
from kandevd.runtime import AgentRuntime
from kandevd.runtime.keeperclient import KeeperUnavailable
from kandevd.runtime.keeperrunner import KeeperRunner
from kandevd.runtime.orphans import stop_orphan_agents

log = logging.getLogger("kandevd.runner")


class RunnerSetupError(Exception):
    """The runner cannot start as asked; ``code``: the exit code."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def read_token(path: Path) -> str:
    try:
        info = path.stat()
        token = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise RunnerSetupError(f"--token-file {path}: cannot be read: {exc}",
                               exits.NOINPUT) from None
    except UnicodeDecodeError:
        raise RunnerSetupError(f"--token-file {path}: is not a token (not UTF-8 text)",
                               exits.DATAERR) from None
    if not token:
        raise RunnerSetupError(f"--token-file {path}: is empty", exits.DATAERR)
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("%s: other users may read this runner's token (chmod 600 it)", path)
    return token


def gateway_client(server: str, token: str, ca_file: str | None) -> GatewayClient:
    """The client of ``server``; a ``--ca-file`` that cannot be read or holds no
    certificate is said as such (not as a problem with the runner's home)."""
    try:
        return GatewayClient(server, token, ca_file=ca_file)
    except ssl.SSLError as exc:
        raise RunnerSetupError(f"--ca-file {ca_file}: holds no usable PEM certificate: "
                               f"{exc}", exits.DATAERR) from None
    except OSError as exc:
        raise RunnerSetupError(f"--ca-file {ca_file}: cannot be read: {exc}",
                               exits.NOINPUT) from None


#: The runner home's id, made at its first start: the server lets one home at a time serve a
#: runner's name (two processes with one token would take each other's runs).
HOME_ID_FILE = "runner.id"


def home_id(root: Path) -> str:
    """``<home>/runner.id``: 32 hex digits, made once (a file that is not one is made anew)."""
    path = root / HOME_ID_FILE
    try:
        text = path.read_text(encoding="ascii", errors="replace").strip()
    except FileNotFoundError:
        text = ""
    if len(text) == 32 and all(c in "0123456789abcdef" for c in text):
        return text
    if text:
        log.warning("%s is not a runner home id; a new one is made", path)
    made = os.urandom(16).hex()
    replace_atomically(path, made + "\n", durable=True)
    return made


def run_runner(server: str, token_file: Path, home: Path, config_path: Path | None,
               ca_file: str | None = None) -> int:
    """Serve ``server``'s gateway until SIGINT/SIGTERM; the exit code."""
    try:
        token = read_token(token_file)
        client = gateway_client(server, token, ca_file)
        ensure_dir(home)
        config = load_config(config_path, home=home)
    except RunnerSetupError as exc:
        log.error("%s", exc)
        return exc.code
    except ValueError as exc:
        log.error("%s", exc)
        return exits.USAGE
    except ConfigError as exc:
        log.error("bad config: %s", exc)
        return exits.CONFIG
    except OSError as exc:
        log.error("%s: cannot be used as the runner's home: %s", home, exc)
        return exits.CANTCREAT
    layout = HomeLayout(home)
    try:
        for folder in (layout.run_logs, layout.runs, layout.attempts):
            ensure_dir(folder)
    except OSError as exc:
        log.error("%s: cannot be used as the runner's home: %s", home, exc)
        return exits.CANTCREAT
    lock = HomeLock(layout.lock)
    try:
        lock.acquire()
    except HomeLocked as exc:
        log.error("%s", exc)
        return exits.TEMPFAIL
    try:
        client.serve_as(home_id(layout.root))
    except OSError as exc:
        lock.release()
        log.error("%s: cannot be used as the runner's home: %s", home, exc)
        return exits.CANTCREAT
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set())
                for sig in (signal.SIGINT, signal.SIGTERM)}
    keepers: list[RunnerKeeperClient] = []

    def runtime_for(dead_after_s: float, on_slot_free: Callable[[], None]) -> AgentRuntime:
        """The runtime, once the server said its ``dead_after_s``: the keeper stops the
        agents by itself when this process is gone for half of it (KeeperUnavailable).
        An agent stopped gets SIGKILL at most a quarter of it after SIGTERM (5 s at
        most): one the fence stops is gone before the server takes the runner for
        silent."""
        keeper = RunnerKeeperClient(layout.root, stop_alone_after=dead_after_s / 2)
        keepers.append(keeper)
        keeper.connect()
        return AgentRuntime(config.runtime.max_concurrent, config.runtime.stop_grace_s,
                            runner=KeeperRunner(keeper, kill_grace_s=min(5.0, dead_after_s / 4)),
                            on_slot_free=on_slot_free, shutdown_reason="runner shutting down")

    def sweep(keep: frozenset[int]) -> None:
        """Agents a crash of this runner left and it did not take back: stopped (their
        runs are re-queued: the runner does not name them at its hello)."""
        stop_orphan_agents(layout.root, min(config.runtime.stop_grace_s, 10.0), keep=keep)

    def fence_keeper(until: float) -> None:
        """The keeper's own fence (kandevd.keeper.fences), renewed at each look."""
        if keepers:
            keepers[-1].fence(until)

    code = exits.CANTCREAT
    try:
        code = RunnerProcess(client, config, layout, runtime_for, stop=stop,
                             sweep=sweep, fence_keeper=fence_keeper).run()
        return code
    except (KeeperUnavailable, OSError) as exc:
        log.error("the keeper cannot be started: %s", exc)
        return code
    finally:
        for keeper in keepers:
            keeper.close(quit_keeper=True)
        client.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        lock.release()
        if code not in (exits.NOPERM, exits.TEMPFAIL):  # (a refusal is one line, said)
            log.info("runner stopped (pid %d)", os.getpid())
