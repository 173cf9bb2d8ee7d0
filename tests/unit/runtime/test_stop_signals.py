"""Which agent exits a stop may have caused: a pure decision, checked over all codes."""

from __future__ import annotations

import signal

from hypothesis import given
from hypothesis import strategies as st

from kandevd.runtime.execution import STOP_SIGNALS, ended_by_stop_signal


@given(st.sampled_from(sorted(STOP_SIGNALS)))
def test_killed_by_or_exiting_after_a_stop_signal_counts(sig: int) -> None:
    assert ended_by_stop_signal(-sig)
    assert ended_by_stop_signal(128 + sig)


@given(st.integers(min_value=-64, max_value=255))
def test_nothing_else_counts(code: int) -> None:
    number = -code if code < 0 else code - 128
    assert ended_by_stop_signal(code) == (number in STOP_SIGNALS)
    if 0 <= code < 128:
        assert not ended_by_stop_signal(code)


def test_no_exit_code_and_other_signals_do_not_count() -> None:
    assert not ended_by_stop_signal(None)
    assert not ended_by_stop_signal(-signal.SIGSEGV)
    assert not ended_by_stop_signal(128 + signal.SIGABRT)
    assert ended_by_stop_signal(143) and ended_by_stop_signal(130)
