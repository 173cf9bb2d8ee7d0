"""What events cost the drain: the rate with 0, 1 and 50 subscribers, and the events
each subscriber receives per second.

Each round starts the real ``kandevd serve`` on a fresh home (SQLite, 100 agents,
``runtime.max_concurrent`` 4, ``/bin/true`` agents), opens the round's
subscriptions (``events.subscribe {topics: ["run.*"]}``) from one reader process
(one thread, ``selectors``, as a client would), queues ``--runs`` runs with
``runs.enqueue_many`` and times the drain until none is queued or claimed. The
reader counts every notification it receives until the last ``run.finished``.
Rounds alternate 0, 1, 50 subscribers (``--rounds`` times each); the medians of the
drain rate and of the daemon's CPU per run, and their ratios to the rounds without
subscribers, are printed last.

Usage: .venv/bin/python scripts/bench/events_bench.py [--runs 1500] [--rounds 3]
       [--subscribers 0,1,50] [--dir /dev/shm]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import selectors
import shutil
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import benchdaemon  # this folder (the script's own) is on sys.path


def reader(path: str, count: int, runs: int, ready: Any, results: Any) -> None:
    """Subscribe ``count`` times; count the notifications until each saw ``runs``
    ``run.finished`` (or 120 s passed)."""
    selector = selectors.DefaultSelector()
    state: dict[socket.socket, dict[str, Any]] = {}
    for _ in range(count):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        sock.sendall(b'{"jsonrpc":"2.0","id":1,"method":"events.subscribe",'
                     b'"params":{"topics":["run.*"]}}\n')
        sock.setblocking(False)
        state[sock] = {"buffer": b"", "events": 0, "finished": 0, "lost": 0,
                       "answered": False}
        selector.register(sock, selectors.EVENT_READ)
    ready.set()
    deadline = time.monotonic() + 120
    first = last = None
    while any(s["finished"] < runs for s in state.values()) and time.monotonic() < deadline:
        for key, _mask in selector.select(timeout=1.0):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            data = sock.recv(1 << 20)
            if not data:
                selector.unregister(sock)
                continue
            held = state[sock]
            chunk = held["buffer"] + data
            cut = chunk.rfind(b"\n") + 1
            held["buffer"], chunk = chunk[cut:], chunk[:cut]
            if not held["answered"] and chunk:  # (the subscription's answer line)
                held["answered"] = True
                chunk = chunk[chunk.find(b"\n") + 1:]
            # Counted, not parsed: a client that decodes every event would spend a core
            # of this 2-core machine beside the daemon it measures.
            for line in chunk.split(b"\n") if b"events.lost" in chunk else ():
                if b"events.lost" in line:
                    held["lost"] += json.loads(line)["params"]["count"]
                    held["events"] -= 1
            held["events"] += chunk.count(b"\n")
            held["finished"] += chunk.count(b'"topic":"run.finished"')
            if chunk:
                now = time.monotonic()
                first = first if first is not None else now
                last = now
    results.put({"events": sum(s["events"] for s in state.values()),
                 "lost": sum(s["lost"] for s in state.values()),
                 "span_s": (last - first) if first is not None and last is not None else 0.0})
    for sock in state:
        sock.close()


def round_(base: Path, runs: int, subscribers: int) -> dict[str, float]:
    # (the daemon's config and stderr go beside its home: one folder holds all three)
    folder = Path(tempfile.mkdtemp(prefix="events-", dir=base))
    home = folder / "home"
    daemon = benchdaemon.Daemon(home, benchdaemon.DRAIN_CONFIG).start()
    process = None
    try:
        ws, agents = benchdaemon.bench_agents(daemon)
        results: Any = multiprocessing.Queue()
        if subscribers:
            ready = multiprocessing.Event()
            process = multiprocessing.Process(target=reader, args=(
                str(home / "kandevd.sock"), subscribers, runs, ready, results))
            process.start()
            ready.wait(30)
            while daemon.call("daemon.status")["events"]["subscribers"] < subscribers:
                time.sleep(0.02)
        client = daemon.client()
        ticks = daemon.cpu_ticks()
        elapsed = benchdaemon.enqueue_and_drain(client, ws, agents, runs)
        cpu_ms = (daemon.cpu_ticks() - ticks) * 1000 / os.sysconf("SC_CLK_TCK") / runs
        client.close()
        got = {"events": 0, "lost": 0, "span_s": 0.0}
        if process is not None:
            got = results.get(timeout=180)
            process.join(30)
    finally:
        daemon.stop()
        shutil.rmtree(folder, ignore_errors=True)
    per_subscriber = got["events"] / subscribers if subscribers else 0.0
    return {"rate": runs / elapsed, "events_per_s": per_subscriber / elapsed,
            "lost": float(got["lost"]), "cpu_ms": cpu_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--subscribers", default="0,1,50")
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()
    counts = [int(n) for n in args.subscribers.split(",")]
    seen: dict[int, list[dict[str, float]]] = {n: [] for n in counts}
    for number in range(1, args.rounds + 1):
        for count in counts:
            result = round_(Path(args.dir), args.runs, count)
            seen[count].append(result)
            print(f"round {number}, {count:>2} subscriber(s): {result['rate']:7.1f} runs/s, "
                  f"daemon CPU {result['cpu_ms']:.3f} ms/run, "
                  f"{result['events_per_s']:7.1f} events/s to each, "
                  f"{result['lost']:.0f} lost", flush=True)
    base = statistics.median(r["rate"] for r in seen[counts[0]])
    base_cpu = statistics.median(r["cpu_ms"] for r in seen[counts[0]])
    print(f"\nmedians of {args.rounds} round(s), {args.runs} runs each:")
    for count in counts:
        rate = statistics.median(r["rate"] for r in seen[count])
        each = statistics.median(r["events_per_s"] for r in seen[count])
        cpu = statistics.median(r["cpu_ms"] for r in seen[count])
        print(f"{count:>2} subscriber(s): {rate:7.1f} runs/s ({rate / base:.3f}x), daemon "
              f"CPU {cpu:.3f} ms/run ({cpu / base_cpu:.3f}x), {each:7.1f} events/s to each "
              f"({each * count:8.1f} in all)")


if __name__ == "__main__":
    main()
