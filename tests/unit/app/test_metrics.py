"""kandevd.metrics: the exposition parses, values come from status, the HTTP server."""

from __future__ import annotations

import threading
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest

from kandevd.app import cron_metrics
from kandevd.app.metrics import DaemonMetrics, MetricsHTTPServer
from kandevd.app.status import health
from kandevd.config import ConfigError, build_config
from kandevd.schedules.jobs import JobFacts
from kandevd.schedules.rules.states import JobStatus
from kandevd.timeutil import rfc3339, utc_now
from tests.support.metrics import http_get, samples


def fake_status(**over: Any) -> dict[str, Any]:
    status: dict[str, Any] = {
        "state": "running",
        "runtime": {"active": 2, "max_concurrent": 4},
        "store": {"statements": 10, "status": "ok"},
        "runs": {"queued": 3, "claimed": 2, "finished": 7, "failed": 1, "cancelled": 0,
                 "unrecorded_outcomes": 1, "adopted": 2, "retrying": 1,
                 "oldest_queued_at": rfc3339(utc_now() - timedelta(seconds=90))},
        "stats": {"queue": {"ticks": 5, "claimed": 9, "outcome_commits": 4, "outcomes": 8},
                  "office": {"ticks": 3, "handler_errors": 1},
                  "cron": {"fires": 6}},
    }
    status.update(over)
    return status


def job(key: str, runs: int, overlap: int) -> tuple[SimpleNamespace, JobStatus]:
    state = JobFacts(run_count=runs, skipped_overlap=overlap)
    spec = SimpleNamespace(entity_type="workflow")
    return SimpleNamespace(key=key, state=state, spec=spec), JobStatus("scheduled", "", None)


def product_job(schedule: str, user: str, runs: int, failures: int = 0
                ) -> tuple[SimpleNamespace, JobStatus]:
    state = JobFacts(run_count=runs, consecutive_failures=failures)
    spec = SimpleNamespace(entity_type="product",
                           product=SimpleNamespace(profile_id="helper"))
    job_id = f"product:helper:{schedule}"
    return (SimpleNamespace(key=f"{job_id}@{user}", id=job_id, user_id=user, state=state,
                            spec=spec), JobStatus("held", "", None))


def test_product_jobs_get_the_same_series_with_a_cap_on_users(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cron_metrics, "MAX_PRODUCT_SERIES", 2)
    jobs = [product_job("checkin", user, runs=n, failures=n)
            for n, user in enumerate(["ann", "bob", "cy", "dee"], start=1)]
    metrics = DaemonMetrics(fake_status, lambda: [job("workflow:w:s", 1, 0), *jobs])
    got = samples(metrics.exposition())
    labels = (("job", "product:helper:checkin"), ("product", "helper"))
    assert got[("kandevd_product_job_runs_total", (*labels, ("user", "ann")))] == 1
    assert got[("kandevd_product_job_runs_total", (*labels, ("user", "bob")))] == 2
    # beyond the cap: summed under one label, the streak as its maximum
    assert got[("kandevd_product_job_runs_total", (*labels, ("user", "(other)")))] == 3 + 4
    assert got[("kandevd_product_job_consecutive_failures",
                (*labels, ("user", "(other)")))] == 4
    assert not any(key[0].startswith("kandevd_product") and ("user", "cy") in key[1]
                   for key in got)
    assert got[("kandevd_cron_jobs", (("state", "held"),))] == 4
    assert got[("kandevd_cron_jobs", (("state", "scheduled"),))] == 1


