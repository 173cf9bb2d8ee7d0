"""Benchmark of the global run queue, with huey's SqliteHuey on the same work as a yardstick.

Run from the repository root::

    .venv/bin/python scripts/bench/queue_bench.py            # N = 2000
    .venv/bin/python scripts/bench/queue_bench.py --n 10000

It measures, each on a fresh database file in a temp directory:

* enqueue throughput: ``RunQueue.enqueue`` N times (each one committed);
* drain throughput: N queued runs, then the real ``QueueLoop`` thread claims
  them, the ``AgentRuntime`` executes each with the in-process no-op agent
  (``InProcessRunner``) and the outcome is recorded, for 1 agent (strictly
  one run at a time) and for 100 agents (``--max-concurrent`` at once);
* wake latency: with the loop idle, the time from ``enqueue()`` returning
  (the run is committed and the loop signalled) to the run being claimed and
  handed to the runtime, p50/p99 over ``--samples`` runs;
* huey: SqliteHuey on a file, N no-op tasks enqueued, then drained in-process
  with ``huey.dequeue()`` + ``huey.execute()`` in a tight loop (no consumer
  polling delays: huey's best case), with its default storage settings (the
  ratios use these), and once more with ``fsync=False`` for reference.

The kandevd store runs with ``synchronous=FULL`` (its default): every state
change of a run is on disk when its transaction returns. ``--sync`` changes
that for experiments. Requires the bench extra: ``pip install -e '.[bench]'``.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kandevd.bus import EventBus  # noqa: E402
from kandevd.config import Config, build_config  # noqa: E402
from kandevd.paths import HomeLayout  # noqa: E402
from kandevd.runqueue.live import Waker  # noqa: E402
from kandevd.runqueue.loop import QueueLoop  # noqa: E402
from kandevd.runqueue.service import RunQueue  # noqa: E402
from kandevd.runs.model import Run  # noqa: E402
from kandevd.runtime import AgentRuntime, ExecutionSpec, InProcessRunner  # noqa: E402
from kandevd.store.open import open_store  # noqa: E402
from kandevd.store.runs import RunRepository  # noqa: E402
from kandevd.store.sqlite import Store  # noqa: E402
from kandevd.timeutil import rfc3339, utc_now  # noqa: E402


def noop_agent(spec: ExecutionSpec) -> tuple[int, str | None, float | None]:
    return 0, None, None


@contextmanager
def temp_home() -> Iterator[Path]:
    folder = Path(tempfile.mkdtemp(prefix="kandevd-bench-"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def seed_agents(store: Store, count: int) -> list[str]:
    now = rfc3339(utc_now())
    agents = [f"agent{i:03d}" for i in range(count)]
    with store.transaction() as conn:
        conn.execute("INSERT INTO workspaces (id, name, office_workflow_id, created_at,"
                     " updated_at) VALUES ('bench', 'bench', '', ?, ?)", (now, now))
        conn.executemany("INSERT INTO agents (id, workspace_id, name, profile, cooldown_s,"
                         " status, created_at, updated_at)"
                         " VALUES (?, 'bench', ?, 'default', 0, 'active', ?, ?)",
                         [(a, a, now, now) for a in agents])
    return agents


@dataclass
class Bench:
    """One kandevd queue wired like the daemon wires it, on a temp database."""

    store: Store
    runtime: AgentRuntime
    queue: RunQueue
    loop: QueueLoop
    bus: EventBus
    agents: list[str]

    @classmethod
    def build(cls, home: Path, *, agents: int, config: Config, sync: str) -> Bench:
        store = open_store(home / "kandevd.db", synchronous=sync)
        names = seed_agents(store, agents)
        waker = Waker()
        runtime = AgentRuntime(config.runtime.max_concurrent, config.runtime.stop_grace_s,
                               runner=InProcessRunner(noop_agent), on_slot_free=waker)
        bus = EventBus()
        queue = RunQueue(RunRepository(store, "bench"), runtime, config, HomeLayout(home), bus,
                         waker=waker)
        loop = QueueLoop(queue, safety_interval_s=config.queue.safety_interval_s,
                         max_claims_per_tick=config.queue.max_claims_per_tick)
        return cls(store, runtime, queue, loop, bus, names)

    def enqueue(self, i: int) -> Run:
        agent = self.agents[i % len(self.agents)]
        return self.queue.enqueue(workspace_id="bench", agent_id=agent, reason="bench",
                                  payload={"i": i}, coalesce=False).run

    def close(self) -> None:
        self.loop.stop()
        self.runtime.stop()
        self.bus.close()
        self.store.close()


class Counter:
    """Counts bus events and lets the caller wait for a total."""

    def __init__(self, bus: EventBus, topic: str,
                 on_event: Callable[[dict[str, Any]], None] | None = None) -> None:
        self._cond = threading.Condition()
        self.count = 0
        self._on_event = on_event
        bus.subscribe(topic, self._seen)

    def _seen(self, _topic: str, data: Any) -> None:
        if self._on_event is not None:
            self._on_event(data)
        with self._cond:
            self.count += 1
            self._cond.notify_all()

    def wait_for(self, total: int, timeout: float = 600.0) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: self.count >= total, timeout):
                raise RuntimeError(f"only {self.count} of {total} events within {timeout}s")


def bench_enqueue(n: int, config: Config, sync: str) -> float:
    with temp_home() as home:
        bench = Bench.build(home, agents=100, config=config, sync=sync)
        try:
            started = time.perf_counter()
            for i in range(n):
                bench.enqueue(i)
            elapsed = time.perf_counter() - started
        finally:
            bench.close()
    return n / elapsed


def bench_drain(n: int, agents: int, config: Config, sync: str) -> tuple[float, int]:
    with temp_home() as home:
        bench = Bench.build(home, agents=agents, config=config, sync=sync)
        try:
            bench.queue.wake.enabled = False  # queue everything first, loop not running
            for i in range(n):
                bench.enqueue(i)
            bench.queue.wake.enabled = True
            done = Counter(bench.bus, "run.finished")
            statements = bench.store.statements
            started = time.perf_counter()
            bench.loop.start()
            done.wait_for(n)
            elapsed = time.perf_counter() - started
            per_run = round((bench.store.statements - statements) / n)
            left = bench.store.query_one(
                "SELECT COUNT(*) FROM runs WHERE status != 'finished'")[0]
            if left:
                raise RuntimeError(f"{left} run(s) not finished after the drain")
        finally:
            bench.close()
    return n / elapsed, per_run


def bench_wake(samples: int, config: Config, sync: str) -> list[float]:
    latencies: list[float] = []
    with temp_home() as home:
        bench = Bench.build(home, agents=1, config=config, sync=sync)
        claimed_at: dict[str, float] = {}

        def on_claimed(data: dict[str, Any]) -> None:
            claimed_at[data["run"].id] = time.perf_counter()

        claimed = Counter(bench.bus, "run.claimed", on_claimed)
        done = Counter(bench.bus, "run.finished")
        try:
            bench.loop.start()
            for i in range(samples):
                while bench.loop.ticks == 0 or bench.runtime.active:
                    time.sleep(0.0005)  # let the loop go idle: measure a real wake-up
                time.sleep(0.002)
                run = bench.enqueue(i)
                returned = time.perf_counter()
                claimed.wait_for(i + 1)
                done.wait_for(i + 1)
                latencies.append(claimed_at[run.id] - returned)
        finally:
            bench.close()
    return latencies


def bench_huey(n: int, fsync: bool | None = None) -> tuple[float, float, Any]:
    """Enqueue and drain rates of SqliteHuey; ``fsync`` None = huey's default storage."""
    from huey import SqliteHuey

    with temp_home() as home:
        huey = SqliteHuey("bench", filename=str(home / "huey.db"), fsync=fsync)

        @huey.task()
        def noop(i: int) -> None:
            return None

        sync = huey.storage.conn.execute("PRAGMA synchronous").fetchone()[0]
        started = time.perf_counter()
        for i in range(n):
            noop(i)
        enqueue_rate = n / (time.perf_counter() - started)
        executed = 0
        started = time.perf_counter()
        while (task := huey.dequeue()) is not None:
            huey.execute(task)
            executed += 1
        drain_rate = executed / (time.perf_counter() - started)
        if executed != n:
            raise RuntimeError(f"huey executed {executed} of {n} tasks")
        huey.storage.close()
    return enqueue_rate, drain_rate, {0: "OFF", 1: "NORMAL", 2: "FULL", 3: "EXTRA"}.get(sync)


