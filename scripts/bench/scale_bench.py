"""The run path with a big database: the real daemon, its socket, /bin/true agents.

Run from the repository root (the bench extra is not needed)::

    .venv/bin/python scripts/bench/scale_bench.py                 # one round
    .venv/bin/python scripts/bench/scale_bench.py --repeat 3

Each round builds two homes in a temp directory, both with 1,000 agents
(``runtime.max_concurrent`` 4, agents that run ``/bin/true``):

* ``small``: only the queued runs (``--queued``, default 10,000);
* ``big``: the same queued runs plus ``--terminal`` (default 100,000)
  finished, failed and cancelled runs with costs, keys and reasons, written
  straight into the database before the daemon starts (the schema comes
  from a first start of the daemon itself).

Agents start paused, so the daemon is idle with its backlog: the round
measures, on each home, the first page of ``runs.list`` for every filter
(median of 15 calls over the socket), the wake latency of a free agent
(``requested_at`` to ``claimed_at`` of 50 runs, each enqueued when the
previous one has finished), the daemon's RSS and its CPU ticks while idle
(``--idle-s``, default 10). Then every agent is resumed and the drain rate
is taken over ``--window`` (default 1,000) finished runs; on ``big`` a
second window runs while another client pages through 10,000 runs of
``runs.list`` (500 a page) once. Printed last: the ratios the
targets are stated in (big/small drain, drain with/without the lister).
"""

from __future__ import annotations

import argparse
import os
import random
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from benchdaemon import Daemon  # this folder (the script's own) is on sys.path

from kandevd.control.client import Client, RpcCallError

AGENTS = 1000
CONFIG = {"runtime": {"max_concurrent": 4, "stop_grace_s": 2},
          "agents": {"default": {"command": ["/bin/true"], "timeout_s": 60}}}


