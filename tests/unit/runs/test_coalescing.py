"""The queue's policies the store is handed: the coalescing rules and the attempt limit."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kandevd.runs.coalescing import RULES
from kandevd.runs.retry import attempt_limit

keys = st.one_of(st.none(), st.text(max_size=40),
                 st.text(max_size=20).map(lambda rest: "task_comment:" + rest))


@given(keys)
def test_a_comment_event_never_takes_part_in_a_merge(key: str | None) -> None:
    assert RULES.may_merge(key) == (key is None or not key.startswith("task_comment:"))


@given(st.text(max_size=30))
def test_only_assignments_merge_within_one_task(reason: str) -> None:
    assert RULES.per_task(reason) == (reason == "task_assigned")


@given(st.integers(1, 20), st.integers(0, 30), st.text(max_size=30))
def test_past_the_limit_a_run_gives_up_with_its_last_error(limit: int, attempt: int,
                                                           last: str) -> None:
    words = attempt_limit(limit)(attempt, last)
    if attempt < limit:
        assert words is None
    else:
        assert words == f"gave up after {attempt} attempts; last: {last or 'unknown'}"