def percentile(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(pct / 100 * len(ordered)) - 1))
    return ordered[index]


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import sqlite3

    return (f"{os.cpu_count()} cores ({cpu}), Python {platform.python_version()}, "
            f"SQLite {sqlite3.sqlite_version}, {platform.system()} {platform.release()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=2000, help="runs/tasks per measurement")
    parser.add_argument("--samples", type=int, default=300, help="wake latency samples")
    parser.add_argument("--max-concurrent", type=int, default=4,
                        help="runtime.max_concurrent (the daemon default is 4)")
    parser.add_argument("--many", type=int, default=100, help="agents in the many-agent drain")
    parser.add_argument("--sync", default="FULL", choices=["OFF", "NORMAL", "FULL"],
                        help="PRAGMA synchronous of the kandevd store (default FULL)")
    args = parser.parse_args(argv)
    config = build_config({"runtime": {"max_concurrent": args.max_concurrent}}, environ={})
    q = config.queue

    print(f"machine: {machine()}")
    print(f"N={args.n}  kandevd: synchronous={args.sync}, max_concurrent="
          f"{args.max_concurrent}, max_claims_per_tick={q.max_claims_per_tick}")
    enqueue = bench_enqueue(args.n, config, args.sync)
    print(f"kandevd enqueue           {enqueue:10.0f} runs/s")
    drain_1, stmts_1 = bench_drain(args.n, 1, config, args.sync)
    print(f"kandevd drain, 1 agent    {drain_1:10.0f} runs/s  ({stmts_1} SQL statements/run)")
    drain_many, stmts_many = bench_drain(args.n, args.many, config, args.sync)
    print(f"kandevd drain, {args.many} agents {drain_many:10.0f} runs/s  "
          f"({stmts_many} SQL statements/run)")
    wake = bench_wake(args.samples, config, args.sync)
    p50, p99 = percentile(wake, 50) * 1e3, percentile(wake, 99) * 1e3
    print(f"kandevd wake latency      p50 {p50:.2f} ms  p99 {p99:.2f} ms  "
          f"(max {max(wake) * 1e3:.2f} ms, {len(wake)} samples)")
    h_enqueue, h_drain, h_sync = bench_huey(args.n)
    print(f"huey SqliteHuey (synchronous={h_sync}, in-process dequeue+execute)")
    print(f"huey enqueue              {h_enqueue:10.0f} tasks/s")
    print(f"huey drain                {h_drain:10.0f} tasks/s")
    f_enqueue, f_drain, f_sync = bench_huey(args.n, fsync=False)
    print(f"huey SqliteHuey fsync=False (synchronous={f_sync}, not durable), for reference")
    print(f"huey enqueue              {f_enqueue:10.0f} tasks/s")
    print(f"huey drain                {f_drain:10.0f} tasks/s")
    print(f"ratios kandevd/huey (both synchronous={h_sync}):" if h_sync == args.sync
          else f"ratios kandevd (synchronous={args.sync}) / huey (synchronous={h_sync}):")
    print(f"  enqueue                 {enqueue / h_enqueue:6.2f}x")
    print(f"  drain, 1 agent          {drain_1 / h_drain:6.2f}x")
    print(f"  drain, {args.many} agents{'':<{9 - len(str(args.many))}}"
          f"{drain_many / h_drain:6.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
