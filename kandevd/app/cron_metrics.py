"""The scheduled jobs as Prometheus series: workflow jobs and product jobs alike.

Workflow jobs are labelled ``job``; product jobs get the same series under
``kandevd_product_job_*`` labelled ``job``, ``product`` and ``user``. A
directory of thousands of users would make as many series per product job,
so at most :data:`MAX_PRODUCT_SERIES` (job, user) pairs get their own: the
rest are summed per job under ``user="(other)"``, never a real user's id
(counters summed, the failure streak and the last success their maximum, the
next fire the earliest). Jobs are also counted by state (``kandevd_cron_jobs{state}``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kandevd.timeutil import parse_rfc3339

#: At most this many (product job, user) pairs are exported one by one.
MAX_PRODUCT_SERIES = 1000
OTHER_USERS = "(other)"
SKIP_REASONS = ("overlap", "paused", "disabled", "unrecorded")


class _Families:
    """One set of job families (workflow jobs, or product jobs)."""

    def __init__(self, prefix: str, what: str, labels: list[str]) -> None:
        self.runs = CounterMetricFamily(f"{prefix}_runs",
                                        f"Sessions finished per {what} (history included)",
                                        labels=labels)
        self.skips = CounterMetricFamily(f"{prefix}_skips", f"Cron fires skipped per {what}",
                                         labels=[*labels, "reason"])
        self.failures = GaugeMetricFamily(f"{prefix}_consecutive_failures",
                                          f"Sessions in a row that ended in error, per {what}",
                                          labels=labels)
        self.last_success = GaugeMetricFamily(
            f"{prefix}_last_success_timestamp_seconds",
            f"When the {what}'s last successful session ended (Unix time; from the "
            "history after a restart)", labels=labels)
        self.next_fire = GaugeMetricFamily(
            f"{prefix}_next_fire_timestamp_seconds",
            f"When the {what} really fires next (Unix time; none while it would not fire)",
            labels=labels)

    def add(self, labels: list[str], row: dict[str, Any]) -> None:
        self.runs.add_metric(labels, row["runs"])
        for reason in SKIP_REASONS:
            self.skips.add_metric([*labels, reason], row[f"skipped_{reason}"])
        self.failures.add_metric(labels, row["failures"])
        if row["last_success"] is not None:
            self.last_success.add_metric(labels, row["last_success"])
        if row["next_fire"] is not None:
            self.next_fire.add_metric(labels, row["next_fire"])

    def families(self) -> Iterator[Metric]:
        yield from (self.runs, self.skips, self.failures, self.last_success, self.next_fire)


def _row(job: Any, status: Any) -> dict[str, Any]:
    state = job.state
    success = state.last_success_at
    return {"runs": state.run_count, "failures": state.consecutive_failures,
            **{f"skipped_{r}": getattr(state, f"skipped_{r}") for r in SKIP_REASONS},
            "last_success": _timestamp(success),
            "next_fire": status.next_run_at.timestamp() if status.next_run_at else None}


def _timestamp(text: str | None) -> float | None:
    """Unix time of an RFC 3339 text; None when there is none or it does not parse."""
    if not text:
        return None
    try:
        return parse_rfc3339(text).timestamp()
    except (ValueError, OverflowError, AttributeError):
        return None


def _merge(into: dict[str, Any], row: dict[str, Any]) -> None:
    into["runs"] += row["runs"]
    for reason in SKIP_REASONS:
        into[f"skipped_{reason}"] += row[f"skipped_{reason}"]
    into["failures"] = max(into["failures"], row["failures"])
    for key, pick in (("last_success", max), ("next_fire", min)):
        values = [v for v in (into[key], row[key]) if v is not None]
        into[key] = pick(values) if values else None


def job_families(jobs: Iterable[tuple[Any, Any]]) -> Iterator[Metric]:
    """The series of ``(job, JobStatus)`` pairs (see the module docstring)."""
    workflows = _Families("kandevd_cron_job", "cron job", ["job"])
    products = _Families("kandevd_product_job", "product job", ["job", "product", "user"])
    by_state: dict[str, int] = {}
    exported = 0
    others: dict[tuple[str, str], dict[str, Any]] = {}
    for job, status in jobs:
        by_state[status.state] = by_state.get(status.state, 0) + 1
        row = _row(job, status)
        if job.spec.entity_type != "product":
            workflows.add([job.key], row)
            continue
        product = job.spec.product.profile_id
        if exported < MAX_PRODUCT_SERIES:
            exported += 1
            products.add([job.id, product, job.user_id or ""], row)
        elif (job.id, product) in others:
            _merge(others[(job.id, product)], row)
        else:
            others[(job.id, product)] = row
    for (job_id, product), row in sorted(others.items()):
        products.add([job_id, product, OTHER_USERS], row)
    yield from workflows.families()
    yield from products.families()
    states = GaugeMetricFamily("kandevd_cron_jobs", "Scheduled jobs by state",
                               labels=["state"])
    for state, count in sorted(by_state.items()):
        states.add_metric([state], count)
    yield states