def test_exposition_parses_and_reads_status() -> None:
    metrics = DaemonMetrics(fake_status, lambda: [job("wf/nightly", 4, 2)])
    got = samples(metrics.exposition())
    assert got[("kandevd_up", ())] == 1
    assert got[("kandevd_runs", (("status", "queued"),))] == 3
    assert got[("kandevd_runs", (("status", "failed"),))] == 1
    assert ("kandevd_runs", (("status", "adopted"),)) not in got
    assert ("kandevd_runs", (("status", "retrying"),)) not in got  # (queued, not a status)
    assert got[("kandevd_runs_retrying", ())] == 1
    assert 89 <= got[("kandevd_oldest_queued_age_seconds", ())] < 200
    assert got[("kandevd_claims_total", ())] == 9
    assert got[("kandevd_outcomes_recorded_total", ())] == 8
    assert got[("kandevd_runtime_slots_busy", ())] == 2
    assert got[("kandevd_runtime_slots_max", ())] == 4
    assert got[("kandevd_unrecorded_outcomes", ())] == 1
    assert got[("kandevd_adopted_agents_total", ())] == 2
    assert got[("kandevd_office_ticks_total", ())] == 3
    assert got[("kandevd_office_handler_errors_total", ())] == 1
    assert got[("kandevd_cron_fires_total", ())] == 6
    assert got[("kandevd_cron_job_runs_total", (("job", "wf/nightly"),))] == 4
    assert got[("kandevd_cron_job_skips_total",
                (("job", "wf/nightly"), ("reason", "overlap")))] == 2
    assert got[("kandevd_store_degraded", ())] == 0


def test_values_are_read_at_scrape_time() -> None:
    state = {"active": 0}
    metrics = DaemonMetrics(lambda: fake_status(runtime={"active": state["active"],
                                                         "max_concurrent": 4}))
    assert samples(metrics.exposition())[("kandevd_runtime_slots_busy", ())] == 0
    state["active"] = 3
    assert samples(metrics.exposition())[("kandevd_runtime_slots_busy", ())] == 3


def test_missing_sections_are_left_out() -> None:
    metrics = DaemonMetrics(lambda: {"state": "stopping", "runtime": {}})
    got = samples(metrics.exposition())
    assert got[("kandevd_up", ())] == 0
    assert not any(name.startswith("kandevd_runs") for name, _ in got)
    assert ("kandevd_oldest_queued_age_seconds", ()) not in got


def test_execution_histogram_is_none_safe() -> None:
    metrics = DaemonMetrics(fake_status)
    metrics.observe_execution(SimpleNamespace(outcome="succeeded", duration_s=2.5))
    metrics.observe_execution(object())  # never raises
    got = samples(metrics.exposition())
    assert got[("kandevd_execution_duration_seconds_count", (("outcome", "succeeded"),))] == 1
    assert got[("kandevd_execution_duration_seconds_sum", (("outcome", "succeeded"),))] == 2.5


def test_two_instances_do_not_share_a_registry() -> None:
    first, second = DaemonMetrics(fake_status), DaemonMetrics(fake_status)
    first.observe_execution(SimpleNamespace(outcome="failed", duration_s=1.0))
    assert "outcome=\"failed\"" not in second.exposition()


def test_http_server_serves_metrics_and_health_and_joins() -> None:
    health = {"value": (True, "ok")}
    server = MetricsHTTPServer(("127.0.0.1", 0), DaemonMetrics(fake_status),
                               lambda: health["value"])
    server.start()
    try:
        host, port = server.address
        base = f"http://{host}:{port}"
        code, ctype, body = http_get(base + "/metrics")
        assert code == 200 and ctype.startswith("text/plain")
        assert samples(body)[("kandevd_up", ())] == 1
        assert http_get(base + "/health")[::2] == (200, "ok\n")
        health["value"] = (False, "stopping")
        assert http_get(base + "/health")[::2] == (503, "stopping\n")
        assert http_get(base + "/nope")[0] == 404
    finally:
        server.stop()
    assert not any(t.name == "kandevd-metrics-http" for t in threading.enumerate())


def test_port_in_use_is_an_oserror() -> None:
    first = MetricsHTTPServer(("127.0.0.1", 0), DaemonMetrics(fake_status), lambda: (True, "ok"))
    try:
        with pytest.raises(OSError):
            MetricsHTTPServer(first.address, DaemonMetrics(fake_status), lambda: (True, "ok"))
    finally:
        first.stop()


def test_daemon_health() -> None:
    assert health("running", None) == (True, "ok")
    assert health("stopping", None) == (False, "stopping")
    assert health("running", "disk full") == (False, "store degraded")


