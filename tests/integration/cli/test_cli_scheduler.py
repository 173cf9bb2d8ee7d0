"""The scheduler as ``kandevd status``, ``kandevd metrics`` and the daemon-less commands show
it, through the real CLI and daemon."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.integration.schedules.test_products import brief, finished, write_product
from tests.support.daemon import DaemonProcess, run_cli
from tests.support.metrics import samples
from tests.support.workflows import recorder_config, schedule, write_workflow

pytestmark = pytest.mark.integration

PRODUCT_JOB = "product:helper:brief"


def test_status_shows_the_scheduler_and_metrics_cover_product_jobs(
        tmp_path: Path, daemon_factory: Callable[..., DaemonProcess]) -> None:
    home = tmp_path / "home"
    write_product(home / "workspace", [brief(messages=["one"])])
    write_workflow(home / "workspace", "w", [schedule("daily")], groups=("g1",))
    daemon = daemon_factory(recorder_config(tmp_path / "record.jsonl"), home=home)

    status = run_cli(home, "status")
    assert status.returncode == 0, status.stderr
    assert re.search(r"^scheduler firing$", status.stdout, re.M), status.stdout
    assert re.search(r"^jobs\s+2 scheduled$", status.stdout, re.M), status.stdout
    assert re.search(r"^sessions 0 running$", status.stdout, re.M), status.stdout
    run_cli(home, "scheduler", "pause", "--by", "ann")
    paused = run_cli(home, "status").stdout
    assert re.search(r"^scheduler PAUSED by ann since 20", paused, re.M), paused
    assert re.search(r"^jobs\s+2 paused$", paused, re.M), paused
    run_cli(home, "scheduler", "resume")

    daemon.call("scheduler.jobs.trigger", {"id": PRODUCT_JOB})
    finished(daemon, PRODUCT_JOB)
    labels = (("job", PRODUCT_JOB), ("product", "helper"), ("user", "local"))
    got = samples(run_cli(home, "metrics").stdout)
    assert got[("kandevd_product_job_runs_total", labels)] == 1
    assert got[("kandevd_product_job_consecutive_failures", labels)] == 0
    success = got[("kandevd_product_job_last_success_timestamp_seconds", labels)]
    assert got[("kandevd_cron_jobs", (("state", "scheduled"),))] == 2

    # after a restart the last success comes from the history, not from nothing
    assert daemon.stop() == 0
    daemon.start()
    again = samples(run_cli(home, "metrics").stdout)
    assert again[("kandevd_product_job_last_success_timestamp_seconds", labels)] == success
    assert again[("kandevd_product_job_runs_total", labels)] == 1


def test_daemon_less_commands_need_no_daemon(tmp_path: Path) -> None:
    home = tmp_path / "nobody-home"
    methods = run_cli(home, "methods")  # run_cli adds --home
    assert methods.returncode == 0 and "scheduler.jobs.next" in methods.stdout
    dry = run_cli(home, "jobs", "next", "--cron", "@daily", "--tz", "Europe/Paris",
                  "--count", "1", "--after", "2026-12-05T12:00:00Z")
    assert dry.returncode == 0, dry.stderr
    assert "2026-12-05T23:00:00.000000Z" in dry.stdout
    assert "2026-12-06T00:00:00+01:00" in dry.stdout
    needs_daemon = run_cli(home, "jobs", "next", "workflow:w:daily")
    assert needs_daemon.returncode == 69
