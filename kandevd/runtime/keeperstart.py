"""Finding the home's keeper, or starting one: ``python -m kandevd.keeper HOME`` in a
session of its own, running the daemon's own kandevd, its log in
``<home>/logs/keeper.log``."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import time
from pathlib import Path

import kandevd
from kandevd.keeper import protocol
from kandevd.net import unixaddr

log = logging.getLogger("kandevd.runtime.keeper")

#: How long a new keeper may take to listen.
START_TIMEOUT_S = 20.0
_CONNECT_POLL_S = 0.02


class KeeperUnavailable(Exception):
    """No keeper could be reached or started (an execution cannot start now)."""


class KeeperLauncher:
    """Connects to the home's keeper, starting one when none listens."""

    def __init__(self, home: Path, python: str) -> None:
        self.home = home
        self.python = python
        #: The keeper this daemon started (None: it found one running).
        self.process: subprocess.Popen[bytes] | None = None

    def connect_or_start(self) -> socket.socket:
        path = protocol.socket_path(self.home)
        sock = try_connect(path)
        if sock is not None:
            return sock
        self._start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            sock = try_connect(path)
            if sock is not None:
                return sock
            if self.process is not None and self.process.poll() is not None:
                # (Another keeper won the lock meanwhile, or this one failed: try once more.)
                sock = try_connect(path)
                if sock is not None:
                    return sock
                raise KeeperUnavailable(f"the keeper exited at its start (status "
                                        f"{self.process.returncode}); see "
                                        f"{self.home / 'logs' / 'keeper.log'}")
            time.sleep(_CONNECT_POLL_S)
        raise KeeperUnavailable(f"no keeper listens on {path} after {START_TIMEOUT_S:g}s")

    def _start(self) -> None:
        logs = self.home / "logs"
        logs.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(logs / "keeper.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC,
                     0o600)
        try:
            if self.process is not None:
                self.process.poll()  # (a keeper that died: reaped)
            # The keeper runs the daemon's own kandevd (a checkout, an installed copy).
            source = str(Path(kandevd.__file__).resolve().parent.parent)
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(
                [source, *filter(None, [os.environ.get("PYTHONPATH")])])}
            self.process = subprocess.Popen(
                [self.python, "-m", "kandevd.keeper", str(self.home)],
                stdin=subprocess.DEVNULL, stdout=fd, stderr=fd, cwd="/", env=env,
                start_new_session=True, close_fds=True)
        finally:
            os.close(fd)
        log.info("keeper started (pid %d)", self.process.pid)


def try_connect(path: Path) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        with unixaddr.address(path) as where:
            sock.connect(where)
    except OSError:
        sock.close()
        return None
    return sock
