"""The event hub's pure parts: patterns, a subscription's bounded buffer and what it
tells of its losses, the feed from the bus, and the relay's order across daemons."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from kandevd.events.feed import EventFeed
from kandevd.events.hub import EventHub, Subscription
from kandevd.events.relay import EventRelay
from kandevd.events.topics import NAMES, bad_pattern, matches
from kandevd.timeutil import rfc3339, utc_now

WORDS = st.sampled_from(sorted(NAMES))


@given(WORDS)
def test_a_topic_matches_itself_its_prefixes_and_the_star(topic: str) -> None:
    assert matches(topic, topic) and matches("*", topic)
    parts = topic.split(".")
    for n in range(1, len(parts)):
        assert matches(".".join(parts[:n]) + ".*", topic)
    assert not matches(topic + ".*", topic)
    assert bad_pattern(topic) is None


def test_a_pattern_that_can_match_nothing_is_refused_with_its_reason() -> None:
    assert bad_pattern("run.*") is None and bad_pattern("office.run.*") is None
    assert bad_pattern("*") is None
    assert bad_pattern("runs.*") == "'runs.*' matches no topic"
    assert bad_pattern("run.*.x") == "'run.*.x' is not a topic or a 'prefix.*' pattern"
    assert bad_pattern("Run.Queued") is not None


def decoded(lines: list[bytes]) -> list[Any]:
    out: list[Any] = []
    for line in lines:
        message = json.loads(line)
        out.append(("lost", message["params"]["count"]) if message["method"] == "events.lost"
                   else message["params"]["data"]["n"])
    return out


@given(st.lists(st.one_of(st.just("take"), st.integers(0, 1000)), max_size=60),
       st.integers(1, 5))
def test_a_buffer_keeps_order_and_tells_every_loss_once_where_it_happened(
        steps: list[Any], capacity: int) -> None:
    hub = EventHub()
    subscription = hub.subscribe(["run.*"], capacity=capacity)
    sent, received = 0, []
    for step in [*steps, "take"]:
        if step == "take":
            hub.flush()
            received += decoded(subscription.take(0))
        else:
            hub.deliver("run.queued", "t", {"n": sent})
            sent += 1
            if step % 3 == 0:  # (the hub's thread hands events on in batches of any size)
                hub.flush()
    numbers = [item for item in received if not isinstance(item, tuple)]
    lost = sum(item[1] for item in received if isinstance(item, tuple))
    assert numbers == sorted(numbers) and len(set(numbers)) == len(numbers)
    assert len(numbers) + lost == sent == len(numbers) + subscription.lost_total
    # a loss is told before the events that came after it
    seen_until = -1
    for item in received:
        if isinstance(item, tuple):
            assert item[1] >= 1
        else:
            seen_until = item
    assert seen_until == (numbers[-1] if numbers else -1)


def test_only_the_subscriptions_whose_patterns_match_get_an_event_encoded_once() -> None:
    hub = EventHub()
    runs, schedules = hub.subscribe(["run.*"]), hub.subscribe(["schedule.fired"])
    assert hub.listened and hub.count() == 2
    hub.deliver("run.claimed", "2026-12-07T00:00:00.000000Z", {"id": "r1"})
    assert runs.take(0) == []  # (handed on by the hub's thread, in batches)
    assert hub.flush() == 1
    [line] = runs.take(0)
    assert schedules.take(0) == []
    assert json.loads(line) == {"jsonrpc": "2.0", "method": "event", "params": {
        "topic": "run.claimed", "at": "2026-12-07T00:00:00.000000Z", "data": {"id": "r1"}}}
    hub.unsubscribe(runs)
    hub.deliver("run.claimed", "t", {"id": "r2"})
    hub.flush()
    assert runs.take(0) == [] and runs.closed and hub.count() == 1


def test_the_hubs_thread_hands_events_on_and_its_stop_hands_on_the_rest() -> None:
    hub = EventHub()
    subscription = hub.subscribe(["schedule.*"])
    hub.start()
    hub.deliver("schedule.fired", "t", {"id": "j"})
    assert len(subscription.take(10)) == 1  # (a lone event goes out at once)
    hub.stop()
    hub.deliver("schedule.fired", "t", {"id": "j"})
    hub.flush()
    assert len(subscription.take(0)) == 1


@dataclass
class FakeRun:
    id: str
    reason: str
    status: str = "queued"

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "reason": self.reason, "status": self.status}


def test_the_feed_sends_office_runs_under_the_office_subjects_too_and_nothing_unheard() -> None:
    got: list[tuple[str, dict[str, Any]]] = []
    listening = [False]
    feed = EventFeed(lambda topic, at, data: got.append((topic, dict(data))),
                     listened=lambda: listening[0],
                     office_reasons=frozenset({"task_assigned"}))
    feed.on_bus("run.queued", {"run": FakeRun("r0", "task_assigned")})
    assert got == []  # (nobody listens: nothing is built)
    listening[0] = True
    feed.on_bus("run.failed", {"run": FakeRun("r1", "task_assigned", "failed")})
    feed.on_bus("run.finished", {"run": FakeRun("r2", "manual", "finished")})
    feed.on_bus("schedule.session_ended", {"id": "w:s", "entry_id": "e", "status": "success"})
    feed.on_bus("task.updated", {"task": {}})
    assert [topic for topic, _ in got] == ["run.failed", "office.run.processed",
                                          "office.run.failed", "run.finished",
                                          "schedule.session_ended"]
    assert got[1][1] == {"id": "r1", "reason": "task_assigned", "status": "failed"}


def test_the_relay_hands_on_every_daemons_events_in_the_order_they_happened() -> None:
    delivered: list[tuple[str, str, str]] = []
    relay = EventRelay("postgresql://unused", "me", lambda topic, at, data:
                       delivered.append((at, topic, data["id"])), lambda _run_id: None)
    now = utc_now()
    first, second, third = (rfc3339(now + timedelta(microseconds=n)) for n in (100, 200, 300))
    relay.publish("run.claimed", second, {"id": "r1"})
    # another daemon's earlier event arrives later: it still goes first
    relay._received(json.dumps({"o": "other", "t": "run.queued", "a": first,
                                "d": {"id": "r1"}}))
    relay._received(json.dumps({"o": "me", "t": "run.claimed", "a": second,  # (its own:
                                "d": {"id": "r1"}}))                         # held already)
    relay._received("not json")
    relay._received(json.dumps({"o": "other", "t": "run.finished", "a": third,
                                "r": "r1"}))  # (too large, and gone when read: dropped)
    assert relay.flush() == 0  # (held a while first)
    assert relay.flush(hold_s=0.0) == 2
    assert delivered == [(first, "run.queued", "r1"), (second, "run.claimed", "r1")]
    assert relay._outgoing and json.loads(relay._outgoing[0])["o"] == "me"


def test_a_closed_subscription_takes_nothing_and_wakes_its_reader() -> None:
    subscription = Subscription("s", ["*"], capacity=2)
    subscription.offer(b"x\n")
    subscription.close()
    assert subscription.take(5) == [] and subscription.closed
