"""The retry policy: what happens to a run whose attempt failed.

Pure functions of (policy, run, now, random draw) so the schedule can be
property-tested without a database. The queue hands :func:`retry_decider` to
the store, which applies the decision inside the outcome's transaction.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from datetime import datetime

from kandevd.config import RetryConfig
from kandevd.runs.model import FailedAttempt, RetryDecision, gave_up
from kandevd.timeutil import after

RetryDecider = Callable[[FailedAttempt], RetryDecision]
GiveUp = Callable[[int, str], "str | None"]
"""``give_up(attempt, last error)``: the dead letter's error message when a run whose
execution failed or was lost has used its attempts, else None (it may run again)."""


def attempt_limit(max_attempts: int) -> GiveUp:
    """``queue.max_attempts`` as the store is handed it: past it, no execution again."""
    def give_up(attempt: int, last: str) -> str | None:
        return gave_up(attempt, last) if attempt >= max_attempts else None
    return give_up


def retry_delay(policy: RetryConfig, retry_count: int, draw: float) -> float:
    """Delay before retry number ``retry_count + 1``; ``draw`` is uniform in [0, 1).

    ``delays_s[retry_count]`` (the last entry once the list runs out), plus
    up to ``jitter`` of itself.
    """
    base = policy.delays_s[min(retry_count, len(policy.delays_s) - 1)]
    return base * (1.0 + policy.jitter * draw)


def decide_retry(policy: RetryConfig, *, retry_count: int, requested_at: datetime,
                 now: datetime, draw: float | None = None) -> RetryDecision:
    if (now - requested_at).total_seconds() > policy.max_age_s:
        return RetryDecision("too_old")
    if retry_count >= policy.max_retries:
        return RetryDecision("fail")
    delay = retry_delay(policy, retry_count, random.random() if draw is None else draw)
    return RetryDecision("retry", after(now, delay), delay)


def retry_decider(policy: RetryConfig, *, draw: float | None = None) -> RetryDecider:
    """The decision for a failed attempt under ``policy`` (``draw``: a fixed jitter draw)."""
    def decide(failed: FailedAttempt) -> RetryDecision:
        return decide_retry(policy, retry_count=failed.retry_count,
                            requested_at=failed.requested_at, now=failed.now, draw=draw)
    return decide
