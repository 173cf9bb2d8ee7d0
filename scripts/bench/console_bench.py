#!/usr/bin/env python3
"""Benchmark of the web console, through the real ``kandevd serve``.

1. Page render time on a big home: 100,000 runs (most ended over the last day,
   some failed, some queued) and 1,000 workflow schedules. Each page is fetched
   ``--repeat`` times after a warm-up; the time is the HTTP round trip on
   loopback (render included), median and worst.
2. Idle cost: the daemon's CPU ticks over ``--idle-s`` seconds with the console
   on and no browser, against the same daemon with the console off; then with
   one overview open (its event stream followed and its live part fetched on
   every refresh, as the page's script does).
3. ``viewer``: ``console_bench.py viewer`` runs as a ``kandevd`` executable for
   the shared black-box benchmarks (``KANDEVD=... drain_vs_huey.py``): it
   serves with the console on and one overview open during the whole run.

Usage::

    .venv/bin/python scripts/bench/console_bench.py [--runs 100000] [--schedules 1000]
    KANDEVD="scripts/bench/console_bench.py viewer" python ../shared/bench/drain_vs_huey.py
"""

from __future__ import annotations

import argparse
import http.client
import json
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchdaemon import Daemon  # noqa: E402

PAGES = ["/", "/fragments/overview", "/schedules", "/schedules/workflow:wf-000:s-0",
         "/runs", "/runs?status=failed", "/runs/dead", "/agents", "/office"]


class Browser:
    """What the console's page does over HTTP: the cookie, pages, the event stream."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
        conn.request("GET", f"/?{parts.query}")
        answer = conn.getresponse()
        answer.read()
        self.cookie = answer.headers["Set-Cookie"].split(";")[0]
        conn.close()
        self.stop = threading.Event()
        self.refreshes = 0

    def get(self, path: str) -> tuple[int, float]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
        start = time.perf_counter()
        conn.request("GET", path, headers={"Cookie": self.cookie})
        answer = conn.getresponse()
        answer.read()
        elapsed = time.perf_counter() - start
        conn.close()
        return answer.status, elapsed

    def follow_overview(self) -> threading.Thread:
        """The overview's live part: refetched on every refresh event."""
        def run() -> None:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=3600)
            conn.request("GET", "/events/overview", headers={"Cookie": self.cookie})
            answer = conn.getresponse()
            while not self.stop.is_set():
                line = answer.fp.readline()
                if not line:
                    return
                if line.startswith(b"event: refresh"):
                    self.get("/fragments/overview")
                    self.refreshes += 1
        self.get("/")
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread


