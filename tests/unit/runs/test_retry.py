"""The retry policy as pure functions, and the repository applying it.

``retry_delay``/``decide_retry`` take the random draw as an argument, so the
schedule ``delays_s[retry_count] * (1 + U(0, jitter))`` can be checked
exactly; the repository test checks the same schedule lands in the row.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kandevd.config import RetryConfig, build_config
from kandevd.runs.retry import decide_retry, retry_decider, retry_delay
from kandevd.store.open import open_store
from kandevd.store.runs import RunRepository
from kandevd.timeutil import parse_rfc3339
from tests.support.runs import T0, seed

policies = st.builds(
    RetryConfig,
    max_retries=st.integers(min_value=0, max_value=6),
    delays_s=st.lists(st.floats(min_value=0, max_value=1e5), min_size=1, max_size=5)
    .map(tuple),
    jitter=st.floats(min_value=0, max_value=2),
    max_age_s=st.floats(min_value=1, max_value=1e6),
)
draws = st.floats(min_value=0, max_value=1, exclude_max=True)


def test_the_default_policy_is_the_contracts() -> None:
    retry = build_config(None).retry
    assert retry == RetryConfig(max_retries=4, delays_s=(120, 600, 1800, 7200), jitter=0.25,
                                max_age_s=86400)


@pytest.mark.parametrize(("retry_count", "draw", "expected"), [
    (0, 0.0, 120.0), (0, 0.5, 135.0), (1, 0.0, 600.0), (2, 0.999, 1800 * 1.24975),
    (3, 0.2, 7200 * 1.05),
])
def test_default_schedule(retry_count: int, draw: float, expected: float) -> None:
    assert retry_delay(build_config(None).retry, retry_count, draw) == pytest.approx(expected)


@settings(max_examples=200, deadline=None)
@given(policy=policies, retry_count=st.integers(min_value=0, max_value=10), draw=draws)
def test_delay_is_the_listed_delay_plus_bounded_jitter(policy: RetryConfig, retry_count: int,
                                                       draw: float) -> None:
    base = policy.delays_s[min(retry_count, len(policy.delays_s) - 1)]
    delay = retry_delay(policy, retry_count, draw)
    assert delay == pytest.approx(base * (1 + policy.jitter * draw))
    assert base <= delay <= base * (1 + policy.jitter) + 1e-9


@settings(max_examples=200, deadline=None)
@given(policy=policies, retry_count=st.integers(min_value=0, max_value=10),
       age=st.floats(min_value=0, max_value=2e6), draw=draws)
def test_decision_follows_age_then_budget(policy: RetryConfig, retry_count: int, age: float,
                                          draw: float) -> None:
    now = T0 + timedelta(seconds=age)
    decision = decide_retry(policy, retry_count=retry_count, requested_at=T0, now=now, draw=draw)
    if (now - T0).total_seconds() > policy.max_age_s:
        assert decision.action == "too_old" and decision.retry_at is None
    elif retry_count >= policy.max_retries:
        assert decision.action == "fail" and decision.retry_at is None
    else:
        assert decision.action == "retry"
        assert decision.delay_s == retry_delay(policy, retry_count, draw)
        assert decision.retry_at == now + timedelta(seconds=decision.delay_s)


def test_random_draw_stays_within_the_jitter() -> None:
    policy = RetryConfig(max_retries=3, delays_s=(100.0,), jitter=0.25, max_age_s=1e6)
    delays = [decide_retry(policy, retry_count=0, requested_at=T0, now=T0).delay_s
              for _ in range(300)]
    assert all(d is not None and 100.0 <= d < 125.0 for d in delays)
    assert len(set(delays)) > 1  # it is random, not a constant


@settings(max_examples=25, deadline=None)
@given(draws_=st.lists(draws, min_size=3, max_size=3))
def test_repository_writes_the_policy_schedule(tmp_path_factory: pytest.TempPathFactory,
                                               draws_: list[float]) -> None:
    policy = RetryConfig(max_retries=3, delays_s=(5.0, 50.0, 500.0), jitter=0.5,
                         max_age_s=1e6)
    folder: Path = tmp_path_factory.mktemp("retry")
    store = open_store(folder / "kandevd.db", synchronous="OFF")
    try:
        seed(store, "ws1", "a1")
        repo = RunRepository(store, "boot")
        run_id = repo.enqueue(workspace_id="ws1", agent_id="a1", reason="r", now=T0).run.id
        now: datetime = T0
        for retry_count, draw in enumerate(draws_):
            claim = repo.claim_next(now)
            assert claim is not None
            updated = repo.fail_attempt(run_id, claim.token, now=now, error="x",
                                        decide=retry_decider(policy, draw=draw))
            assert updated is not None and updated.retry_count == retry_count + 1
            expected = now + timedelta(seconds=policy.delays_s[retry_count] * (1 + 0.5 * draw))
            retry_at = parse_rfc3339(updated.scheduled_retry_at)
            assert abs(retry_at - expected) <= timedelta(microseconds=1)
            assert retry_at.tzinfo == UTC
            now = retry_at
        claim = repo.claim_next(now)
        assert claim is not None
        final = repo.fail_attempt(run_id, claim.token, now=now, error="last",
                                  decide=retry_decider(policy))
        assert final is not None and final.status == "failed"
        assert final.error_message == "last"
    finally:
        store.close()
