"""The console's pure parts: Host and token checks, where a method's errors go on the
form, runs.explain in words, attempts read from a log, times and durations, SVG that
escapes what it draws, and the last day's activity read from the runs table."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kandevd.listen import is_loopback
from kandevd.store.open import open_store
from kandevd.store.runs import RunRepository
from kandevd.store.runs.activity import read_activity
from kandevd.timeutil import rfc3339
from kandevd.web.auth import Guard, split_host
from kandevd.web.charts import Lane, Series, line_chart, timeline
from kandevd.web.context import duration, time_element
from kandevd.web.views.runs import attempts_of, explain_in_words
from kandevd.web.views.schedule_form import place_errors, schedule_from
from tests.support.runs import T0, enqueue, seed


@pytest.mark.parametrize(("header", "name"), [
    ("localhost:7878", "localhost"), ("127.0.0.1", "127.0.0.1"), ("[::1]:80", "::1"),
    ("Example.COM:1", "example.com"), ("", None), ("a:b", None), ("[::1]x", None),
    ("[::1", None)])
def test_split_host(header: str, name: str | None) -> None:
    assert split_host(header) == name


@given(st.text(max_size=40))
def test_only_the_names_served_pass_the_host_check(header: str) -> None:
    guard = Guard("t" * 20, "127.0.0.1", ("console.internal",))
    if guard.host_allowed(header):
        assert split_host(header) in {"localhost", "127.0.0.1", "::1", "console.internal"}


def test_a_wildcard_listen_address_is_not_a_name_served() -> None:
    guard = Guard("secret-token", "0.0.0.0")
    assert not guard.host_allowed("0.0.0.0:7878")
    assert guard.host_allowed("localhost:7878")
    assert guard.token_matches("secret-token") and not guard.token_matches("secret")
    assert guard.cookie_matches([guard.cookie_value])
    assert not guard.cookie_matches(["secret-token"]) and not guard.cookie_matches([])
    assert guard.csrf_matches(guard.csrf_token) and not guard.csrf_matches(None)
    assert is_loopback("127.0.0.2") and is_loopback("::1") and not is_loopback("10.0.0.1")


def test_a_methods_problems_go_beside_their_fields() -> None:
    placed = place_errors(
        "workflow 'w': schedule 'x': timezone: unknown time zone 'Mars'; schedule 'x': "
        "group_ids: unknown group(s) 'nope' (available: g1)")
    assert list(placed) == ["timezone", "group_ids"]
    assert place_errors("params.schedule.jitter_s: -1 is less than the minimum of 0") == {
        "jitter_s": ["params.schedule.jitter_s: -1 is less than the minimum of 0"]}
    assert list(place_errors("workflow 'w' has no such thing")) == ["_"]


def test_the_form_becomes_the_schedule_it_describes() -> None:
    form = {"id": [" n "], "cron_expression": ["30 2 * * *"], "timezone": [""],
            "group_ids": ["g1", "g2"], "messages": ["one\n\n two \n"], "enabled": ["on"],
            "timeout_s": ["90"], "jitter_s": ["x"], "overlap_policy": ["evil"]}
    assert schedule_from(form, editing=False) == {
        "id": "n", "cron_expression": "30 2 * * *", "timezone": "UTC",
        "group_ids": ["g1", "g2"], "messages": ["one", "two"], "enabled": True,
        "timeout_s": 90.0, "jitter_s": "x"}
    assert "id" not in schedule_from(form, editing=True)


def test_explain_in_words() -> None:
    assert explain_in_words({"eligible": True, "blockers": []})[0].startswith("eligible")
    words = explain_in_words({"eligible": False,
                              "blockers": ["agent_busy", "cooldown_until", "queued_behind"],
                              "details": {"agent_busy": "run_1", "cooldown_until": "T",
                                          "queued_behind": "run_0"}})
    assert words == ["waiting: agent busy with run run_1", "cooling down until T",
                     "waiting: queued behind run run_0 of the same agent"]


def test_attempts_are_read_from_the_logs_frames() -> None:
    log = ("[kandevd] ==== attempt 1 started 2026-12-05T07:31:22Z ====\nout\n"
           "[kandevd] ==== attempt 1 ended 2026-12-05T07:31:23Z: failed (exit code 1) ====\n"
           "[kandevd] ==== attempt 2 started 2026-12-05T07:33:22Z ====\n")
    assert attempts_of(log) == [
        {"number": 1, "started_at": "2026-12-05T07:31:22Z", "ended_at": "2026-12-05T07:31:23Z",
         "outcome": "failed (exit code 1)"},
        {"number": 2, "started_at": "2026-12-05T07:33:22Z", "ended_at": None,
         "outcome": None}]


def test_times_and_durations() -> None:
    assert str(time_element("2026-12-05T07:31:22.5Z")) == (
        '<time datetime="2026-12-05T07:31:22Z" title="2026-12-05 07:31:22 UTC">'
        '2026-12-05 07:31:22 UTC</time>')
    assert str(time_element("<b>")) == "—"
    assert [duration(s) for s in (None, 3.21, 245, 7800, 3 * 86400)] == [
        "—", "3.2s", "4m 05s", "2h 10m", "3d 0h"]


def test_charts_escape_what_they_draw() -> None:
    chart = str(line_chart("<b>", [Series("<i>", "ok", [1, 2, 3])]))
    assert "<b>" not in chart and "&lt;b&gt;" in chart and "&lt;i&gt;" in chart
    lanes = str(timeline([Lane('"><script>', "/x?a=1&b=2", [0.1, 0.5]),
                          Lane("dense", "/y", [0.0] * 60, dense=60)]))
    assert "<script>" not in lanes and "a=1&amp;b=2" in lanes and "more than 60 fires" in lanes


@pytest.fixture
def repo(store_location: str) -> Iterator[RunRepository]:
    store = open_store(store_location)
    seed(store, "ws1", "a1", "a2")
    yield RunRepository(store, "boot")
    store.close()


def test_the_last_days_activity_is_read_from_the_runs(repo: RunRepository) -> None:
    now = T0 + timedelta(hours=2)
    done = enqueue(repo, "a1", at=T0 + timedelta(minutes=30))
    broke = enqueue(repo, "a2", at=T0 + timedelta(minutes=31))
    waiting = enqueue(repo, "a1", at=T0 + timedelta(minutes=90))
    old = enqueue(repo, "a2", at=T0 - timedelta(days=3))
    store = repo.store
    store.execute("UPDATE runs SET status = 'finished', claimed_at = ?, finished_at = ?"
                  " WHERE id = ?", (rfc3339(T0 + timedelta(minutes=40)),
                                    rfc3339(T0 + timedelta(minutes=41)), done.id))
    store.execute("UPDATE runs SET status = 'failed', claimed_at = ?, finished_at = ?"
                  " WHERE id = ?", (rfc3339(T0 + timedelta(minutes=40)),
                                    rfc3339(T0 + timedelta(minutes=42)), broke.id))
    store.execute("UPDATE runs SET status = 'finished', finished_at = ? WHERE id = ?",
                  (rfc3339(T0 - timedelta(days=3)), old.id))
    activity = read_activity(store, now, minutes=180)
    assert (activity.finished_total, activity.failed_total) == (1, 1)
    start = activity.start
    index = int((T0 + timedelta(minutes=41) - start).total_seconds() // 60)
    assert activity.finished[index] == 1 and activity.failed[index + 1] == 1
    depth = activity.queue_depth
    at = int((T0 - start).total_seconds() // 60)
    assert depth[-1] == 1 and waiting.status == "queued"  # the one queued now
    assert depth[at + 29] == 0 and depth[at + 31] == 2 and depth[at + 40] == 0
    assert depth[at + 90] == 1


def test_the_timeline_steps_from_fire_to_fire() -> None:
    from datetime import UTC, datetime

    from kandevd.cron import next_fire_times, parse_cron
    from kandevd.web.views.schedules import _timeline

    now = datetime.now(UTC)

    def job(n: int, cron: str) -> dict[str, str]:
        [first] = next_fire_times(parse_cron(cron), now, 1)
        return {"id": f"workflow:w:{n}", "state": "scheduled", "cron_expression": cron,
                "timezone": "UTC", "next_run_at": first.strftime("%Y-%m-%dT%H:%M:%S.%fZ")}
    jobs = [job(n, cron) for n, cron in enumerate(["0 9 * * *", "0 */2 * * *", "* * * * *"])]
    drawn = str(_timeline(jobs))
    assert drawn.count('class="fire"') in (1 + 12, 1 + 13)  # daily; every two hours
    assert "48+" in drawn and "more than 48 fires" in drawn  # the every-minute band


def test_a_malformed_cookie_of_another_program_hides_nothing() -> None:
    from kandevd.web.http import Request

    request = Request({"HTTP_COOKIE": 'other=a b; junk="x; kandevd_console=abc; bare'})
    assert request.cookies["kandevd_console"] == "abc"


def test_any_cookie_of_the_consoles_name_may_sign_in() -> None:
    """Another program on this host (cookies are not kept apart by port) may set a cookie
    of the same name; the browser sends both, and the right one still counts."""
    from kandevd.web.http import Request

    guard = Guard("secret-token", "127.0.0.1", port=7878)
    assert guard.cookie_name == "kandevd_console_7878"
    header = f"{guard.cookie_name}=planted; x=1; {guard.cookie_name}={guard.cookie_value}"
    request = Request({"HTTP_COOKIE": header})
    assert request.cookie_values(guard.cookie_name) == ["planted", guard.cookie_value]
    assert guard.cookie_matches(request.cookie_values(guard.cookie_name))
    assert not guard.cookie_matches(["planted"])


def test_a_flash_message_is_signed_and_bounded() -> None:
    from kandevd.web.context import FLASH_MAX, set_flash, take_flash
    from kandevd.web.http import Request, Response

    class Console:
        guard = Guard("token-" * 4, "127.0.0.1")

    response = set_flash(Console(), Response(), "ok", "é" * 5000)  # type: ignore[arg-type]
    cookie = next(v for k, v in response.headers if k == "Set-Cookie").split(";")[0]
    value = cookie.split("=", 1)[1]
    assert len(value) <= FLASH_MAX + 40
    shown = take_flash(Request({"HTTP_COOKIE": cookie}), Console.guard)
    assert shown is not None and shown["kind"] == "ok" and shown["text"].endswith("…")
    forged = f"{Console.guard.flash_cookie}={value[:-4]}0000"
    assert take_flash(Request({"HTTP_COOKIE": forged}), Console.guard) is None


def test_an_empty_token_file_gets_a_new_token(tmp_path) -> None:
    from kandevd.web.auth import ensure_token, token_path

    token_path(tmp_path).write_text("")
    token = ensure_token(tmp_path)
    assert len(token) > 30 and ensure_token(tmp_path) == token
    assert token_path(tmp_path).stat().st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["web.token"]  # no spare file left


@pytest.mark.parametrize(("target", "kept"), [
    ("/runs/x", True), ("//evil.example", False), ("/\\evil", False), ("/\t/evil", False),
    ("https://evil.example", False), ("/é", False), ("/a\r\nSet-Cookie: x", False)])
def test_only_our_own_paths_are_redirect_targets(target: str, kept: bool) -> None:
    from kandevd.web.app import safe_back

    assert (safe_back(target) == target) is kept
