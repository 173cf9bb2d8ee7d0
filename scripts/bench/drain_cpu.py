"""What one run costs the machine while the queue drains: rate and CPU per run.

Each round starts the real ``kandevd serve`` on a fresh home (SQLite, 100
agents, ``runtime.max_concurrent`` 4, ``/bin/true`` agents), queues ``--runs``
runs at once with ``runs.enqueue_many`` and times the drain until none is
queued or claimed. It prints the drain rate and, per run, the CPU time of the
daemon, of its keeper (``runtime.keeper.pid`` in ``daemon.status``; a version
without one has none), and of the agents' processes: the ``cutime``/``cstime``
of the keeper and of the daemon, which count every child each reaped (the
agent; under an older version, the shim and the agent). It also times
``/bin/true`` spawned directly (``posix_spawn`` and ``waitpid``), what the
agents' processes cost at the least.

``--baseline DIR`` names a checkout of another version of kandevd: the two
versions then alternate round by round (the baseline run from DIR's
sources, see ``benchdaemon.checkout_command``), and the ratios of the medians are printed last. This
machine's speed drifts by tens of percent within minutes, more than most
changes measured here.

The homes are kept until every round is done: deleting a drained home frees
thousands of inodes, and on ext4 without a journal each file created in the
following minute is slower for every one of them (docs/benchmarks.md), so one
round's clean-up would slow the next one. ``--delete-homes`` deletes each
round's home when it ends, as the black-box drain does, to measure just that.
``--one-by-one`` queues the runs with one ``runs.enqueue`` at a time while the
queue drains (the black-box benchmarks' intake). ``--threads`` also prints the
daemon's CPU per run for each of its threads (named by ``py-spy dump`` when
py-spy is installed). ``--spans`` also prints where a run's time went between
its claim and its record, from the home once the daemon stopped: claimed (the
run's ``claimed_at``) to its execution begun (``started_at`` in the keeper's
journal), begun to the exit seen by the keeper (the journal's exit ``at``), and
that to its outcome recorded (``finished_at``); medians over the runs the
journal still holds (it is compacted after 2,000 acknowledged exits).

Usage: .venv/bin/python scripts/bench/drain_cpu.py [--runs 1500] [--rounds 3] [--baseline DIR]
       [--one-by-one] [--delete-homes] [--threads] [--spans]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sqlite3
import statistics
import subprocess
import tempfile
from datetime import datetime
from pathlib import Path

import benchdaemon  # this folder (the script's own) is on sys.path

SPANS = ("claimed to begun", "begun to exit", "exit to recorded")
TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> tuple[float, float]:
    """(the process's own CPU seconds, its reaped children's)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return ((int(fields[11]) + int(fields[12])) * TICK_S,
            (int(fields[13]) + int(fields[14])) * TICK_S)


def thread_cpu(pid: int) -> dict[str, tuple[float, float]]:
    """(CPU seconds, of which system time) so far of each thread of ``pid``, by id."""
    seconds = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # (ended meanwhile)
        seconds[tid] = ((int(fields[11]) + int(fields[12])) * TICK_S, int(fields[12]) * TICK_S)
    return seconds


