"""A forced exit works even when the daemon's log handler is blocked.

The daemon's stderr is a pipe nobody reads: once it is full, every log call
blocks (inside the logging module, holding its lock). A first SIGTERM then
cannot even log; the second must still end the process at once with exit 1.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
import yaml

from kandevd.control.client import Client
from tests.support.daemon import FAST_CONFIG

pytestmark = pytest.mark.integration

PIPE_FULL = 65536


def pending_bytes(fd: int) -> int:
    return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]


def test_a_second_signal_exits_although_stderr_is_blocked(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    (home / "kandevd.yaml").write_text(yaml.safe_dump(FAST_CONFIG))
    read_end, write_end = os.pipe()
    proc = subprocess.Popen([sys.executable, "-m", "kandevd", "serve", "--home", str(home),
                             "--log-level", "DEBUG"], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=write_end,
                            start_new_session=True)
    os.close(write_end)
    try:
        deadline = time.monotonic() + 30
        while not (home / "kandevd.sock").exists():
            assert time.monotonic() < deadline, "daemon did not start"
            assert proc.poll() is None
            time.sleep(0.02)
        client = Client(home / "kandevd.sock", timeout=5)
        client.call("workspaces.create", {"id": "ws", "name": "ws"})
        for i in range(8):
            client.call("agents.create", {"id": f"a{i}", "workspace_id": "ws", "name": f"a{i}"})
        sent = 0
        # Runs make the daemon log (claimed, ended, finished...) until the pipe is full
        # and its log calls block; a few more make sure they do.
        extra = 40
        while extra > 0:
            assert time.monotonic() < deadline + 60, pending_bytes(read_end)
            if pending_bytes(read_end) > PIPE_FULL - 4096:
                extra -= 1
            try:
                client.call("runs.enqueue", {"workspace_id": "ws", "agent_id": f"a{sent % 8}",
                                             "reason": f"r{sent}", "coalesce": False,
                                             "payload": json.loads('{"summary": "x"}')})
                sent += 1
            except Exception:  # too blocked to answer: the pipe is full
                break
            time.sleep(0.005)
        client.close()
        proc.send_signal(signal.SIGTERM)
        # The first signal is stuck behind the blocked log handler. Two signals that
        # arrive before its handler ran are one to Python: send again until one forces it.
        give_up = time.monotonic() + 15
        while proc.poll() is None and time.monotonic() < give_up:
            time.sleep(0.2)
            proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 1
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        os.close(read_end)
