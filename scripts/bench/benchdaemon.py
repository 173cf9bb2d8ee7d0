"""The real ``kandevd serve`` on a temp home, for the benchmarks of this folder.

Started as a subprocess with a JSON (= YAML) config, ready once it answers on
its socket; stopped with SIGINT (the graceful stop). Also reads the process's
CPU ticks and RSS from /proc.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kandevd.control.client import Client, DaemonUnavailable

KANDEVD = [sys.executable, "-m", "kandevd"]

# Runs kandevd from the checkout named by argv[1]. PYTHONPATH alone is not enough: the
# editable install's import hook finds this repository's kandevd before sys.path does.
_FROM_CHECKOUT = (
    "import runpy, sys\n"
    "sys.meta_path[:] = [f for f in sys.meta_path\n"
    "                    if 'Editable' not in getattr(f, '__name__', '')]\n"
    "sys.path.insert(0, sys.argv.pop(1))\n"
    "runpy.run_module('kandevd', run_name='__main__', alter_sys=True)\n")


def checkout_command(checkout: Path) -> list[str]:
    """The command that runs kandevd from another checkout (an earlier version, say)."""
    return [sys.executable, "-c", _FROM_CHECKOUT, str(Path(checkout).resolve())]


class Daemon:
    """``command`` runs kandevd (default: this interpreter's); ``env`` adds to its environment."""

    def __init__(self, home: Path, config: dict[str, Any], *, command: list[str] | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.home = home
        self.home.parent.mkdir(parents=True, exist_ok=True)
        self.config = home.parent / f"{home.name}.yaml"
        self.config.write_text(json.dumps(config))
        self.command = command or KANDEVD
        self.env = {**os.environ, **env} if env else None
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Daemon:
        self.err = open(self.home.parent / f"{self.home.name}.stderr", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen([*self.command, "serve", "--home", str(self.home),
                                      "--config", str(self.config)],
                                     stdout=subprocess.DEVNULL, stderr=self.err,
                                     start_new_session=True, env=self.env)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                self.call("daemon.status")
                return self
            except (DaemonUnavailable, OSError):
                time.sleep(0.05)
        raise SystemExit(f"the daemon did not start; see {self.err.name}")

    def client(self) -> Client:
        return Client(self.home / "kandevd.sock")

    def call(self, method: str, params: dict[str, Any] | None = None) -> Any:
        client = self.client()
        try:
            return client.call(method, params or {})
        finally:
            client.close()

    def stop(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(2)
        self.proc.wait(120)
        self.err.close()

    def cpu_ticks(self) -> int:
        assert self.proc is not None
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])

    def rss_mib(self) -> float:
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")


#: The drain benchmarks' daemon: 4 slots, no Office, ``/bin/true`` agents.
DRAIN_CONFIG: dict[str, Any] = {
    "runtime": {"max_concurrent": 4, "stop_grace_s": 2}, "office": {"enabled": False},
    "agents": {"default": {"command": ["/bin/true"], "timeout_s": 60}}}


def bench_agents(daemon: Daemon, count: int = 100) -> tuple[str, list[str]]:
    """A workspace ``bench`` with ``count`` agents: (its id, theirs)."""
    ws = daemon.call("workspaces.create", {"name": "bench"})["id"]
    return ws, [daemon.call("agents.create", {"workspace_id": ws, "name": f"a{i}"})["id"]
                for i in range(count)]


def enqueue_and_drain(client: Client, ws: str, agents: list[str], runs: int, *,
                      one_by_one: bool = False) -> float:
    """Queue ``runs`` runs over the agents (``runs.enqueue_many``, 500 a call; with
    ``one_by_one``, one ``runs.enqueue`` at a time, as the black-box benchmarks do, so
    the intake competes with the drain) and wait until none is queued or claimed; the
    seconds it took."""
    started = time.perf_counter()
    if one_by_one:
        for i in range(runs):
            client.call("runs.enqueue", {"workspace_id": ws, "agent_id": agents[i % len(agents)],
                                         "reason": f"r{i}"})
    for k in range(0, runs if not one_by_one else 0, 500):
        client.call("runs.enqueue_many", {"runs": [
            {"workspace_id": ws, "agent_id": agents[i % len(agents)], "reason": f"r{i}"}
            for i in range(k, min(runs, k + 500))]})
    while (client.call("runs.list", {"status": "queued", "limit": 1})["total"]
           + client.call("runs.list", {"status": "claimed", "limit": 1})["total"]):
        time.sleep(0.02)
    return time.perf_counter() - started