def thread_names(pid: int) -> dict[str, str]:
    """Python's names of the threads of ``pid`` (by thread id), from ``py-spy dump``."""
    spy = shutil.which("py-spy") or str(Path(os.sys.executable).with_name("py-spy"))
    try:
        dump = subprocess.run([spy, "dump", "-p", str(pid)], capture_output=True, text=True,
                              timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return dict(re.findall(r'Thread (\d+) \([^)]*\): "([^"]+)"', dump))


def drain(home: Path, runs: int, command: list[str], env: dict[str, str], *,
          one_by_one: bool = False, threads: bool = False,
          with_spans: bool = False) -> dict[str, float]:
    daemon = benchdaemon.Daemon(home, benchdaemon.DRAIN_CONFIG, command=command,
                                env=env).start()
    try:
        ws, agents = benchdaemon.bench_agents(daemon)
        client = daemon.client()
        assert daemon.proc is not None
        keeper = daemon.call("daemon.status")["runtime"].get("keeper", {}).get("pid")
        own0, children0 = cpu_s(daemon.proc.pid)
        keeper0, kept0 = cpu_s(keeper) if keeper else (0.0, 0.0)
        per_thread0 = thread_cpu(daemon.proc.pid) if threads else {}
        elapsed = benchdaemon.enqueue_and_drain(client, ws, agents, runs,
                                                one_by_one=one_by_one)
        own1, children1 = cpu_s(daemon.proc.pid)
        keeper1, kept1 = cpu_s(keeper) if keeper else (0.0, 0.0)
        figures = {"rate": runs / elapsed, "daemon_ms": (own1 - own0) * 1000 / runs,
                   "keeper_ms": (keeper1 - keeper0) * 1000 / runs,
                   "children_ms": (children1 - children0 + kept1 - kept0) * 1000 / runs}
        if threads:
            names = thread_names(daemon.proc.pid)
            for tid, (total, system) in thread_cpu(daemon.proc.pid).items():
                name = f"thread {names.get(tid, tid)}"
                total0, system0 = per_thread0.get(tid, (0.0, 0.0))
                if total > total0:
                    figures[name] = figures.get(name, 0.0) + (total - total0) * 1000 / runs
                    figures[name + " system"] = (figures.get(name + " system", 0.0)
                                                 + (system - system0) * 1000 / runs)
        client.close()
    finally:
        daemon.stop()
    if with_spans:
        figures.update(spans(home))
    return figures


def _epoch(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def spans(home: Path) -> dict[str, float]:
    """Median milliseconds of each of :data:`SPANS` over the runs of a stopped daemon's
    home (those whose spawn and exit its keeper's journal still holds)."""
    begun: dict[str, float] = {}
    ended: dict[str, float] = {}
    journal = home / "keeper" / "journal"
    for line in journal.read_text().splitlines() if journal.exists() else []:
        entry = json.loads(line)
        meta = entry.get("meta") or {}
        if entry.get("t") == "spawn" and meta.get("run_id") and meta.get("started_at"):
            begun[meta["run_id"]] = _epoch(meta["started_at"])
        elif entry.get("t") == "exit" and entry.get("at"):
            ended[entry["id"]] = float(entry["at"])
    run_of = {execution: execution.split(".")[0] for execution in ended}
    exits = {run_of[execution]: at for execution, at in ended.items()}
    parts: dict[str, list[float]] = {name: [] for name in SPANS}
    with sqlite3.connect(f"file:{home / 'kandevd.db'}?mode=ro", uri=True) as db:
        rows = db.execute("SELECT id, claimed_at, finished_at FROM runs"
                          " WHERE finished_at IS NOT NULL AND claimed_at IS NOT NULL").fetchall()
    for run_id, claimed_at, finished_at in rows:
        if run_id in begun and run_id in exits:
            claimed, start, end = _epoch(claimed_at), begun[run_id], exits[run_id]
            for name, value in zip(SPANS, (start - claimed, end - start,
                                           _epoch(finished_at) - end), strict=True):
                parts[name].append(value * 1000)
    return {f"span {name}": statistics.median(values)
            for name, values in parts.items() if values}


def direct_spawn_ms(count: int = 1500) -> float:
    """Children's CPU per ``/bin/true`` spawned directly and reaped: the floor."""
    before = os.times()
    for _ in range(count):
        os.waitpid(os.posix_spawn("/bin/true", ["/bin/true"], os.environ), 0)
    after = os.times()
    return ((after.children_user + after.children_system)
            - (before.children_user + before.children_system)) * 1000 / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", type=Path, help="a checkout of another version")
    parser.add_argument("--dir", type=Path, help="where the homes go (default: a temp folder)")
    parser.add_argument("--one-by-one", action="store_true",
                        help="one runs.enqueue at a time while the queue drains")
    parser.add_argument("--delete-homes", action="store_true",
                        help="delete each round's home when it ends")
    parser.add_argument("--threads", action="store_true",
                        help="the daemon's CPU per run, thread by thread")
    parser.add_argument("--spans", action="store_true",
                        help="where a run's time went from its claim to its record")
    args = parser.parse_args()
    versions: dict[str, tuple[list[str], dict[str, str]]] = {
        "this": (list(benchdaemon.KANDEVD), {})}
    if args.baseline is not None:
        versions["baseline"] = (benchdaemon.checkout_command(args.baseline), {})
    top = Path(tempfile.mkdtemp(prefix="drain-cpu-", dir=args.dir))
    results: dict[str, list[dict[str, float]]] = {name: [] for name in versions}
    try:
        for round_no in range(1, args.rounds + 1):
            order = list(versions) if round_no % 2 else list(reversed(versions))
            for name in order:
                command, env = versions[name]
                home = top / f"{name}-{round_no}" / "home"
                figures = drain(home, args.runs, command, env, one_by_one=args.one_by_one,
                                threads=args.threads, with_spans=args.spans)
                if args.delete_homes:
                    shutil.rmtree(home.parent, ignore_errors=True)
                results[name].append(figures)
                print(f"round {round_no} {name:8s} {figures['rate']:7.1f} runs/s; CPU per run: "
                      f"daemon {figures['daemon_ms']:.2f} ms, keeper "
                      f"{figures['keeper_ms']:.2f} ms, agents' processes "
                      f"{figures['children_ms']:.2f} ms", flush=True)
                for key in sorted(k for k in figures
                                  if k.startswith("thread ") and not k.endswith(" system")):
                    print(f"    {key}: {figures[key]:.3f} ms a run "
                          f"({figures[key + ' system']:.3f} system)", flush=True)
                if any(key.startswith("span ") for key in figures):
                    print("    median per run: " + ", ".join(
                        f"{name} {figures['span ' + name]:.2f} ms"
                        for name in SPANS if "span " + name in figures), flush=True)
    finally:
        shutil.rmtree(top, ignore_errors=True)
    medians = {name: {key: statistics.median(r[key] for r in rounds)
                      for key in ("rate", "daemon_ms", "keeper_ms", "children_ms")}
               for name, rounds in results.items()}
    for name, m in medians.items():
        print(f"median {name:8s} {m['rate']:7.1f} runs/s; daemon {m['daemon_ms']:.2f} ms/run, "
              f"keeper {m['keeper_ms']:.2f} ms/run, agents' processes "
              f"{m['children_ms']:.2f} ms/run")
    print(f"/bin/true spawned directly: {direct_spawn_ms():.2f} ms of its own CPU")
    if "baseline" in medians:
        this, base = medians["this"], medians["baseline"]
        print(f"ratio this/baseline: drain rate {this['rate'] / base['rate']:.2f}x, "
              f"daemon CPU per run {this['daemon_ms'] / base['daemon_ms']:.2f}x")
        # The agents' processes do the same work in every round, so their CPU per run
        # tells how fast the machine was then: each round's daemon CPU over it, this
        # version's over the baseline's of the same round, takes out the drift between
        # rounds that the medians above keep.
        paired = [(t["daemon_ms"] / t["children_ms"]) / (b["daemon_ms"] / b["children_ms"])
                  for t, b in zip(results["this"], results["baseline"], strict=True)
                  if t["children_ms"] > 0 and b["children_ms"] > 0 and b["daemon_ms"] > 0]
        if paired:
            print(f"daemon CPU per run, round by round, each scaled by its agents' CPU: "
                  f"{statistics.median(paired):.2f}x (median of {len(paired)}; "
                  + ", ".join(f"{r:.2f}" for r in paired) + ")")


if __name__ == "__main__":
    main()
