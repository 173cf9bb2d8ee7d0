"""The console in a real headless Chromium, through the real daemon: sign in with the
token, create a schedule with the preset popup and its live preview, trigger it and
follow its log, disable and enable it, pause the scheduler with a note, see a run
enqueued over the socket, cancel and retry it, retry from the dead letter, pause an
agent, and the overview's charts and live refresh. Each page is kept as a screenshot
(tests.support.console.ARTIFACTS)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.support.expected_conditions import staleness_of
from selenium.webdriver.support.ui import Select

from tests.support.browser import (
    button,
    chromium,
    click_and_confirm,
    flash,
    leads_on,
    needs_chromium,
    open_page,
    ready,
    shot,
    wait_for,
)
from tests.support.console import ConsoleAddress, console_config, console_of
from tests.support.daemon import DaemonProcess
from tests.support.workflows import schedule, write_workflow

pytestmark = [pytest.mark.integration, needs_chromium]


@pytest.fixture
def site(tmp_path: Path, daemon_factory: Callable[..., DaemonProcess]
         ) -> Iterator[tuple[DaemonProcess, ConsoleAddress, Any, Path]]:
    home = tmp_path / "home"
    write_workflow(home / "workspace", "w", [schedule("s", cron="0 3 * * *")],
                   groups={"g1": True, "g2": True})
    record = tmp_path / "record.jsonl"
    daemon = daemon_factory(console_config(record), home=home)
    address = console_of(daemon)
    with chromium() as driver:
        yield daemon, address, driver, record


def test_a_schedule_made_with_presets_saved_run_followed_paused(site) -> None:
    daemon, address, driver, record = site
    driver.get(address.url)  # the URL `serve` logs: the token, then the cookie
    wait_for(driver, ready, what="the overview")
    assert "token=" not in driver.current_url
    assert len(driver.find_elements(By.CSS_SELECTOR, "svg.chart polyline")) == 3
    shot(driver, "overview")

    open_page(driver, address, "/schedules/new")
    driver.find_element(By.ID, "f-id").send_keys("nightly")
    driver.find_element(By.ID, "f-name").send_keys("Nightly digest")
    button(driver, "Presets…").click()
    dialog = driver.find_element(By.ID, "presets")
    every = Select(dialog.find_element(By.NAME, "every"))  # (*/N starts again each hour)
    assert [o.text for o in every.options] == ["1", "2", "3", "4", "5", "6", "10", "12",
                                               "15", "20", "30"]
    every.select_by_visible_text("20")
    assert "*/20 * * * *" in dialog.find_element(By.CSS_SELECTOR, "[data-preset-result]").text
    dialog.find_element(By.CSS_SELECTOR, "input[value=daily]").click()
    daily = dialog.find_element(By.NAME, "daily")
    driver.execute_script("arguments[0].value = '02:30'; arguments[0].dispatchEvent("
                          "new Event('input', {bubbles: true}))", daily)
    assert "30 2 * * *" in dialog.find_element(By.CSS_SELECTOR, "[data-preset-result]").text
    shot(driver, "schedule-presets")
    button(driver, "Use this timing").click()
    cron = driver.find_element(By.ID, "f-cron")
    assert cron.get_attribute("value") == "30 2 * * *"
    zone = driver.find_element(By.ID, "f-timezone")
    zone.clear()
    zone.send_keys("Europe/Paris")
    wait_for(driver, lambda d: "+01:00" in d.find_element(By.ID, "preview").text,
             what="the preview in Paris time")
    assert len(driver.find_elements(By.CSS_SELECTOR, "#preview li")) == 5
    driver.find_element(By.CSS_SELECTOR, "input[name=group_ids][value=g1]").click()
    driver.find_element(By.ID, "f-messages").send_keys("HOLD please")
    shot(driver, "schedule-new")
    leads_on(driver, button(driver, "Create"))
    assert "Created workflow:w:nightly" in flash(driver)
    manifest = json.loads((daemon.home / "workspace" / "Workflow" / "w" /
                           "workflow.json").read_text())
    [saved] = [s for s in manifest["schedules"] if s["id"] == "nightly"]
    assert (saved["cron_expression"], saved["timezone"], saved["group_ids"]) == \
        ("30 2 * * *", "Europe/Paris", ["g1"])

    click_and_confirm(driver, button(driver, "Trigger now"))
    assert "Triggered workflow:w:nightly" in flash(driver)
    held = Path(str(record) + ".held")
    daemon.wait_until(held.exists, what="the agent holding")
    open_page(driver, address, "/schedules/workflow:w:nightly")
    leads_on(driver, driver.find_element(By.CSS_SELECTOR, "table.history tbody a"))
    log = driver.find_element(By.CSS_SELECTOR, "pre.log[data-stream]")
    assert "following" in log.get_attribute("class")
    # While the turn runs: its stderr and its stdout so far (stdout joins the log at
    # the end), how long it has run, and Stop.
    wait_for(driver, lambda d: "waiting for the release file" in log.text
             and "holding until released" in log.text, what="the running turn's output")
    turn = driver.find_element(By.CSS_SELECTOR, ".turn")
    # (no "of N" while it runs: the turns still to come are not counted yet)
    assert turn.find_element(By.TAG_NAME, "h2").text.startswith("Turn 1 · message")
    assert turn.find_element(By.CSS_SELECTOR, ".elapsed[data-since]").text.endswith("s")
    assert button(driver, "Stop the session").is_displayed()
    shot(driver, "schedule-run-running")
    Path(str(record) + ".release").touch()
    wait_for(driver, staleness_of(log), what="the page again once the run ended")
    wait_for(driver, lambda d: "success" in d.find_element(By.CSS_SELECTOR, ".turn h2").text,
             what="the turn's outcome")
    assert "did HOLD please" in driver.find_element(By.CSS_SELECTOR, "dd.output").text
    assert "holding until released" in driver.find_element(By.CSS_SELECTOR, "pre.log").text
    assert "$0.03" in driver.find_element(By.CSS_SELECTOR, ".turn").text
    shot(driver, "schedule-run")

    open_page(driver, address, "/schedules/workflow:w:nightly")
    leads_on(driver, button(driver, "Disable"))
    assert "Disabled workflow:w:nightly" in flash(driver)
    assert daemon.call("scheduler.jobs.get", {"id": "workflow:w:nightly"})["state"] == \
        "disabled"
    leads_on(driver, button(driver, "Enable"))
    assert "Enabled workflow:w:nightly" in flash(driver)
    assert daemon.call("scheduler.jobs.get", {"id": "workflow:w:nightly"})["enabled"]
    shot(driver, "schedule-job")

    open_page(driver, address, "/schedules")
    assert driver.find_elements(By.CSS_SELECTOR, ".timeline svg.lane line.fire")
    driver.find_element(By.NAME, "note").send_keys("maintenance window")
    click_and_confirm(driver, button(driver, "Pause the scheduler"))
    assert "Scheduler paused (maintenance window)" in flash(driver)
    paused = daemon.call("scheduler.config.get")
    assert paused["globally_paused"] and paused["paused_by"] == "maintenance window"
    shot(driver, "schedules")
    leads_on(driver, button(driver, "Resume the scheduler"))
    assert "Scheduler resumed" in flash(driver)


def test_a_schedules_errors_are_shown_beside_their_field(site) -> None:
    daemon, address, driver, _record = site
    driver.get(address.url)
    open_page(driver, address, "/schedules/new")
    driver.find_element(By.ID, "f-id").send_keys("broken")
    zone = driver.find_element(By.ID, "f-timezone")
    zone.clear()
    zone.send_keys("Mars/Olympus")
    # The live preview answers and changes its height: the clicks wait for it, or they
    # land where the button was.
    wait_for(driver, lambda d: "'Mars/Olympus'" in d.find_element(By.ID, "preview").text,
             what="the preview's answer")
    driver.find_element(By.CSS_SELECTOR, "input[name=group_ids][value=g2]").click()
    leads_on(driver, button(driver, "Create"))
    problem = driver.find_element(By.XPATH, "//input[@id='f-timezone']/following::p[1]")
    assert problem.text.startswith("Unknown time zone 'Mars/Olympus'")  # in words
    assert "Mars" not in driver.find_element(By.ID, "preview").text  # and once
    assert "field-error" in problem.get_attribute("class")
    assert driver.find_element(By.ID, "f-id").get_attribute("value") == "broken"  # kept
    shot(driver, "schedule-errors")
    manifest = json.loads((daemon.home / "workspace" / "Workflow" / "w" /
                           "workflow.json").read_text())
    assert [s["id"] for s in manifest["schedules"]] == ["s"]  # nothing written


def test_an_options_error_sits_under_its_own_field(site) -> None:
    _daemon, address, driver, _record = site
    driver.get(address.url)
    open_page(driver, address, "/schedules/new")
    driver.find_element(By.ID, "f-id").send_keys("options")
    for name, value in (("pause_after_failures", "0"), ("catchup_window_s", "abc")):
        field = driver.find_element(By.NAME, name)
        field.clear()
        field.send_keys(value)
    leads_on(driver, button(driver, "Create"))
    for name, said in (("pause_after_failures", "0 is too small"),
                       ("catchup_window_s", "not a number")):
        field = driver.find_element(By.NAME, name)
        problem = field.find_element(By.XPATH, "ancestor::div[@class='option']"
                                               "//p[@class='field-error']")
        assert said in problem.text, problem.text
        # Under its field: starting within the field's option, below the field.
        box = field.find_element(By.XPATH, "ancestor::div[@class='option']").rect
        assert box["x"] <= problem.rect["x"] < box["x"] + box["width"]
        assert problem.rect["y"] >= field.rect["y"] + field.rect["height"] - 1
    shot(driver, "schedule-option-errors")


def test_runs_appear_cancel_retry_dead_letter_and_agents(site) -> None:
    daemon, address, driver, _record = site
    daemon.call("workspaces.create", {"id": "ws", "name": "Team"})
    daemon.call("agents.create", {"id": "writer", "workspace_id": "ws", "name": "Writer"})
    daemon.call("agents.create", {"id": "breaker", "workspace_id": "ws", "name": "Breaker",
                                  "profile": "broken"})
    driver.get(address.url)
    wait_for(driver, ready, what="the overview")
    live = driver.find_element(By.ID, "overview-live")

    open_page(driver, address, "/agents")
    row = driver.find_element(By.XPATH, "//tr[td[contains(., 'writer')]]")
    click_and_confirm(driver, row.find_element(By.XPATH, ".//button[.='Pause']"))
    assert "Paused agent writer" in flash(driver)
    shot(driver, "agents")

    open_page(driver, address, "/")
    live = driver.find_element(By.ID, "overview-live")
    # (its event stream open first: an event before it would not be seen)
    wait_for(driver, lambda d: live.get_attribute("data-live-state") == "live",
             what="the overview's live stream")
    run = daemon.call("runs.enqueue", {"workspace_id": "ws", "agent_id": "writer",
                                       "reason": "from the socket"})["run"]["id"]
    wait_for(driver, lambda d: int(live.get_attribute("data-refreshed") or 0) >= 1,
             what="the overview refreshed by itself")
    wait_for(driver, lambda d: d.find_elements(
        By.CSS_SELECTOR, f"#overview-live a[href='/runs/{run}']"),
        what="the run among those waiting")

    open_page(driver, address, "/runs?status=queued")
    leads_on(driver, driver.find_element(By.CSS_SELECTOR, f"a[href='/runs/{run}']"))
    assert "waiting: its agent is paused" in driver.find_element(By.CSS_SELECTOR,
                                                                 ".subtitle").text
    waiting = driver.find_element(By.CSS_SELECTOR, "dd .elapsed[data-since]")
    first = waiting.text
    wait_for(driver, lambda d: waiting.text != first and waiting.text.endswith("s"),
             what="the waiting time counted on in the browser")
    shot(driver, "run-queued")
    click_and_confirm(driver, button(driver, "Cancel"))
    assert f"Cancelled run {run}" in flash(driver)
    assert daemon.call("runs.get", {"id": run})["status"] == "cancelled"
    leads_on(driver, button(driver, "Retry"))
    assert f"Queued run {run} again" in flash(driver)
    assert daemon.call("runs.get", {"id": run})["status"] == "queued"
    shot(driver, "runs-run")

    broken = daemon.call("runs.enqueue", {"workspace_id": "ws", "agent_id": "breaker",
                                          "reason": "doomed"})["run"]["id"]
    daemon.wait_until(lambda: daemon.call("runs.get", {"id": broken})["status"] == "failed",
                      what="the run in the dead letter")
    open_page(driver, address, "/runs/dead")
    driver.find_element(By.CSS_SELECTOR, f"input[name=run][value='{broken}']").click()
    shot(driver, "dead-letter")
    click_and_confirm(driver, button(driver, "Retry selected"))
    assert "Retried 1 run(s)" in flash(driver)
    assert daemon.call("runs.get", {"id": broken})["status"] in ("queued", "claimed",
                                                                   "failed")
    assert daemon.call("runs.get", {"id": broken})["retry_count"] >= 0

    open_page(driver, address, "/runs")
    Select(driver.find_element(By.NAME, "status")).select_by_visible_text("queued")
    driver.find_element(By.NAME, "agent_id").send_keys("writer")
    leads_on(driver, button(driver, "Filter"))
    rows = driver.find_elements(By.CSS_SELECTOR, "table.runs tbody tr")
    assert len(rows) == 1
    assert rows[0].find_element(By.CSS_SELECTOR, "a.run-id").get_attribute("title") == run
    shot(driver, "runs")
    open_page(driver, address, "/office")
    shot(driver, "office")


def test_a_narrow_dark_screen_reads_well(site) -> None:
    _daemon, address, _driver, _record = site
    with chromium(390, 844, dark=True) as phone:
        phone.get(address.url)
        wait_for(phone, ready, what="the overview")
        assert phone.execute_script("return window.innerWidth") == 390
        width = phone.execute_script("return document.documentElement.scrollWidth")
        assert width <= 390  # nothing wider than the screen: tables scroll in their box
        background = phone.execute_script(
            "return getComputedStyle(document.body).backgroundColor")
        assert background == "rgb(21, 22, 26)"  # the dark palette
        shot(phone, "overview-phone-dark")
        open_page(phone, address, "/schedules")
        assert phone.execute_script("return document.documentElement.scrollWidth") <= 390
        shot(phone, "schedules-phone-dark")