def stamp(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def build_home(root: Path, name: str, *, queued: int, terminal: int) -> Daemon:
    """A home with 1,000 paused agents and the runs written straight into its database."""
    daemon = Daemon(root / name, CONFIG).start()
    client = daemon.client()
    client.call("workspaces.create", {"id": "ws1", "name": "ws1"})
    for index in range(AGENTS):
        client.call("agents.create", {"id": f"a{index:04d}", "workspace_id": "ws1",
                                      "name": f"a{index}", "status": "paused"})
    client.close()
    daemon.stop()
    now = datetime.now(UTC)
    rng = random.Random(7)
    rows: list[tuple[Any, ...]] = []
    statuses = ("finished", "finished", "finished", "failed", "cancelled")
    for index in range(terminal):
        ended = now - timedelta(seconds=rng.uniform(60, 86400 * 20))
        status = statuses[index % len(statuses)]
        rows.append((f"run_t{index:07d}", "ws1", f"a{index % AGENTS:04d}",
                     f"task{index % 5000}", rng.choice(["manual", "task_assigned", "routine"]),
                     status, f"tk{index}" if index % 10 == 0 else None,
                     stamp(ended - timedelta(seconds=30)), stamp(ended - timedelta(seconds=20)),
                     stamp(ended), round(rng.uniform(0, 50), 2) if status != "cancelled" else None,
                     1, stamp(ended)))
    for index in range(queued):
        rows.append((f"run_q{index:07d}", "ws1", f"a{index % AGENTS:04d}", None, "manual",
                     "queued", None, stamp(now), None, None, None, 0, stamp(now)))
    conn = sqlite3.connect(daemon.home / "kandevd.db")
    with conn:
        conn.executemany(
            "INSERT INTO runs (id, workspace_id, agent_id, task_id, reason, status,"
            " idempotency_key, requested_at, claimed_at, finished_at, cost_cents, attempt,"
            " updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    return daemon.start()


def list_latencies(daemon: Daemon) -> dict[str, float]:
    """Median ms of the first page of runs.list per filter, over the socket."""
    filters: dict[str, dict[str, Any]] = {
        "none": {}, "desc": {"order": "desc"}, "status=queued": {"status": "queued"},
        "status=finished": {"status": "finished"}, "agent": {"agent_id": "a0007"},
        "workspace": {"workspace_id": "ws1"}, "task": {"task_id": "task42"},
        "reason": {"reason": "routine"}, "agent+status": {"agent_id": "a0007",
                                                          "status": "failed"},
    }
    client = daemon.client()
    result = {}
    for name, params in filters.items():
        samples = []
        for _ in range(15):
            started = time.perf_counter()
            client.call("runs.list", params)
            samples.append((time.perf_counter() - started) * 1000)
        result[name] = statistics.median(samples)
    client.close()
    return result


def wake_latencies(daemon: Daemon, samples: int = 50) -> list[float]:
    client = daemon.client()
    client.call("agents.create", {"id": "waker", "workspace_id": "ws1", "name": "waker"})
    latencies = []
    for index in range(samples):
        run = client.call("runs.enqueue", {"workspace_id": "ws1", "agent_id": "waker",
                                           "reason": f"wake{index}"})["run"]
        while True:
            got = client.call("runs.get", {"id": run["id"]})
            if got["status"] in ("finished", "failed"):
                break
            time.sleep(0.002)
        requested = datetime.fromisoformat(got["requested_at"].replace("Z", "+00:00"))
        claimed = datetime.fromisoformat(got["claimed_at"].replace("Z", "+00:00"))
        latencies.append((claimed - requested).total_seconds() * 1000)
    client.close()
    return sorted(latencies)


def idle_ticks(daemon: Daemon, seconds: float) -> int:
    before = daemon.cpu_ticks()
    time.sleep(seconds)
    return daemon.cpu_ticks() - before


def finished(client: Client) -> int:
    return int(client.call("runs.list", {"status": "finished", "limit": 1})["total"])


def drain_window(daemon: Daemon, window: int) -> float:
    """Runs finished per second over the next ``window`` finished runs.

    Fewer when fewer are left to run (a small ``--queued``): the window never
    waits for runs that do not exist.
    """
    client = daemon.client()
    start_count = finished(client)
    left = sum(client.call("runs.list", {"status": status, "limit": 1})["total"]
               for status in ("queued", "claimed"))
    window = min(window, left)
    started = time.perf_counter()
    while window and finished(client) < start_count + window:
        time.sleep(0.02)
    rate = window / (time.perf_counter() - started) if window else float("nan")
    client.close()
    return rate


class Lister(threading.Thread):
    """Pages through 10,000 runs of runs.list (500 a page) once, as a client reading them all."""

    def __init__(self, daemon: Daemon) -> None:
        super().__init__(daemon=True)
        self.daemon_ = daemon
        self.pages = 0
        self.seconds = 0.0

    def run(self) -> None:
        client = self.daemon_.client()
        started = time.perf_counter()
        for offset in range(0, 10_000, 500):
            client.call("runs.list", {"status": "finished", "limit": 500, "offset": offset})
            self.pages += 1
        self.seconds = time.perf_counter() - started
        client.close()


def resume_all(daemon: Daemon) -> None:
    client = daemon.client()
    for index in range(AGENTS):
        client.call("agents.update", {"id": f"a{index:04d}", "status": "active"})
    client.close()


def one_round(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, terminal in (("small", 0), ("big", args.terminal)):
            daemon = build_home(Path(tmp), name, queued=args.queued, terminal=terminal)
            try:
                report: dict[str, Any] = {"lists_ms": list_latencies(daemon)}
                wake = wake_latencies(daemon)
                report["wake_p50_ms"] = wake[len(wake) // 2]
                report["wake_p99_ms"] = wake[min(len(wake) - 1, int(0.99 * len(wake)))]
                report["idle_ticks"] = idle_ticks(daemon, args.idle_s)
                report["rss_mib"] = daemon.rss_mib()
                resume_all(daemon)
                report["drain"] = drain_window(daemon, args.window)
                if name == "big":
                    lister = Lister(daemon)
                    lister.start()
                    report["drain_with_lister"] = drain_window(daemon, args.window)
                    lister.join()
                    report["lister_pages"] = lister.pages
                    report["lister_s"] = lister.seconds
                report["rss_mib_after"] = daemon.rss_mib()
                report["db_mib"] = daemon.call("daemon.status")["store"]["db"]["size_bytes"] \
                    / 2**20
            except RpcCallError as exc:
                raise SystemExit(f"{name}: {exc}") from None
            finally:
                daemon.stop()
            out[name] = report
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--terminal", type=int, default=100_000)
    parser.add_argument("--queued", type=int, default=10_000)
    parser.add_argument("--window", type=int, default=1000)
    parser.add_argument("--idle-s", type=float, default=10.0)
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cpus; terminal={args.terminal} "
          f"queued={args.queued} agents={AGENTS} window={args.window}")
    for round_number in range(1, args.repeat + 1):
        result = one_round(args)
        small, big = result["small"], result["big"]
        print(f"-- round {round_number}")
        for name in ("small", "big"):
            r = result[name]
            lists = " ".join(f"{k} {v:.1f}" for k, v in r["lists_ms"].items())
            print(f"{name:5}: runs.list first page ms: {lists}")
            print(f"{name:5}: wake p50 {r['wake_p50_ms']:.2f} ms p99 {r['wake_p99_ms']:.2f} ms;"
                  f" idle ticks {r['idle_ticks']} in {args.idle_s:.0f} s; RSS {r['rss_mib']:.1f}"
                  f" MiB idle, {r['rss_mib_after']:.1f} MiB after; db {r['db_mib']:.1f} MiB;"
                  f" drain {r['drain']:.0f} runs/s")
        print(f"big: drain with the lister paging {big['drain_with_lister']:.0f} runs/s "
              f"({big['lister_pages']} pages of 500 read in {big['lister_s']:.2f} s)")
        print(f"ratio drain big/small: {big['drain'] / small['drain']:.2f}")
        print(f"ratio drain with lister/without (big): "
              f"{big['drain_with_lister'] / big['drain']:.2f}")
        print(f"max runs.list first page (big): {max(big['lists_ms'].values()):.1f} ms")


if __name__ == "__main__":
    main()
