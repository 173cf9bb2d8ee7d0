"""Remote executions through one gateway: executions per second of ``/bin/true`` with 1, 4
and 16 runners, and the latency a runner adds to one execution against a local one.

One real daemon (its gateway on loopback) and real ``kandevd runner`` processes, each
with its own home, its keeper and ``SLOTS`` slots; 100 agents route their runs to the
runners' label. Throughput: ``N`` runs enqueued at once (``runs.enqueue_many``), timed
until the last one is finished. Latency: one run at a time, enqueue to finished, the
median over ``--latency-n`` runs of an agent with ``runs_on`` and of one without,
alternating.

Usage: .venv/bin/python scripts/bench/gateway_bench.py [--runs 1000] [--runners 1,4,16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchdaemon import KANDEVD, Daemon

TRUE = "/bin/true"


def start_runner(daemon: Daemon, tmp: Path, name: str, server: str, slots: int
                 ) -> subprocess.Popen[bytes]:
    added = daemon.call("runners.add", {"name": name, "labels": ["bench"]})
    home = tmp / f"runner-{name}"
    home.mkdir(mode=0o700)
    token = home / "token"
    token.write_text(added["token"])
    token.chmod(0o600)
    config = home / "runner.json"
    config.write_text(json.dumps({
        "runtime": {"max_concurrent": slots, "stop_grace_s": 2},
        "agents": {"default": {"command": [TRUE], "timeout_s": 60}}}))
    err = open(home / "stderr", "ab")  # noqa: SIM115
    return subprocess.Popen([*KANDEVD, "runner", "--server", server, "--token-file",
                             str(token), "--home", str(home), "--config", str(config),
                             "--log-level", "WARNING"], stdout=subprocess.DEVNULL,
                            stderr=err, start_new_session=True)


def gateway_url(daemon: Daemon) -> str:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for line in Path(daemon.err.name).read_text().splitlines():
            if "gateway for runners at " in line:
                return line.rsplit(" ", 1)[1]
        time.sleep(0.05)
    raise SystemExit("the gateway did not start")


def wait_online(daemon: Daemon, count: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        items = daemon.call("runners.list")["items"]
        if sum(item["online"] for item in items) >= count:
            return
        time.sleep(0.05)
    raise SystemExit("the runners did not come online")


def drain(daemon: Daemon, agents: list[str], runs: int) -> float:
    client = daemon.client()
    try:
        started = time.perf_counter()
        for first in range(0, runs, 500):
            client.call("runs.enqueue_many", {"runs": [
                {"workspace_id": "w", "agent_id": agents[i % len(agents)],
                 "reason": f"bench-{i}", "coalesce": False}
                for i in range(first, min(runs, first + 500))]})
        while client.call("runs.list", {"status": "finished", "limit": 1})["total"] < runs:
            time.sleep(0.01)
        return runs / (time.perf_counter() - started)
    finally:
        client.close()


def one_run(daemon: Daemon, agent: str) -> float:
    client = daemon.client()
    try:
        started = time.perf_counter()
        run = client.call("runs.enqueue", {"workspace_id": "w", "agent_id": agent,
                                           "reason": "latency", "coalesce": False})["run"]
        while client.call("runs.get", {"id": run["id"]})["status"] != "finished":
            time.sleep(0.0005)
        return (time.perf_counter() - started) * 1000
    finally:
        client.close()


def bench(count: int, runs: int, slots: int, latency_n: int) -> tuple[float, float, float]:
    with tempfile.TemporaryDirectory(dir="/dev/shm") as folder:
        tmp = Path(folder)
        daemon = Daemon(tmp / "server", {
            "gateway": {"listen": "127.0.0.1:0"},
            "runtime": {"max_concurrent": 4, "stop_grace_s": 2},
            "queue": {"max_attempts": 50},
            "agents": {"default": {"command": [TRUE], "timeout_s": 60}}}).start()
        server = gateway_url(daemon)
        runners = [start_runner(daemon, tmp, f"r{i}", server, slots) for i in range(count)]
        try:
            wait_online(daemon, count)
            daemon.call("workspaces.create", {"id": "w", "name": "w"})
            agents = [daemon.call("agents.create", {"workspace_id": "w", "name": f"a{i}",
                                                    "runs_on": ["bench"]})["id"]
                      for i in range(100)]
            daemon.call("agents.create", {"id": "local", "workspace_id": "w",
                                          "name": "local"})
            rate = drain(daemon, agents, runs)
            remote, local = [], []
            for _ in range(latency_n):
                remote.append(one_run(daemon, agents[0]))
                local.append(one_run(daemon, "local"))
            return rate, statistics.median(remote), statistics.median(local)
        finally:
            for runner in runners:
                runner.send_signal(2)
            for runner in runners:
                runner.wait(60)
            daemon.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--runners", default="1,4,16")
    parser.add_argument("--slots", type=int, default=4, help="slots of each runner")
    parser.add_argument("--latency-n", type=int, default=30)
    args = parser.parse_args()
    for count in (int(c) for c in args.runners.split(",")):
        rate, remote, local = bench(count, args.runs, args.slots, args.latency_n)
        print(f"{count:>2} runner(s) x {args.slots} slots: {rate:7.1f} executions/s; "
              f"one run enqueue->finished: remote {remote:6.1f} ms, local {local:6.1f} ms, "
              f"added {remote - local:+6.1f} ms", flush=True)


if __name__ == "__main__":
    sys.exit(main())