@pytest.mark.parametrize("listen", ["127.0.0.1:9464", "localhost:1", "[::1]:65535",
                                    "0.0.0.0:8080"])
def test_good_listen(listen: str) -> None:
    config = build_config({"metrics": {"listen": listen}}, environ={})
    assert config.metrics.listen == listen
    assert config.metrics.address is not None


@pytest.mark.parametrize("listen", ["127.0.0.1", "127.0.0.1:", ":9464", "host:0",
                                    "host:65536", "host:99999", "host:port", 9464, ""])
def test_bad_listen_is_a_config_error(listen: Any) -> None:
    with pytest.raises(ConfigError, match=r"metrics\.listen"):
        build_config({"metrics": {"listen": listen}}, environ={})


def test_metrics_default_off() -> None:
    config = build_config(None, environ={})
    assert config.metrics.listen is None and config.metrics.address is None


def test_cron_job_series_carry_failures_last_success_and_next_fire() -> None:
    from datetime import UTC, datetime
    from types import SimpleNamespace

    from prometheus_client.parser import text_string_to_metric_families

    from kandevd.app.metrics import DaemonMetrics
    from kandevd.schedules.jobs import JobFacts

    state = JobFacts()
    state.record({"status": "success", "started_at": "2026-12-01T10:00:00.000000Z",
                  "completed_at": "2026-12-01T10:00:05.000000Z"})
    state.record({"status": "error", "started_at": "2026-12-01T11:00:00.000000Z"})
    state.next_fire = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
    job = (SimpleNamespace(key="workflow:w:s", state=state,
                           spec=SimpleNamespace(entity_type="workflow")),
           JobStatus("scheduled", "", state.next_fire))
    status = {"state": "running", "runtime": {"active": 0, "max_concurrent": 4},
              "stats": {"cron": {"fires": 2},
                        "queue": {"ticks": 1, "claimed": 0, "outcomes": 0,
                                  "outcome_commits": 0, "retries": 3, "rescued": 1}}}
    metrics = DaemonMetrics(lambda: status, lambda: [job])
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(metrics.exposition())
               for s in family.samples}
    label = (("job", "workflow:w:s"),)
    assert samples[("kandevd_cron_job_consecutive_failures", label)] == 1
    assert samples[("kandevd_cron_job_last_success_timestamp_seconds", label)] == \
        datetime(2026, 12, 1, 10, 0, 5, tzinfo=UTC).timestamp()
    assert samples[("kandevd_cron_job_next_fire_timestamp_seconds", label)] == \
        state.next_fire.timestamp()
    assert samples[("kandevd_retries_total", ())] == 3
    assert samples[("kandevd_rescued_claims_total", ())] == 1


def test_queue_wait_histogram_and_office_handler_series() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from kandevd.app.metrics import DaemonMetrics

    status = {"state": "running", "runtime": {"active": 0, "max_concurrent": 4},
              "stats": {"office": {"ticks": 10, "handler_errors": 0, "recovery_scans": 4,
                                   "recovered": 2, "routine_scans": 0, "routine_fires": 0,
                                   "budget_scans": 10, "budget_alerts": 1}}}
    metrics = DaemonMetrics(lambda: status)
    metrics.observe_first_claim("2026-12-01T10:00:00.000000Z", "2026-12-01T10:00:00.003000Z")
    metrics.observe_first_claim("not a time", "2026-12-01T10:00:00Z")  # ignored, no raise
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(metrics.exposition())
               for s in family.samples}
    assert samples[("kandevd_queue_wait_seconds_count", ())] == 1
    assert samples[("kandevd_queue_wait_seconds_bucket", (("le", "0.005"),))] == 1
    assert samples[("kandevd_queue_wait_seconds_bucket", (("le", "0.0025"),))] == 0
    assert samples[("kandevd_office_handler_skips_total", (("handler", "recovery"),))] == 6
    assert samples[("kandevd_office_handler_scans_total", (("handler", "budgets"),))] == 10
    assert samples[("kandevd_office_handler_actions_total", (("handler", "recovery"),))] == 2
