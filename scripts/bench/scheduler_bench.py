#!/usr/bin/env python3
"""Benchmark of the file-backed workflow scheduler, against a baseline in the same run.

Black-box where it can be: real ``kandevd serve`` processes on temp homes.

1. Idle cost of 1,000 workflows (one schedule each, none due) against a home
   with none: start-up to a listening socket, RSS, CPU over ``--idle-s``
   seconds, and ``scheduler.jobs.list`` of all 1,000 (two pages of 500).
2. 100 schedules due at the same minute (``runtime.max_concurrent`` 101):
   every session recorded, and how long after the fire time each first turn
   started.
3. 1,000 users x 5 product schedules (none due) against a home with none: start-up,
   RSS, idle CPU, ``scheduler.jobs.list`` for one user.
4. Recording a run into a history of 5,000 entries (in process: the same
   ``History`` the daemon uses), against recording into an empty one.

Usage::

    .venv/bin/python scripts/bench/scheduler_bench.py [--idle-s 60] [--skip-due]

Prints one line per measurement with the target beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from kandevd.control.client import call  # noqa: E402
from kandevd.schedules.history import History, PendingWrites  # noqa: E402
from kandevd.timeutil import parse_rfc3339, rfc3339  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")
GROUPS = {"groups": [{"group_id": "g1", "display_name": "G1", "values": {}, "enabled": True}]}


def write_workflows(root: Path, count: int, cron: str, **fields: Any) -> None:
    for i in range(count):
        folder = root / "Workflow" / f"wf-{i:04d}"
        (folder / "variables").mkdir(parents=True)
        (folder / "variables" / "variables.json").write_text(json.dumps(GROUPS))
        (folder / "workflow.json").write_text(json.dumps({"id": f"wf{i}", "schedules": [
            {"id": "s", "cron_expression": cron, "group_ids": ["g1"], **fields}]}))


class Serve:
    def __init__(self, home: Path, config: dict[str, Any]) -> None:
        self.home = home
        home.mkdir(parents=True, exist_ok=True)
        (home / "kandevd.yaml").write_text(json.dumps(config))
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> float:
        """Start and return seconds until the socket answers."""
        began = time.perf_counter()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kandevd", "serve", "--home", str(self.home)],
            stdout=subprocess.DEVNULL, stderr=open(self.home / "stderr.log", "ab"),  # noqa: SIM115
            start_new_session=True, cwd=REPO)
        sock = self.home / "kandevd.sock"
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"daemon exited: see {self.home / 'stderr.log'}")
            try:
                probe = socket.socket(socket.AF_UNIX)
                probe.connect(str(sock))
                probe.close()
                return time.perf_counter() - began
            except OSError:
                time.sleep(0.002)

    def call(self, method: str, params: dict[str, Any] | None = None) -> Any:
        return call(self.home / "kandevd.sock", method, params or {})

    def cpu_s(self) -> float:
        assert self.proc is not None
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICKS

    def rss_mib(self) -> float:
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def stop(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(60)


def idle(base: Path, idle_s: float) -> None:
    print("== 1,000 workflows, none due, against a home with none")
    results: dict[str, dict[str, float]] = {}
    for label, count in (("none", 0), ("1000", 1000)):
        starts, rss, cpu, lists = [], [], [], []
        for attempt in range(3):
            home = base / f"idle-{label}-{attempt}"
            write_workflows(home / "workspace", count, "0 0 1 1 *")
            daemon = Serve(home, {"office": {"enabled": False}})
            starts.append(daemon.start())
            if attempt == 0:
                daemon.call("daemon.status")
                time.sleep(1.0)  # let start-up work settle before the idle window
                before = daemon.cpu_s()
                time.sleep(idle_s)
                cpu.append((daemon.cpu_s() - before) / idle_s * 100)
                rss.append(daemon.rss_mib())
                for _ in range(5):
                    began = time.perf_counter()
                    total = 0
                    for offset in (0, 500):
                        total += len(daemon.call("scheduler.jobs.list",
                                                 {"limit": 500, "offset": offset})["items"])
                    lists.append((time.perf_counter() - began) * 1000)
                assert total == count, (total, count)
            daemon.stop()
        results[label] = {"start": statistics.median(starts), "rss": rss[0], "cpu": cpu[0],
                          "list": statistics.median(lists)}
    none, many = results["none"], results["1000"]
    print(f"start-up to socket: none {none['start']:.3f}s, 1000 {many['start']:.3f}s, "
          f"+{many['start'] - none['start']:.3f}s (target <= +1.0s)")
    print(f"RSS: none {none['rss']:.1f} MiB, 1000 {many['rss']:.1f} MiB, "
          f"+{many['rss'] - none['rss']:.1f} MiB (target <= +25 MiB)")
    print(f"idle CPU over {idle_s:.0f}s: none {none['cpu']:.3f}%, 1000 {many['cpu']:.3f}% of a "
          "core (target <= 0.05%)")
    print(f"scheduler.jobs.list of all 1000 (2 pages of 500): {many['list']:.1f} ms median of 5 "
          f"(none: {none['list']:.1f} ms) (target <= 50 ms)")


def write_products(root: Path, users: int) -> None:
    folder = root / "products" / "helper"
    folder.mkdir(parents=True)
    schedules = [{"id": f"cron{i}", "cron_expression": f"{i} 3 1 1 *", "messages": ["m"]}
                 for i in range(3)]
    schedules += [{"id": f"cadence{i}", "cadence_hours": 24 * 365, "messages": ["m"]}
                  for i in range(2)]
    (folder / "product.yaml").write_text(json.dumps({"profile": {
        "runtime": {"conversation": {"mode": "singleton"}}, "schedules": schedules}}))
    (root / "users.yaml").write_text(json.dumps(
        [{"id": f"user{i:04d}", "enabled": True, "products": "*"} for i in range(users)]))


def products(base: Path, idle_s: float) -> None:
    print("== 1,000 users x 5 product schedules, none due, against a home with none")
    results: dict[str, dict[str, float]] = {}
    for label, users in (("none", 0), ("5000", 1000)):
        home = base / f"products-{label}"
        if users:
            write_products(home / "workspace", users)
        daemon = Serve(home, {"office": {"enabled": False}})
        start = daemon.start()
        # the first tick writes each user's first due times; wait for it to settle
        state = home / "workspace" / "_users"
        deadline = time.time() + 120
        while users and time.time() < deadline and \
                len(list(state.glob("*/chat_history/product-schedules.json"))) < users:
            time.sleep(0.2)
        time.sleep(1.0)
        before = daemon.cpu_s()
        time.sleep(idle_s)
        cpu = (daemon.cpu_s() - before) / idle_s * 100
        lists = []
        for _ in range(5):
            began = time.perf_counter()
            items = daemon.call("scheduler.jobs.list", {"user_id": "user0500"})["items"]
            lists.append((time.perf_counter() - began) * 1000)
        assert len(items) == (5 if users else 0), len(items)
        results[label] = {"start": start, "rss": daemon.rss_mib(), "cpu": cpu,
                          "list": statistics.median(lists)}
        daemon.stop()
    none, many = results["none"], results["5000"]
    print(f"start-up to socket: none {none['start']:.3f}s, 5000 jobs {many['start']:.3f}s, "
          f"+{many['start'] - none['start']:.3f}s (target <= +1.0s)")
    print(f"RSS: none {none['rss']:.1f} MiB, 5000 jobs {many['rss']:.1f} MiB, "
          f"+{many['rss'] - none['rss']:.1f} MiB (target <= +30 MiB)")
    print(f"idle CPU over {idle_s:.0f}s: none {none['cpu']:.3f}%, 5000 jobs {many['cpu']:.3f}% "
          "of a core (target <= 0.05%)")
    print(f"scheduler.jobs.list for one user: {many['list']:.1f} ms median of 5 "
          "(target <= 20 ms)")


def due(base: Path) -> None:
    print("== 100 schedules due at the same minute")
    home = base / "due"
    write_workflows(home / "workspace", 100, "* * * * *", workshop_mode="workshop")
    daemon = Serve(home, {"office": {"enabled": False},
                          "runtime": {"max_concurrent": 101},
                          "agents": {"default": {"command": ["/bin/true"]}}})
    daemon.start()
    now = datetime.now(UTC)
    fire = (now + timedelta(minutes=1)).replace(second=0, microsecond=0)
    deadline = time.time() + (fire - now).total_seconds() + 60
    entries: list[dict[str, Any]] = []
    while time.time() < deadline:
        entries = []
        for i in range(100):
            path = home / "workspace" / "Workflow" / f"wf-{i:04d}" / "schedule-runs.json"
            if path.exists():
                entries += [e for e in json.loads(path.read_text())
                            if e["status"] != "running"]
        if len(entries) >= 100:
            break
        time.sleep(0.2)
    daemon.stop()
    delays = sorted((parse_rfc3339(e["turns"][0]["started_at"]) - fire).total_seconds() * 1000
                    for e in entries if e["turns"] and e["turns"][0].get("started_at"))
    ok = sum(1 for e in entries if e["status"] == "success")
    print(f"sessions recorded: {len(entries)}/100 ({ok} success)")
    if delays:
        print(f"first turn started after the fire time: min {delays[0]:.0f} ms, "
              f"median {statistics.median(delays):.0f} ms, max {delays[-1]:.0f} ms "
              "(target: the first within 200 ms)")


def history_cost(base: Path) -> None:
    print("== recording a run into a history of 5,000 entries")
    now = datetime.now(UTC)
    results = {}
    for size in (0, 5000):
        folder = base / f"history-{size}"
        folder.mkdir()
        history = History(folder, retention_days=90, backlog=PendingWrites())
        history.file.write([{"id": f"e{i}", "schedule_id": "s", "status": "success",
                             "started_at": rfc3339(now), "completed_at": rfc3339(now),
                             "turns": [{"kind": "message", "status": "success"}]}
                            for i in range(size)])
        times = []
        for i in range(20):
            began = time.perf_counter()
            history.record_start({"id": f"new{i}", "schedule_id": "s", "status": "running",
                                  "started_at": rfc3339(now)}, now)
            times.append((time.perf_counter() - began) * 1000)
        results[size] = statistics.median(times)
    print(f"record_start: empty {results[0]:.2f} ms, 5000 entries {results[5000]:.2f} ms "
          f"(x{results[5000] / results[0]:.1f}) (target <= 20 ms)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--idle-s", type=float, default=60.0)
    parser.add_argument("--skip-due", action="store_true")
    parser.add_argument("--only-products", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kandevd-sched-bench-") as tmp:
        base = Path(tmp)
        if args.only_products:
            products(base, args.idle_s)
            return
        history_cost(base)
        idle(base, args.idle_s)
        products(base, args.idle_s)
        if not args.skip_due:
            due(base)


if __name__ == "__main__":
    main()
