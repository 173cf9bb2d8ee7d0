"""The fence's decision, stepped with an explicit clock: a daemon whose heartbeats stop
completing fences itself at fence_after_s (counted from when the last good one was sent),
once, heals on the next good one; and the timings the config accepts always end the
fence before peers take the daemon for dead."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kandevd.cluster.fence import Fence
from kandevd.cluster.timing import fence_timing, fencing_problem


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(after: float = 7.0, **kwargs: object) -> tuple[Fence, Clock, list[str], list[float]]:
    clock, fenced, healed = Clock(), [], []
    fence = Fence(fence_timing(10.0, after), on_fence=fenced.append, on_heal=healed.append,
                  clock=clock, **kwargs)  # type: ignore[arg-type]
    return fence, clock, fenced, healed


def test_it_fences_once_when_no_heartbeat_completed_for_fence_after_s() -> None:
    fence, clock, fenced, healed = make()
    sent = clock.now
    clock.now += 1.5  # the beat took 1.5 s; counted from its sending
    fence.beat_ok(sent)
    clock.now = sent + 6.9
    fence.tick(clock.now)
    assert fenced == [] and not fence.fenced
    clock.now = sent + 7.0
    fence.tick(clock.now)
    assert len(fenced) == 1 and "no heartbeat completed for 7.0s" in fenced[0]
    clock.now += 30
    fence.tick(clock.now)
    assert len(fenced) == 1  # once
    clock.now += 1
    fence.beat_ok(clock.now - 5)  # an old beat answered at last: no heal on its word
    fence.tick(clock.now)
    assert healed == [] and fence.fenced
    fence.beat_ok(clock.now - 0.1)  # a fresh one: the watchdog heals at its next look
    assert healed == []
    fence.tick(clock.now)
    assert healed == [31.0] and not fence.fenced
    fence.tick(clock.now)
    assert len(fenced) == 1


def test_a_late_answer_of_an_old_beat_does_not_move_the_clock_back() -> None:
    fence, clock, fenced, _ = make()
    fence.beat_ok(clock.now)
    fence.beat_ok(clock.now - 5)  # an older beat answered late
    clock.now += 6.9
    fence.tick(clock.now)
    assert fenced == []


def test_keep_running_never_fences() -> None:
    fence, clock, fenced, _ = make(enabled=False)
    clock.now += 3600
    fence.tick(clock.now)
    assert fenced == []


def test_the_tick_says_when_to_look_again() -> None:
    fence, clock, _, _ = make()
    fence.beat_ok(clock.now)
    assert 0 < fence.tick(clock.now) <= 0.2


@given(st.floats(0.1, 30), st.floats(0.2, 300), st.none() | st.floats(0.05, 300))
def test_accepted_timings_end_the_fence_before_peers_take_over(
        heartbeat: float, dead: float, after: float | None) -> None:
    if fencing_problem(heartbeat, dead, after, "fence") is None:
        timing = fence_timing(dead, after)
        assert timing.done_by_s <= dead + 1e-9
        assert timing.after_s >= 1.5 * heartbeat
    assert fencing_problem(heartbeat, dead, after, "keep_running") is None


def test_the_defaults_and_the_clear_refusals() -> None:
    assert fence_timing(10, None).after_s == 7.0
    assert fencing_problem(2, 10, None, "fence") is None
    too_long = fencing_problem(2, 10, 8, "fence")
    assert too_long is not None and "use at most 7" in too_long
    too_short = fencing_problem(2, 4, None, "fence")
    assert too_short is not None and "raise dead_after_s to at least 4.29" in too_short
    assert fencing_problem(2, 4.29, None, "fence") is None  # what it says is enough
    assert fencing_problem(2, 10.0007, None, "fence") is None  # (rounding down)
