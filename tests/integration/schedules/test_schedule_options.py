"""Schedules an operator can leave alone, through the real daemon: notifications (a
command and a webhook), pause after repeated failure, catch-up at start, backfill across
a DST change, timeouts, a start/end window and the ``replace`` overlap policy."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from kandevd.schedules.rules.options import jitter_delay
from kandevd.timeutil import parse_rfc3339, rfc3339, utc_now
from tests.support.daemon import DaemonProcess, run_cli
from tests.support.workflows import recorder_config, records, schedule, write_workflow

pytestmark = pytest.mark.integration

JOB = "workflow:w:s"


class Hook:
    """A loopback webhook: remembers every JSON body POSTed to it."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.arrived = threading.Condition()
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                self.send_response(204)
                self.end_headers()
                with hook.arrived:
                    hook.bodies.append(body)
                    hook.arrived.notify_all()

            def log_message(self, *_args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait(self, count: int, timeout: float = 30) -> list[dict[str, Any]]:
        with self.arrived:
            assert self.arrived.wait_for(lambda: len(self.bodies) >= count, timeout), \
                self.bodies
            return list(self.bodies)


@pytest.fixture
def hook() -> Iterator[Hook]:
    server = Hook()
    yield server
    server.server.shutdown()


@pytest.fixture
def start(tmp_path: Path, daemon_factory: Callable[..., DaemonProcess]
          ) -> Callable[..., tuple[DaemonProcess, Path]]:
    def make(schedules: list[dict[str, Any]], *, run: bool = True,
             config: dict[str, Any] | None = None) -> tuple[DaemonProcess, Path]:
        home = tmp_path / "home"
        write_workflow(home / "workspace", "w", schedules, groups=("g1",))
        record = tmp_path / "record.jsonl"
        return daemon_factory({**recorder_config(record), **(config or {})}, home=home,
                              start=run), record
    return make


def runs(daemon: DaemonProcess, count: int, job_id: str = JOB, timeout: float = 30
         ) -> list[dict[str, Any]]:
    """The job's history once it has ``count`` entries, none running; newest first."""
    def done() -> list[dict[str, Any]] | None:
        items = daemon.call("scheduler.jobs.runs", {"id": job_id})["items"]
        ok = len(items) >= count and all(e["status"] != "running" for e in items)
        return items if ok and not daemon.call("scheduler.jobs.get", {"id": job_id})[
            "running"] else None
    result: list[dict[str, Any]] = daemon.wait_until(done, what=f"{count} run(s)",
                                                     timeout=timeout)
    return result


def test_failures_are_announced_to_a_command_and_a_webhook_without_delaying_runs(
        start, hook: Hook, tmp_path: Path) -> None:
    marker = tmp_path / "notified.jsonl"
    hangs = [sys.executable, "-c", "import sys, time\n"
             f"open({str(marker)!r}, 'a').write(sys.stdin.read() + '\\n')\n"
             "time.sleep(60)"]
    daemon, _ = start([schedule("s", messages=["FAILONCE"]),
                       schedule("h", messages=["FAIL"], notify={"command": hangs})],
                      config={"scheduler": {"notify": {"webhook": hook.url}}})
    daemon.call("scheduler.jobs.trigger", {"id": "s"})
    [failed] = runs(daemon, 1)
    [body] = hook.wait(1)
    assert body["event"] == "failure" and body["job_id"] == JOB
    assert body["id"] == failed["id"] and body["status"] == "error"
    assert "WARNING" in daemon.wait_for_line(f"of {JOB} ended: error")
    daemon.call("scheduler.jobs.trigger", {"id": "s"})
    runs(daemon, 2)
    assert hook.wait(2)[1]["event"] == "recovery"
    notified = daemon.wait_until(lambda: (e := daemon.call("scheduler.jobs.runs", {
        "id": JOB})["items"])[1].get("notified") and e, what="the outcome recorded")
    assert notified[1]["notified"]["ok"] is True

    # a notifier that hangs holds up neither the schedule nor the next session
    daemon.call("scheduler.jobs.trigger", {"id": "h"})
    first = runs(daemon, 1, "workflow:w:h")[0]
    daemon.wait_until(marker.exists, what="the hanging notifier started")
    daemon.call("scheduler.jobs.trigger", {"id": "h"})
    second = runs(daemon, 2, "workflow:w:h")[0]
    gap = parse_rfc3339(second["started_at"]) - parse_rfc3339(first["completed_at"])
    assert gap < timedelta(seconds=5)
    timed_out = daemon.wait_until(
        lambda: (e := daemon.call("scheduler.jobs.runs", {"id": "workflow:w:h"})["items"][-1]
                 ).get("notified") and e, what="the notifier's timeout", timeout=30)
    assert timed_out["notified"] == {**timed_out["notified"], "ok": False,
                                     "error": "command timed out after 10s"}


def test_repeated_failures_pause_the_job_and_enable_resumes_it(start) -> None:
    daemon, _ = start([schedule("s", messages=["FAIL"], pause_after_failures=2)])
    for count in (1, 2):
        daemon.call("scheduler.jobs.trigger", {"id": "s"})
        runs(daemon, count)
    job = daemon.wait_until(lambda: (j := daemon.call("scheduler.jobs.get", {"id": JOB}))
                            ["state"] == "disabled" and j, what="the job paused")
    assert job["state_reason"].startswith("paused after 2 consecutive failures; last: ")
    assert job["next_run_at"] is None
    daemon.wait_for_line("paused after 2 consecutive failures")
    shown = run_cli(daemon.home, "jobs", "get", JOB)
    assert "paused after 2 consecutive failures" in shown.stdout
    enabled = run_cli(daemon.home, "jobs", "enable", JOB)
    assert enabled.returncode == 0, enabled.stderr
    job = daemon.call("scheduler.jobs.get", {"id": JOB})
    assert job["state"] == "scheduled" and job["enabled"] is True


def test_fires_missed_while_down_are_caught_up_once_at_start(start) -> None:
    daemon, record = start([schedule("s", "* * * * *", catchup_window_s=900)], run=False)
    alive = daemon.home / "workspace" / "config" / "scheduler.alive"
    alive.parent.mkdir(parents=True, exist_ok=True)
    alive.touch()
    # the last daemon looked at 3.5 minutes ago: three minute marks passed since
    seen = (utc_now() - timedelta(minutes=3, seconds=30)).timestamp()
    os.utime(alive, (seen, seen))
    daemon.start()
    # (a minute's own fire may follow it: the catch-up run is the one that matters)
    entry = next(e for e in runs(daemon, 1) if e["trigger_source"] == "catchup")
    assert entry["status"] == "success"
    assert len(entry["fire_times"]) in (3, 4)  # 3, or 4 if a minute turned meanwhile
    assert records(record)[0]["stdin"]["triggered_by"] == "catchup"
    assert daemon.call("scheduler.jobs.get", {"id": JOB})["missed_while_down"] >= 3


def test_a_backfill_over_a_dst_change(start) -> None:
    daemon, record = start([schedule("s", "30 2 * * *", timezone="Europe/Berlin")])
    dry = run_cli(daemon.home, "jobs", "backfill", JOB, "--from", "2026-03-28T00:00:00Z",
                  "--to", "2026-03-30T12:00:00Z", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.splitlines() == [
        "2026-03-28T01:30:00.000000Z  2026-03-28T02:30:00+01:00",
        "2026-03-29T01:00:00.000000Z  2026-03-29T03:00:00+02:00",
        "2026-03-30T00:30:00.000000Z  2026-03-30T02:30:00+02:00",
        "3 fire time(s); dry run: nothing run"]
    assert daemon.call("scheduler.jobs.runs", {"id": JOB})["total"] == 0
    real = run_cli(daemon.home, "jobs", "backfill", JOB, "--from", "2026-03-28T00:00:00Z",
                   "--to", "2026-03-30T12:00:00Z")
    assert real.returncode == 0 and real.stdout.endswith("3 fire time(s); started\n")
    entries = list(reversed(runs(daemon, 3)))
    assert [e["trigger_source"] for e in entries] == ["backfill"] * 3
    assert [e["intended_at"] for e in entries] == [
        "2026-03-28T01:30:00.000000Z", "2026-03-29T01:00:00.000000Z",
        "2026-03-30T00:30:00.000000Z"]
    stdins = [r["stdin"] for r in records(record) if r["stdin"]["turn"]["index"] == 0]
    assert [s["intended_at"] for s in stdins] == [e["intended_at"] for e in entries]
    too_far = run_cli(daemon.home, "jobs", "backfill", JOB, "--from", "2020-01-01T00:00:00Z",
                      "--to", "2026-01-01T00:00:00Z")
    assert too_far.returncode == 1 and too_far.stderr.strip() == (
        "kandevd: --to: the range from --from holds more than 1000 fire times; narrow it")


def test_a_session_past_its_timeout_ends_in_error(start) -> None:
    daemon, record = start([schedule("s", messages=["SLEEP", "never"], timeout_s=1)])
    daemon.call("scheduler.jobs.trigger", {"id": "s"})
    [entry] = runs(daemon, 1)
    assert (entry["status"], entry["error"]) == ("error", "timed out after 1s")
    assert [r["stdin"]["message"] for r in records(record)] == ["SLEEP"]
    assert records(record)[0]["terminated"] is True


def test_a_window_makes_a_job_wait_to_begin_or_end(start) -> None:
    now = utc_now().replace(microsecond=0)
    daemon, _ = start([
        schedule("later", "0 * * * *", start_at=rfc3339(now + timedelta(days=2))),
        schedule("over", "0 * * * *", end_at=rfc3339(now - timedelta(days=1)))])
    later = daemon.call("scheduler.jobs.get", {"id": "later"})
    assert later["state"] == "scheduled" and "begins at" in later["state_reason"]
    assert parse_rfc3339(later["next_run_at"]) >= now + timedelta(days=2)
    over = daemon.call("scheduler.jobs.get", {"id": "over"})
    assert (over["state"], over["next_run_at"]) == ("ended", None)
    assert " ended " in run_cli(daemon.home, "jobs", "list").stdout


def test_replace_stops_the_running_session_for_the_cron_fire(start) -> None:
    # Begin half-way through a minute: the agent must have set up its SIGTERM handler
    # (and so record that it was terminated) before the minute's cron fire replaces it,
    # and the fire must come well within the agent's 60 s of sleep, even on a machine
    # whose wall clock jumps (a virtual machine paused a few seconds: seen in CI).
    into_minute = utc_now().second + utc_now().microsecond / 1e6
    if not 30 <= into_minute <= 40:
        time.sleep((30.5 - into_minute) % 60)
    daemon, record = start([schedule("s", "* * * * *", messages=["SLEEP"],
                                      overlap_policy="replace")])
    started = daemon.call("scheduler.jobs.trigger", {"id": "s"})
    replaced = daemon.wait_until(
        lambda: (items := daemon.call("scheduler.jobs.runs", {"id": JOB})["items"])
        and items[-1]["status"] == "stopped" and items[-1], what="the replacing fire",
        timeout=90)
    assert replaced["session_id"] == started["session_id"]
    assert replaced["error"].startswith("stopped: replaced by the fire of ")
    newest = daemon.wait_until(
        lambda: (items := daemon.call("scheduler.jobs.runs", {"id": JOB})["items"])
        and len(items) == 2 and items[0], what="the new session")
    assert newest["trigger_source"] == "cron"
    daemon.call("scheduler.jobs.stop", {"id": JOB})
    assert records(record)[0]["terminated"] is True


@pytest.mark.parametrize("stop", ["sigint", "kill9"])
def test_a_jittered_fire_pending_at_a_restart_runs_once_at_its_own_time(
        start, tmp_path: Path, stop: str) -> None:
    """A fire came due and waits for its jitter when the daemon stops (gracefully, or is
    SIGKILLed); the next daemon, back before the fire's start, starts it then, once, and
    says so in ``next_run_at`` meanwhile."""
    jitter = 59
    # the next minute, far enough ahead for a start; a schedule id whose delay for that
    # minute leaves time to stop and start a daemon before the fire starts
    minute = (utc_now() + timedelta(seconds=70)).replace(second=0, microsecond=0)
    schedule_id = next(f"j{n}" for n in range(10_000)
                       if jitter_delay(f"workflow:w:j{n}", minute, jitter)
                       >= timedelta(seconds=40))
    job_id = f"workflow:w:{schedule_id}"
    begins = minute + jitter_delay(job_id, minute, jitter)
    daemon, _record = start([schedule(schedule_id, "* * * * *", jitter_s=jitter,
                                      workshop_mode="workshop")])
    job = daemon.call("scheduler.jobs.get", {"id": job_id})
    assert job["next_run_at"] in (rfc3339(begins), rfc3339(  # (or the minute before's)
        minute - timedelta(minutes=1) + jitter_delay(job_id, minute - timedelta(minutes=1),
                                                     jitter)))
    alive = daemon.home / "workspace" / "config" / "scheduler.alive"
    daemon.wait_until(lambda: alive.stat().st_mtime >= minute.timestamp(),
                      what="the fire of the minute come due", timeout=120)
    if stop == "sigint":
        assert daemon.stop() == 0
    else:
        daemon.kill_daemon_only()
    daemon.start()
    assert utc_now() < begins, "the restart took longer than the fire's delay"
    job = daemon.call("scheduler.jobs.get", {"id": job_id})
    assert job["next_run_at"] == rfc3339(begins) and job["missed_while_down"] == 0

    def of_the_minute() -> list[dict[str, Any]]:
        return [e for e in daemon.call("scheduler.jobs.runs", {"id": job_id})["items"]
                if e.get("intended_at") == rfc3339(minute)]
    [entry] = daemon.wait_until(of_the_minute, what="the pending fire started",
                                timeout=120)
    assert entry["trigger_source"] == "cron"
    assert parse_rfc3339(entry["started_at"]) >= begins
    runs(daemon, 1, job_id)
    assert len(of_the_minute()) == 1
