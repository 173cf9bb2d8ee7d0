"""The console's pure parts: Host and token checks, where a method's errors go on the
form (once, in words), runs.explain in words, attempts read from a log, times (also inside
a sentence) and durations, charts with whole-number ticks, units and legends that escape
what they draw, why a log shows nothing, a backfill's picked times, and the last day's
activity read from the runs table."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kandevd.net.listen import is_loopback
from kandevd.store.open import open_store
from kandevd.store.runs import RunRepository
from kandevd.store.runs.activity import read_activity
from kandevd.timeutil import rfc3339, utc_now
from kandevd.web.app import in_words
from kandevd.web.auth import Guard, split_host
from kandevd.web.charts import Lane, Series, count_ticks, line_chart, spend_bar, timeline
from kandevd.web.context import duration, time_element, times_in
from kandevd.web.views.runs import attempts_of, explain_in_words, timing
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
    assert placed == {"timezone": ["Unknown time zone 'Mars'"],
                      "group_ids": ["Unknown group(s) 'nope' (available: g1)"]}
    assert place_errors("params.schedule.jitter_s: -1 is less than the minimum of 0") == {
        "jitter_s": ["-1 is too small: it must be at least 0"]}
    assert place_errors("params.schedule.timeout_s: 0 is less than or equal to the minimum "
                        "of 0") == {"timeout_s": ["0 is too small: it must be more than 0"]}
    assert place_errors("params.schedule.pause_after_failures: '1.5' is not of type "
                        "'integer'") == {"pause_after_failures": ["'1.5' is not a whole number"]}
    assert place_errors("params.schedule.jitter_s: 'abc' is not of type 'number'") == {
        "jitter_s": ["'abc' is not a number"]}
    assert place_errors("workflow 'w' has no such thing") == {
        "_": ["Workflow 'w' has no such thing"]}
    assert list(place_errors("workflow 'daily-digest' already has a schedule 'x1'")) == [
        "id"]  # beside the id, not at the top of the page


@pytest.mark.parametrize(("message", "said"), [
    ("workflow 'w': schedule 'x': cron_expression: '0 99 * * *' is not a valid 5-field cron "
     "expression: hour field '99': 99 is out of range 0-23",
     "'0 99 * * *' is not a valid cron expression: in its hour field ('99'), 99 is out of "
     "range 0-23"),
    ("params.schedule.cron_expression: '0 9 * *' is not a valid 5-field cron expression: "
     "Wrong number of fields; got 4, expected 5",
     "'0 9 * *' is not a valid cron expression: it has 4 field(s); a cron expression has 5 "
     "(minute, hour, day of month, month, day of week), or is one of @hourly, @daily, "
     "@weekly, @monthly, @yearly"),
    ("workflow 'w': schedule 'x': cron_expression: '0 9 * * fry' is not a valid 5-field "
     "cron expression: day-of-week field 'fry': 'fry' is not a number 0-7 or a name "
     "sun-sat; schedule 'x': cron_expression: '0 9 * * fry' is not a valid 5-field cron "
     "expression: day-of-week field 'fry': 'fry' is not a number 0-7 or a name sun-sat",
     "'0 9 * * fry' is not a valid cron expression: in its day of week field ('fry'), "
     "'fry' is not a number 0-7 or a name sun-sat"),
])
def test_a_cron_problem_is_said_once_in_words(message: str, said: str) -> None:
    assert place_errors(message) == {"cron_expression": [said]}


def test_the_form_becomes_the_schedule_it_describes() -> None:
    form = {"id": [" n "], "cron_expression": ["30 2 * * *"], "timezone": [""],
            "group_ids": ["g1", "g2"], "messages": ["one\n\n two \n"], "enabled": ["on"],
            "timeout_s": ["90"], "jitter_s": ["x"], "overlap_policy": ["evil"]}
    assert schedule_from(form, editing=False) == {
        "id": "n", "cron_expression": "30 2 * * *", "timezone": "UTC",
        "group_ids": ["g1", "g2"], "messages": ["one", "two"], "enabled": True,
        "timeout_s": 90.0, "jitter_s": "x"}
    assert "id" not in schedule_from(form, editing=True)


def test_the_next_retry_is_shown_only_while_it_is_ahead_of_a_queued_run() -> None:
    now = datetime(2026, 12, 7, 12, 0, tzinfo=UTC)
    ahead, past = "2026-12-07T12:05:00.000000Z", "2026-12-07T11:55:00.000000Z"
    def shown(status: str, at: str) -> bool:
        return timing({"status": status, "scheduled_retry_at": at}, now)["retry_ahead"]
    assert shown("queued", ahead)
    assert not shown("queued", past)  # (an earlier back-off a rescue left as it was)
    assert not shown("claimed", ahead) and not shown("cancelled", ahead)


def test_explain_in_words() -> None:
    assert explain_in_words({"eligible": True, "blockers": []})[0].startswith("eligible")
    words = explain_in_words({"eligible": False,
                              "blockers": ["agent_busy", "cooldown_until", "queued_behind"],
                              "details": {"agent_busy": "run_1", "cooldown_until": "T",
                                          "queued_behind": "run_0"}})
    assert words == ["waiting: agent busy with run run_1", "cooling down until T",
                     "waiting: queued behind run run_0 of the same agent"]


def test_a_run_that_is_not_waiting_says_what_happened() -> None:
    def said(status: str, **run: object) -> str:
        [words] = explain_in_words({"eligible": False, "blockers": [f"status_{status}"]},
                                   {"status": status, **run})
        assert "not waiting in the queue" not in words
        return words
    assert said("finished", finished_at="2026-12-05T07:31:23Z", attempt=1,
                output_summary="drafted") == \
        "finished at 2026-12-05T07:31:23Z after 1 attempt(s): drafted"
    assert said("failed", finished_at="T", attempt=3, error_message="exit code 3") == \
        "failed for good at T after 3 attempt(s): exit code 3; it is in the dead letter " \
        "(Retry queues it again)"
    assert said("cancelled", cancel_reason="by hand") == "cancelled: by hand"
    assert said("claimed", claimed_at="T", attempt=2) == "running since T (attempt 2)"


def test_attempts_are_read_from_the_logs_frames() -> None:
    log = ("[kandevd] ==== attempt 1 started 2026-12-05T07:31:22Z ====\nout\n"
           "[kandevd] ==== attempt 1 ended 2026-12-05T07:31:23Z: failed (exit code 1) ====\n"
           "[kandevd] ==== attempt 2 started 2026-12-05T07:33:22Z ====\n")
    assert attempts_of(log) == [
        {"number": 1, "started_at": "2026-12-05T07:31:22Z", "ended_at": "2026-12-05T07:31:23Z",
         "outcome": "failed (exit code 1)"},
        {"number": 2, "started_at": "2026-12-05T07:33:22Z", "ended_at": None,
         "outcome": None}]
    # Cancelled as it ran, then retried: its attempts count from 1 again, both are shown.
    retried = ("[kandevd] ==== attempt 1 started 2026-12-05T07:31:22Z ====\n"
               "[kandevd] ==== attempt 1 ended 2026-12-05T07:31:28Z: stopped (cancelled) ====\n"
               "[kandevd] ==== re-queued by runs.retry 2026-12-05T07:32:00Z: its attempts "
               "count from 1 again ====\n"
               "[kandevd] ==== attempt 1 started 2026-12-05T07:32:01Z ====\n")
    assert [(a["number"], a["started_at"], a["outcome"]) for a in attempts_of(retried)] == [
        (1, "2026-12-05T07:31:22Z", "stopped (cancelled)"), (1, "2026-12-05T07:32:01Z", None)]


def test_times_and_durations() -> None:
    assert str(time_element("2026-12-05T07:31:22.5Z")) == (
        '<time datetime="2026-12-05T07:31:22Z" title="2026-12-05 07:31:22 UTC">'
        '2026-12-05 07:31:22 UTC</time>')
    assert str(time_element("<b>")) == "—"
    assert [duration(s) for s in (None, 3.21, 245, 7800, 3 * 86400)] == [
        "—", "3.2s", "4m 05s", "2h 10m", "3d 0h"]


def test_times_inside_a_sentence_are_shown_as_times() -> None:
    shown = str(times_in("fires at 2026-12-06T09:00:00.000000Z <b>, held until "
                         "2026-12-06T10:00:00+01:00"))
    assert shown == (
        'fires at <time datetime="2026-12-06T09:00:00Z" title="2026-12-06 09:00:00 UTC">'
        '2026-12-06 09:00:00 UTC</time> &lt;b&gt;, held until <time datetime="2026-12-06T'
        '09:00:00Z" title="2026-12-06 09:00:00 UTC">2026-12-06 09:00:00 UTC</time>')
    assert str(times_in(None)) == "" and str(times_in("<i>")) == "&lt;i&gt;"


def test_charts_escape_what_they_draw() -> None:
    chart = str(line_chart("<b>", [Series("<i>", "ok", [1, 2, 3])], unit="<u>"))
    assert "<b>" not in chart and "&lt;b&gt;" in chart and "&lt;i&gt;" in chart
    assert "<u>" not in chart and "&lt;u&gt;" in chart
    lanes = str(timeline([Lane('"><script>', "/x?a=1&b=2", [0.1, 0.5]),
                          Lane("dense", "/y", [0.0] * 60, dense=60)]))
    assert "<script>" not in lanes and "a=1&amp;b=2" in lanes and "more than 60 fires" in lanes


@pytest.mark.parametrize(("peak", "ticks"), [
    (0, [0, 1]), (1, [0, 1]), (3, [0, 1, 2, 3]), (5, [0, 2, 4, 6]), (10, [0, 5, 10]),
    (14, [0, 5, 10, 15]), (33, [0, 10, 20, 30, 40]), (950, [0, 500, 1000])])
def test_counts_tick_at_whole_numbers(peak: int, ticks: list[int]) -> None:
    assert count_ticks(peak) == ticks


def test_a_chart_names_its_units_and_its_legend_says_what_it_is_told() -> None:
    depth = [0] * 100 + [4, 6, 10, 10]  # per minute; 24 "queued" if summed
    chart = str(line_chart("Queue depth", [Series("queued", "info", depth, "10 now")],
                           unit="runs queued"))
    assert "queued: 10 now" in chart and "queued: 24" not in chart
    assert "runs queued" in chart and "hours before now" in chart
    ticks = chart.split('class="y-ticks"', 1)[1].split("</div>", 1)[0]
    assert ticks.count("<span>") == 3 and "<span>10</span>" in ticks and "." not in ticks
    summed = str(line_chart("Ended", [Series("finished", "ok", [1, 2, 2])], unit="per min"))
    assert "finished: 5" in summed  # without a legend of its own: the span's total


def test_a_spend_bar_says_its_percentage_and_names_its_threshold() -> None:
    bar = str(spend_bar(19, 100, 40))
    assert "19%" in bar and "alert at 40%" in bar and 'class="threshold"' in bar
    assert "alert at" not in str(spend_bar(150, 100, None)) and "150%" in str(
        spend_bar(150, 100, None))


def test_an_empty_log_says_why(tmp_path) -> None:
    from kandevd.web.logs import readable_log

    class Console:
        home = tmp_path
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "empty.log").write_text("")
    (logs / "some.log").write_text("hello\n")
    (tmp_path / "outside.log").write_text("secret\n")
    states = {name: readable_log(Console(), raw)["state"] for name, raw in [
        ("none", None), ("refused", str(tmp_path / "outside.log")),
        ("missing", str(logs / "gone.log")), ("empty", str(logs / "empty.log")),
        ("ok", str(logs / "some.log"))]}
    assert states == {name: name for name in states}
    assert readable_log(Console(), str(tmp_path / "outside.log"))["text"] == ""


def test_a_backfills_picked_times_are_read_in_the_browsers_zone() -> None:
    from kandevd.control.protocol import InvalidParams
    from kandevd.web.views.job import moment

    assert moment("2026-12-01T09:00", "Europe/Paris", "from") == "2026-12-01T08:00:00.000000Z"
    assert moment("2026-07-01T09:00:30", "Europe/Paris", "to") == "2026-07-01T07:00:30.000000Z"
    assert moment("2026-12-01T09:00", "", "from") == "2026-12-01T09:00:00.000000Z"
    assert moment(" 2026-12-01T09:00:00Z ", "Europe/Paris", "to") == "2026-12-01T09:00:00Z"
    with pytest.raises(InvalidParams, match="unknown time zone 'Mars/Olympus'"):
        moment("2026-12-01T09:00", "Mars/Olympus", "from")
    # what the picker cannot give, named by its field (it was a 500: a ValueError)
    for value, field in (("2026-02-30T00:00", "to"), ("2026-12-01T25:00", "from"),
                         ("2026-13-45T99:99", "to"), ("yesterday", "from")):
        with pytest.raises(InvalidParams,
                           match=rf"^params\.{field}: '{value}' is not a date and time"):
            moment(value, "UTC", field)
    with pytest.raises(InvalidParams,
                       match=r"^params\.to: '9999-12-31T23:59' is not a date and time"):
        moment("9999-12-31T23:59", "Pacific/Pago_Pago", "to")  # (past year 9999 in UTC)


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


def test_a_running_executions_stdout_is_found_by_plain_ids_only(tmp_path) -> None:
    import os

    from kandevd.web.logs import run_stdout_path, tail, turn_stdout_path

    class Console:
        home = tmp_path
    old = tmp_path / "attempts" / "run_1.aaa"  # an older daemon's: stdout inside
    new = tmp_path / "attempts" / "run_1.bbb.stdout"  # the keeper's: beside the record
    for folder in (old, tmp_path / "turns" / "turn-e1-2"):
        folder.mkdir(parents=True)
        (folder / "stdout").write_text(f"out of {folder.name}\n")
    new.write_text("out of run_1.bbb\n")
    (tmp_path / "attempts" / "run_1.ccc").mkdir()  # a record folder without stdout
    os.utime(old / "stdout", (1, 1))
    assert run_stdout_path(Console(), "run_1") == new
    assert tail(run_stdout_path(Console(), "run_1"))["text"] == "out of run_1.bbb\n"
    new.unlink()
    assert run_stdout_path(Console(), "run_1") == old / "stdout"
    assert run_stdout_path(Console(), "run_2") is None
    assert turn_stdout_path(Console(), "e1", 2) == tmp_path / "turns" / "turn-e1-2" / "stdout"
    (tmp_path / "turns" / "turn-e1-3.stdout").write_text("kept\n")
    assert turn_stdout_path(Console(), "e1", 3) == tmp_path / "turns" / "turn-e1-3.stdout"
    for bad in ("../x", "e1/..", "", None, "a.b"):
        assert turn_stdout_path(Console(), bad, 0) is None
        assert run_stdout_path(Console(), bad) is None


def test_a_refusal_the_console_shows_names_fields_not_params() -> None:
    assert in_words("params.to: must not be earlier than params.from") == \
        "“To”: must not be earlier than “From”"
    assert in_words("params.schedule.jitter_s: too small") == "“Jitter s”: too small"
    assert in_words("workflow 'w' has no schedule 'x'") == "workflow 'w' has no schedule 'x'"


def test_the_overviews_day_is_read_again_once_the_dead_letter_changed(
        repo: RunRepository) -> None:
    """The queue card shows the dead letter (live) beside the 24 h failures (read with
    the charts, every 20 s): a run that just failed for good was missing from the
    second for up to 20 s."""
    from types import SimpleNamespace

    from kandevd.web.views import overview

    store = repo.store
    console = SimpleNamespace(reads=lambda read: read(store))
    now = utc_now()
    broke = enqueue(repo, "a1", at=now - timedelta(minutes=5))
    first = overview._activity(console, now, 0)
    store.execute("UPDATE runs SET status = 'failed', finished_at = ? WHERE id = ?",
                  (rfc3339(now - timedelta(minutes=1)), broke.id))
    assert overview._activity(console, now, 0) is first  # (the charts' 20 s)
    again = overview._activity(console, now, 1)  # the dead letter moved: read at once
    assert (first.failed_total, again.failed_total) == (0, 1)
