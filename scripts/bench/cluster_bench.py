"""Several daemons on one PostgreSQL database (pgserver): does the cluster scale with agents?

Each measurement starts N real ``kandevd serve`` daemons (homes of their own, one
``store.url``, ``runtime.max_concurrent`` 4 each) on a fresh database, queues
``--runs`` runs over ``--agents`` agents while every agent is paused, then
activates the agents and times the drain until every run is finished. Each run
is an agent that sleeps ``--sleep`` seconds (``/bin/sh -c '... sleep ...'``),
so the work is agent time: with claims that do not serialize the cluster, N
daemons drain about N times as fast as one.

The agents write ``S <run>`` when they start and ``E <run>`` when they end to one
file (appends of a line are atomic). From that file alone, not from any daemon:
every run executed exactly once, and no agent ever had two executions at once
(its runs' lines alternate S, E, S, E).

Then, with 2 daemons: the wake-up across daemons (a run queued on a daemon
whose one slot is busy, claimed by the other, idle one: ``claimed_at -
requested_at``, p50/p99), and a kill -9 of one daemon with claims: how long
until the other finished them (``cluster.dead_after_s`` + safety interval is
the bound).

The drains come in ``--rounds`` rounds (1, 2, 3 daemons in turn) and the
ratios compare the medians: this machine's speed drifts by tens of percent
within minutes, more than the differences measured.

``--baseline DIR`` compares this checkout with another one instead: in each
round both versions drain with 1 and with 3 daemons, back to back (which goes
first alternates), on the same PostgreSQL server; the medians and the
3 / 1 ratios of both are printed (no wake-up or failover measurement then).
Separate runs of the two versions minutes apart differ by more than most
changes do.

Usage: .venv/bin/python scripts/bench/cluster_bench.py [--runs 800] [--rounds 3] [--sleep 0.05]
       [--kandevd-from DIR]   (the daemons of another checkout: an A/B in separate runs)
       [--baseline DIR]       (this checkout against DIR's, alternating round by round)
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import tempfile
import time
import uuid
from collections import defaultdict
from datetime import datetime
from pathlib import Path
from typing import Any

import benchdaemon  # this folder (the script's own) is on sys.path
from benchdaemon import Daemon


def new_database(server: Any) -> str:
    import psycopg

    name = "bench_" + uuid.uuid4().hex[:12]
    with psycopg.connect(server.get_uri(), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return server.get_uri(name)


def config(url: str, probe: Path, sleep_s: float, slots: int, **queue: Any) -> dict[str, Any]:
    script = ('echo "S $KANDEVD_RUN_ID" >> "$PROBE"; sleep "$SLEEP";'
              ' echo "E $KANDEVD_RUN_ID" >> "$PROBE"')
    return {"store": {"url": url}, "cluster": {"heartbeat_s": 1, "dead_after_s": 5},
            "queue": {"safety_interval_s": 5, **queue},
            "runtime": {"max_concurrent": slots, "stop_grace_s": 2},
            "office": {"enabled": False},
            "agents": {"default": {"command": ["/bin/sh", "-c", script], "timeout_s": 60,
                                   "env": {"PROBE": str(probe), "SLEEP": str(sleep_s)}}}}


def start(tmp: Path, count: int, cfg: dict[str, Any]) -> list[Daemon]:
    daemons = []
    tmp.mkdir(parents=True, exist_ok=True)
    for n in range(count):
        home = tmp / f"home{n}"
        daemons.append(Daemon(home, cfg).start())
    return daemons


def check_probe(probe: Path, agent_of: dict[str, str]) -> tuple[int, int]:
    """(runs executed more than once, agents with overlapping executions)."""
    starts: dict[str, int] = defaultdict(int)
    open_by_agent: dict[str, str | None] = defaultdict(lambda: None)
    overlaps: set[str] = set()
    for line in probe.read_text().splitlines():
        kind, run = line.split()
        agent = agent_of[run]
        if kind == "S":
            starts[run] += 1
            if open_by_agent[agent] is not None:
                overlaps.add(agent)
            open_by_agent[agent] = run
        elif open_by_agent[agent] == run:
            open_by_agent[agent] = None
    return sum(1 for n in starts.values() if n > 1), len(overlaps)


def drain(server: Any, tmp: Path, count: int, runs: int, agents: int, sleep_s: float,
          round_no: int = 1) -> float:
    url = new_database(server)
    probe = tmp / f"probe-{count}-{round_no}.txt"
    daemons = start(tmp / f"drain{count}-{round_no}", count, config(url, probe, sleep_s, 4))
    try:
        first = daemons[0]
        ws = first.call("workspaces.create", {"name": "bench"})["id"]
        ids = [first.call("agents.create", {"workspace_id": ws, "name": f"a{i}",
                                            "status": "paused"})["id"] for i in range(agents)]
        for k in range(0, runs, 500):
            first.call("runs.enqueue_many", {"runs": [
                {"workspace_id": ws, "agent_id": ids[i % agents], "reason": f"r{i}"}
                for i in range(k, min(runs, k + 500))]})
        client = first.client()
        started = time.perf_counter()
        for agent in ids:
            client.call("agents.update", {"id": agent, "status": "active"})
        while client.call("runs.list", {"status": "finished", "limit": 1})["total"] < runs:
            time.sleep(0.02)
        elapsed = time.perf_counter() - started
        waits = [d.call("daemon.status")["store"].get("writer_wait_s", 0.0) for d in daemons]
        agent_of = {}
        for offset in range(0, runs, 500):
            for run in client.call("runs.list", {"limit": 500, "offset": offset})["items"]:
                agent_of[run["id"]] = run["agent_id"]
        client.close()
        twice, overlapping = check_probe(probe, agent_of)
        print(f"{count} daemon(s): {runs / elapsed:7.1f} runs/s ({runs} runs, {elapsed:.2f} s);"
              f" executed twice: {twice}; agents with overlapping executions: {overlapping};"
              f" waiting for the writer lock: {sum(waits) / count / elapsed:.0%} of the time"
              " per daemon")
        return runs / elapsed
    finally:
        for daemon in daemons:
            daemon.stop()


def stamp(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def wake_latency(server: Any, tmp: Path, samples: int) -> None:
    url = new_database(server)
    cfg = config(url, tmp / "probe-wake.txt", 0.0, 1, safety_interval_s=60)
    cfg["agents"]["long"] = {**cfg["agents"]["default"],
                             "env": {**cfg["agents"]["default"]["env"], "SLEEP": "600"}}
    busy = Daemon(tmp / "wake-busy", cfg).start()
    idle = None
    try:
        ws = busy.call("workspaces.create", {"name": "bench"})["id"]
        holder = busy.call("agents.create", {"workspace_id": ws, "name": "holder",
                                             "profile": "long"})["id"]
        others = [busy.call("agents.create", {"workspace_id": ws, "name": f"a{i}"})["id"]
                  for i in range(2)]
        # The busy daemon's one slot runs a long run; only then does the idle one start.
        busy.call("runs.enqueue", {"workspace_id": ws, "agent_id": holder, "reason": "hold"})
        while busy.call("runs.list", {"status": "claimed", "limit": 1})["total"] < 1:
            time.sleep(0.01)
        idle = Daemon(tmp / "wake-idle", cfg).start()
        client, reader = busy.client(), idle.client()
        lat = []
        for n in range(samples):
            run = client.call("runs.enqueue", {"workspace_id": ws, "agent_id": others[n % 2],
                                               "reason": f"w{n}"})["run"]
            while True:
                got = reader.call("runs.get", {"id": run["id"]})
                if got["status"] == "finished":
                    break
                time.sleep(0.001)
            lat.append((stamp(got["claimed_at"]) - stamp(got["requested_at"])) * 1000)
        client.close()
        reader.close()
        lat.sort()
        print(f"wake-up across daemons (queued on a busy daemon, claimed by an idle one; ms,"
              f" n={len(lat)}): p50 {statistics.median(lat):.1f}"
              f" p99 {lat[max(0, int(len(lat) * 0.99) - 1)]:.1f} max {lat[-1]:.1f}"
              " (target p99 <= 20)")
    finally:
        if idle is not None:
            idle.stop()
        busy.stop()


def failover(server: Any, tmp: Path) -> None:
    url = new_database(server)
    probe = tmp / "probe-kill.txt"
    cfg = config(url, probe, 3.0, 4)
    victim, survivor = start(tmp / "kill", 2, cfg)
    try:
        ws = victim.call("workspaces.create", {"name": "bench"})["id"]
        ids = [victim.call("agents.create", {"workspace_id": ws, "name": f"a{i}"})["id"]
               for i in range(8)]
        for agent in ids:
            victim.call("runs.enqueue", {"workspace_id": ws, "agent_id": agent,
                                         "reason": "long"})
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            claimed = [r for r in victim.call("runs.list", {"status": "claimed",
                                                            "limit": 100})["items"]]
            if len(claimed) == 8:
                break
            time.sleep(0.05)
        boot = victim.call("daemon.status")["boot_id"]
        mine = {r["id"] for r in victim.call("runs.list", {"status": "claimed", "limit": 100})
                ["items"] if r.get("id")}
        assert victim.proc is not None
        os.killpg(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait()
        killed = time.perf_counter()
        while survivor.call("runs.list", {"status": "finished", "limit": 1})["total"] < 8:
            time.sleep(0.05)
        took = time.perf_counter() - killed
        print(f"kill -9 of a daemon holding {len(mine)} claims (boot {boot[:8]}): all 8 runs"
              f" finished on the other {took:.1f} s later (dead_after_s 5 + safety 5"
              f" + the 3 s agent = 13 s bound)")
    finally:
        survivor.stop()


def compare(server: Any, tmp: Path, args: argparse.Namespace) -> None:
    """This checkout against ``args.baseline``, 1 and 3 daemons, alternating per round."""
    commands = {"this": list(benchdaemon.KANDEVD),
                "baseline": benchdaemon.checkout_command(args.baseline)}
    rates: dict[str, dict[int, list[float]]] = {name: {1: [], 3: []} for name in commands}
    for round_no in range(1, args.rounds + 1):
        order = ("this", "baseline") if round_no % 2 else ("baseline", "this")
        for name in order:
            benchdaemon.KANDEVD = commands[name]
            print(f"round {round_no}, {name}:")
            for count in (1, 3):
                rates[name][count].append(drain(server, tmp / name, count, args.runs,
                                                args.agents, args.sleep, round_no))
    for name, measured in rates.items():
        one, three = statistics.median(measured[1]), statistics.median(measured[3])
        ratios = ", ".join(f"{t / o:.2f}x" for o, t in zip(measured[1], measured[3],
                                                             strict=True))
        print(f"{name}: medians 1 daemon {one:.1f} runs/s, 3 daemons {three:.1f} runs/s;"
              f" 3 / 1 {three / one:.2f}x (per round: {ratios})")
    med = {name: {n: statistics.median(v) for n, v in m.items()} for name, m in rates.items()}
    print(f"this / baseline: 1 daemon {med['this'][1] / med['baseline'][1]:.3f}x,"
          f" 3 daemons {med['this'][3] / med['baseline'][3]:.3f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=800)
    parser.add_argument("--agents", type=int, default=60)
    parser.add_argument("--sleep", type=float, default=0.05)
    parser.add_argument("--samples", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3,
                        help="drains of 1, 2 and 3 daemons, in turn; the medians are compared")
    other = parser.add_mutually_exclusive_group()
    other.add_argument("--kandevd-from", type=Path, metavar="DIR",
                       help="run the daemons from this checkout (another version, to compare)")
    other.add_argument("--baseline", type=Path, metavar="DIR",
                       help="compare with this checkout, alternating round by round")
    args = parser.parse_args()
    if args.kandevd_from is not None:
        benchdaemon.KANDEVD = benchdaemon.checkout_command(args.kandevd_from)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        os.environ.setdefault("XDG_RUNTIME_DIR", str(tmp))
        import pgserver

        server = pgserver.get_server(tmp / "pgdata", cleanup_mode="stop")
        try:
            if args.baseline is not None:
                compare(server, tmp, args)
                return
            # Rounds of 1, 2, 3 daemons, and the median of each: this machine's speed
            # drifts by tens of percent within minutes, and a ratio of two single
            # measurements taken a minute apart carries that drift.
            measured: dict[int, list[float]] = {1: [], 2: [], 3: []}
            for round_no in range(1, args.rounds + 1):
                for n in (1, 2, 3):
                    measured[n].append(drain(server, tmp, n, args.runs, args.agents,
                                             args.sleep, round_no))
            rates = {n: statistics.median(values) for n, values in measured.items()}
            if args.rounds > 1:
                print("medians over", args.rounds, "rounds:", ", ".join(
                    f"{n} daemon(s) {rate:.1f} runs/s" for n, rate in rates.items()))
            print(f"ratio 2 daemons / 1: {rates[2] / rates[1]:.2f}x (target 1.8x); "
                  f"3 / 1: {rates[3] / rates[1]:.2f}x (target 2.5x)")
            wake_latency(server, tmp, args.samples)
            failover(server, tmp)
        finally:
            server.cleanup()


if __name__ == "__main__":
    main()
