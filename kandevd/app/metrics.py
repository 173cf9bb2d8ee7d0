"""Prometheus metrics: ``daemon.metrics`` and the optional ``metrics.listen`` HTTP server.

Values are read at scrape time by a custom collector (from ``daemon.status()``
and the cron registry), on a private :class:`CollectorRegistry` (never the
global default one). The one thing observed as it happens is the execution
duration histogram (:meth:`DaemonMetrics.observe_execution`, called by the
run queue when an outcome is announced).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kandevd.app.cron_metrics import job_families
from kandevd.app.status import StatusDocument
from kandevd.office.loop import COUNTERS as OFFICE_COUNTERS
from kandevd.timeutil import parse_rfc3339, utc_now

log = logging.getLogger("kandevd.metrics")

DURATION_BUCKETS = (0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 1800, 3600, 7200)
WAIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0, 30.0,
                120.0, 600.0)


class _StatusCollector(Collector):
    """Turns one ``daemon.status()`` (plus the cron jobs' counters) into metric families.

    ``cron_jobs()``: ``(job, JobStatus)`` pairs of every scheduled job."""

    def __init__(self, status: Callable[[], StatusDocument],
                 cron_jobs: Callable[[], list[Any]]) -> None:
        self._status = status
        self._cron_jobs = cron_jobs

    def describe(self) -> list[Metric]:
        return []  # values come at scrape time; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        status = self._status()
        up = GaugeMetricFamily("kandevd_up", "1 while the daemon is running, 0 while stopping",
                               value=1 if status.get("state") == "running" else 0)
        yield up
        store = status.get("store") or {}
        yield GaugeMetricFamily("kandevd_store_degraded", "1 when the store is degraded",
                                value=1 if store.get("status") == "degraded" else 0)
        runtime = status.get("runtime") or {}
        yield GaugeMetricFamily("kandevd_runtime_slots_busy", "Agent executions running now",
                                value=runtime.get("active", 0))
        yield GaugeMetricFamily("kandevd_runtime_slots_max", "runtime.max_concurrent",
                                value=runtime.get("max_concurrent", 0))
        runs = status.get("runs")
        if runs is not None:
            yield from self._runs(runs)
        stats = status.get("stats") or {}
        queue = stats.get("queue")
        if queue:
            yield CounterMetricFamily("kandevd_queue_ticks", "Queue loop ticks",
                                      value=queue.get("ticks", 0))
            yield CounterMetricFamily("kandevd_claims", "Runs claimed since start",
                                      value=queue.get("claimed", 0))
            yield CounterMetricFamily("kandevd_outcomes_recorded",
                                      "Execution outcomes written since start",
                                      value=queue.get("outcomes", 0))
            yield CounterMetricFamily("kandevd_outcome_commits",
                                      "Group commits of outcomes since start",
                                      value=queue.get("outcome_commits", 0))
            yield CounterMetricFamily("kandevd_retries",
                                      "Failed attempts re-queued under the retry policy",
                                      value=queue.get("retries", 0))
            yield CounterMetricFamily("kandevd_rescued_claims",
                                      "Claims rescued: stale, or left by an earlier instance",
                                      value=queue.get("rescued", 0))
        office = stats.get("office")
        if office:
            yield CounterMetricFamily("kandevd_office_ticks", "Office loop ticks",
                                      value=office.get("ticks", 0))
            yield CounterMetricFamily("kandevd_office_handler_errors",
                                      "Office handler runs that raised",
                                      value=office.get("handler_errors", 0))
            scans = CounterMetricFamily("kandevd_office_handler_scans",
                                        "Office handler runs that scanned", labels=["handler"])
            skips = CounterMetricFamily("kandevd_office_handler_skips",
                                        "Office handler runs skipped (nothing configured)",
                                        labels=["handler"])
            actions = CounterMetricFamily("kandevd_office_handler_actions",
                                          "Runs queued or alerts sent by an Office handler",
                                          labels=["handler"])
            for handler, (scan_key, acted_key) in OFFICE_COUNTERS.items():
                scanned = office.get(scan_key, 0)
                scans.add_metric([handler], scanned)
                skips.add_metric([handler], max(office.get("ticks", 0) - scanned, 0))
                actions.add_metric([handler], office.get(acted_key, 0))
            yield scans
            yield skips
            yield actions
        cron = stats.get("cron")
        if cron:
            yield CounterMetricFamily("kandevd_cron_fires", "Cron fires since start",
                                      value=cron.get("fires", 0))
            yield CounterMetricFamily(
                "kandevd_cron_late_fires", "Cron occurrences no leader fired on time, fired "
                "late by this daemon after it took over the lease", value=cron.get("late_fires", 0))
            yield GaugeMetricFamily("kandevd_cron_late_fire_max_seconds",
                                    "The most late of those fires, in seconds",
                                    value=cron.get("late_max_s", 0.0))
            yield from job_families(self._cron_jobs())
        cluster = status.get("cluster")
        if cluster:
            yield GaugeMetricFamily("kandevd_cluster_leader", "1 while this daemon leads",
                                    value=1 if cluster.get("leader") else 0)
            yield GaugeMetricFamily("kandevd_cluster_fenced",
                                    "1 while this daemon is fenced (cut off from the database)",
                                    value=1 if cluster.get("fenced") else 0)

    @staticmethod
    def _runs(runs: dict[str, Any]) -> Iterator[Metric]:
        by_status = GaugeMetricFamily("kandevd_runs", "Runs by status", labels=["status"])
        for name, value in runs.items():
            if isinstance(value, int) and name not in ("unrecorded_outcomes", "adopted",
                                                       "retrying"):
                by_status.add_metric([name], value)
        yield by_status
        oldest = runs.get("oldest_queued_at")
        age = 0.0
        if oldest:
            age = max(0.0, (utc_now() - parse_rfc3339(oldest)).total_seconds())
        yield GaugeMetricFamily("kandevd_oldest_queued_age_seconds",
                                "Age of the oldest queued run ready to claim (0 when none "
                                "is): a run waiting for its retry back-off is not counted",
                                value=age)
        yield GaugeMetricFamily("kandevd_runs_retrying",
                                "Queued runs waiting for their retry back-off "
                                "(scheduled_retry_at)", value=runs.get("retrying", 0))
        yield GaugeMetricFamily("kandevd_unrecorded_outcomes",
                                "Outcomes the database has not accepted yet",
                                value=runs.get("unrecorded_outcomes", 0))
        yield CounterMetricFamily("kandevd_adopted_agents",
                                  "Agents adopted from an earlier instance since start",
                                  value=runs.get("adopted", 0))


class DaemonMetrics:
    """The daemon's metrics: a private registry and its text exposition."""

    def __init__(self, status: Callable[[], StatusDocument] | None = None,
                 cron_jobs: Callable[[], list[Any]] | None = None) -> None:
        """Observed from the first execution on; the status values come with ``status``,
        now or later through :meth:`collect` (the queue observes before status exists)."""
        self.registry = CollectorRegistry(auto_describe=False)
        if status is not None:
            self.collect(status, cron_jobs)
        self._durations = Histogram(
            "kandevd_execution_duration_seconds", "Wall time of agent executions",
            labelnames=["outcome"], buckets=DURATION_BUCKETS, registry=self.registry)
        self._queue_wait = Histogram(
            "kandevd_queue_wait_seconds",
            "From a run's request to its first claim (the wake latency when its agent was free)",
            buckets=WAIT_BUCKETS, registry=self.registry)

    def collect(self, status: Callable[[], StatusDocument],
                cron_jobs: Callable[[], list[Any]] | None = None) -> None:
        """Read ``status()`` (and the cron jobs' counters) at every scrape."""
        self.registry.register(_StatusCollector(status, cron_jobs or (lambda: [])))

    def observe_first_claim(self, requested_at: str, claimed_at: str) -> None:
        """A run's first claim: how long it waited from its request (never raises)."""
        try:
            waited = (parse_rfc3339(claimed_at) - parse_rfc3339(requested_at)).total_seconds()
            self._queue_wait.observe(max(waited, 0.0))
        except Exception:
            log.debug("queue wait not recorded", exc_info=True)

    def observe_execution(self, result: Any) -> None:
        """Record one ended execution (never raises: metrics must not break the queue)."""
        try:
            self._durations.labels(str(result.outcome)).observe(float(result.duration_s))
        except Exception:
            log.debug("execution duration not recorded", exc_info=True)

    def exposition(self) -> str:
        """The Prometheus text exposition format."""
        return generate_latest(self.registry).decode("utf-8")


class MetricsHTTPServer:
    """``/metrics`` and ``/health`` over HTTP in one non-daemon thread, joined at stop."""

    def __init__(self, address: tuple[str, int], metrics: DaemonMetrics,
                 healthy: Callable[[], tuple[bool, str]]) -> None:
        handler = _handler(metrics, healthy)
        # Binding here: a port in use fails the start (OSError), before any thread runs.
        self._server = ThreadingHTTPServer(address, handler)
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="kandevd-metrics-http", daemon=False)
        self._thread.start()
        log.info("metrics served on http://%s:%d/metrics", *self.address)

    def stop(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join()
            self._thread = None
        self._server.server_close()


def _handler(metrics: DaemonMetrics,
             healthy: Callable[[], tuple[bool, str]]) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "kandevd"

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                try:
                    body, code = metrics.exposition().encode("utf-8"), 200
                    ctype = CONTENT_TYPE_LATEST
                except Exception:
                    log.exception("metrics scrape failed")
                    body, code, ctype = b"scrape failed\n", 500, "text/plain; charset=utf-8"
            elif path == "/health":
                ok, why = healthy()
                body, code = (why + "\n").encode("utf-8"), 200 if ok else 503
                ctype = "text/plain; charset=utf-8"
            else:
                body, code, ctype = b"not found\n", 404, "text/plain; charset=utf-8"
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("metrics http: " + format, *args)

    return Handler