def console_url(home: Path, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return (home / "web.url").read_text().strip()
        except OSError:
            time.sleep(0.05)
    raise SystemExit("the console did not start")


def big_home(root: Path, runs: int, schedules: int) -> tuple[Path, dict[str, Any]]:
    """A home with ``runs`` runs (written straight into its database) and ``schedules``
    workflow schedules (10 per workflow)."""
    home = root / "big"
    config = {"web": {"listen": "127.0.0.1:0"}, "queue": {"retention_days": 0}}
    for w in range(schedules // 10):
        folder = home / "workspace" / "Workflow" / f"wf-{w:03d}"
        (folder / "variables").mkdir(parents=True)
        (folder / "variables" / "variables.json").write_text(json.dumps(
            {"groups": [{"group_id": "g", "enabled": True, "values": {}}]}))
        (folder / "workflow.json").write_text(json.dumps({"schedules": [
            {"id": f"s-{s}", "cron_expression": f"{(w + s) % 60} {s % 24} * * *",
             "group_ids": ["g"], "timezone": "Europe/Paris" if s % 2 else "UTC"}
            for s in range(10)]}))
    daemon = Daemon(home, config).start()
    daemon.call("workspaces.create", {"id": "ws", "name": "ws"})
    for a in range(20):
        daemon.call("agents.create", {"id": f"a{a}", "workspace_id": "ws", "name": f"a{a}",
                                      "status": "paused"})
    daemon.stop()
    now = datetime.now(UTC)
    with sqlite3.connect(home / "kandevd.db") as db:
        rows = []
        for n in range(runs):
            asked = now - timedelta(seconds=86400 * n / runs)
            status = "queued" if n < 500 else "failed" if n % 50 == 0 else "finished"
            done = None if status == "queued" else asked + timedelta(seconds=30)
            stamp = asked.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
            end = done.strftime("%Y-%m-%dT%H:%M:%S.%fZ") if done else None
            rows.append((f"run_{uuid.uuid4().hex}", "ws", f"a{n % 20}", "bench", "{}", status,
                         stamp, end if done else None, end, stamp, 1 if done else 0,
                         "failed: exit code 1" if status == "failed" else None))
        db.executemany(
            "INSERT INTO runs (id, workspace_id, agent_id, reason, payload, status,"
            " requested_at, claimed_at, finished_at, updated_at, attempt, error_message)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
    return home, config


def pages(args: argparse.Namespace, root: Path) -> None:
    home, config = big_home(root, args.runs, args.schedules)
    daemon = Daemon(home, config).start()
    try:
        browser = Browser(console_url(home))
        print(f"## page render time: {args.runs:,} runs, {args.schedules:,} schedules "
              f"(median / worst of {args.repeat}, HTTP on loopback)")
        for path in PAGES:
            status, _ = browser.get(path)  # warm-up (the charts' first read included)
            assert status == 200, (path, status)
            times = sorted(browser.get(path)[1] for _ in range(args.repeat))
            print(f"{path:42s} {statistics.median(times) * 1000:7.1f} ms "
                  f"{times[-1] * 1000:7.1f} ms  (target <= 100 ms)")
    finally:
        daemon.stop()


def idle(args: argparse.Namespace, root: Path) -> None:
    print(f"## idle CPU ticks over {args.idle_s:g} s (1 tick = 10 ms)")
    for label, web in (("console off", None), ("console on, no browser", "127.0.0.1:0"),
                       ("console on, one overview open", "127.0.0.1:0")):
        home = root / f"idle-{uuid.uuid4().hex[:6]}"
        daemon = Daemon(home, {"web": {"listen": web}}).start()
        try:
            browser = None
            if web:
                browser = Browser(console_url(home))
                if "overview" in label:
                    browser.follow_overview()
            time.sleep(3)  # the start's own work settles
            before = daemon.cpu_ticks()
            time.sleep(args.idle_s)
            ticks = daemon.cpu_ticks() - before
            print(f"{label:34s} {ticks:4d} ticks = {ticks / (args.idle_s * 100) * 100:.3f} % "
                  f"of a core")
            if browser is not None:
                browser.stop.set()
        finally:
            daemon.stop()
    print("## one overview open while runs finish (20 runs/s enqueued for the span)")
    home = root / "busy"
    daemon = Daemon(home, {"web": {"listen": "127.0.0.1:0"}}).start()
    try:
        daemon.call("workspaces.create", {"id": "ws", "name": "ws"})
        for a in range(4):
            daemon.call("agents.create", {"id": f"a{a}", "workspace_id": "ws", "name": "a"})
        browser = Browser(console_url(home))
        browser.follow_overview()
        start, n = time.monotonic(), 0
        while time.monotonic() - start < args.idle_s:
            daemon.call("runs.enqueue", {"workspace_id": "ws", "agent_id": f"a{n % 4}",
                                         "reason": "bench", "coalesce": False})
            n += 1
            time.sleep(0.05)
        print(f"{n} runs enqueued, {browser.refreshes} refreshes of the live part "
              f"(at most one per 2 s: <= {int(args.idle_s / 2) + 1})")
        browser.stop.set()
    finally:
        daemon.stop()


def viewer(argv: list[str]) -> int:
    """``serve`` with the console on and one overview followed until the daemon exits."""
    import subprocess

    config_at = argv.index("--config") + 1 if "--config" in argv else None
    if config_at is not None:
        path = Path(argv[config_at])
        config = json.loads(path.read_text() or "{}")
        config["web"] = {"listen": "127.0.0.1:0"}
        path.write_text(json.dumps(config))
    child = subprocess.Popen([sys.executable, "-m", "kandevd", *argv])
    if argv and argv[0] == "serve":
        home = Path(argv[argv.index("--home") + 1])
        try:
            Browser(console_url(home)).follow_overview()
        except SystemExit:
            pass
    import signal
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda s, _f: child.send_signal(s))
    return child.wait()


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "viewer":
        return viewer(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100_000)
    parser.add_argument("--schedules", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--idle-s", type=float, default=30)
    parser.add_argument("--skip-idle", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kandevd-console-bench-") as tmp:
        pages(args, Path(tmp))
        if not args.skip_idle:
            idle(args, Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
