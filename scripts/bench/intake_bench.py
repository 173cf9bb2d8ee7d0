"""Batched intake against one-at-a-time intake, in one run, over the real daemon's socket.

Run from the repository root::

    .venv/bin/python scripts/bench/intake_bench.py              # N = 20,000
    .venv/bin/python scripts/bench/intake_bench.py --n 50000 --repeat 3

The daemon runs on a temp home with the default (durable) store: every
commit is synced to disk before it is answered. 100 paused agents, so
nothing drains. One client on one connection sends:

* ``daemon.status`` and an unknown method, ``--trips`` times each (round trips);
* ``runs.enqueue`` one run at a time (``--single``, default 2,000 runs);
* ``runs.enqueue_many`` in batches of ``--batch`` (default 1,000) items,
  ``--n`` runs in all.

Printed last: runs/s of each and the ratio batch/single.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from benchdaemon import Daemon  # this folder (the script's own) is on sys.path

from kandevd.control.client import RpcCallError


def one_round(args: argparse.Namespace) -> tuple[dict[str, float], float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        daemon = Daemon(Path(tmp) / "home",
                        {"agents": {"default": {"command": ["/bin/true"]}}}).start()
        try:
            client = daemon.client()
            client.call("workspaces.create", {"id": "ws", "name": "ws"})
            agents = [f"a{i}" for i in range(100)]
            for agent in agents:
                client.call("agents.create", {"id": agent, "workspace_id": "ws", "name": agent,
                                              "status": "paused"})
            trips = {}
            for method in ("daemon.status", "no.such.method"):
                started = time.perf_counter()
                for _ in range(args.trips):
                    try:
                        client.call(method)
                    except RpcCallError:
                        pass
                trips[method] = args.trips / (time.perf_counter() - started)
            started = time.perf_counter()
            for i in range(args.single):
                client.call("runs.enqueue", {"workspace_id": "ws", "agent_id": agents[i % 100],
                                             "reason": f"s{i}"})
            single = args.single / (time.perf_counter() - started)
            started = time.perf_counter()
            for first in range(0, args.n, args.batch):
                client.call("runs.enqueue_many", {"runs": [
                    {"workspace_id": "ws", "agent_id": agents[i % 100], "reason": f"b{i}"}
                    for i in range(first, min(first + args.batch, args.n))]})
            batched = args.n / (time.perf_counter() - started)
            total = client.call("runs.list", {"limit": 1})["total"]
            assert total == args.single + args.n, total
            client.close()
        finally:
            daemon.stop()
    return trips, single, batched


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20_000)
    parser.add_argument("--single", type=int, default=2_000)
    parser.add_argument("--batch", type=int, default=1_000)
    parser.add_argument("--trips", type=int, default=5_000)
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    for _ in range(args.repeat):
        trips, single, batched = one_round(args)
        print(f"round trips/s: daemon.status {trips['daemon.status']:.0f}, an unknown method "
              f"{trips['no.such.method']:.0f}")
        print(f"runs.enqueue one at a time: {single:8.0f} runs/s   "
              f"runs.enqueue_many x{args.batch}: {batched:8.0f} runs/s   "
              f"ratio batch/single: {batched / single:.1f}")


if __name__ == "__main__":
    main()
