"""The console's scheduling screens and live views as their users expect them, in a real
headless Chromium through the real daemon: a live view refused for lack of a stream slot
says so and goes live by itself; a workflow's label beside its schedules; Stop that the
page follows to the end; Delete confirmed; fires that will not happen said so; a backfill
picked with date and time inputs; the id's pattern working in Chrome; a cron problem said
once, in words; 0 shown as 0; runs with short ids, duration and cost, kept up to date; a
finished run saying what happened; the dead letter retried whole; budgets in percent; and
charts readable on a phone. Each page is kept as a screenshot."""

from __future__ import annotations

import http.client
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.support.expected_conditions import staleness_of

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
from tests.support.console import ConsoleAddress, console_config, console_of, sign_in
from tests.support.daemon import DaemonProcess
from tests.support.workflows import schedule, write_workflow

pytestmark = [pytest.mark.integration, needs_chromium]

LABEL = "Nightly <i>work</i>"

Site = tuple[DaemonProcess, ConsoleAddress, Any, Path]


def make_site(tmp_path: Path, daemon_factory: Callable[..., DaemonProcess],
              env: dict[str, str] | None = None) -> tuple[DaemonProcess, ConsoleAddress, Path]:
    home = tmp_path / "home"
    write_workflow(home / "workspace", "w", [
        schedule("s", cron="0 3 * * *", name="Digest"),
        schedule("held", cron="0 4 * * *", name="Held", messages=["HOLD on"])],
        label=LABEL)
    product = home / "workspace" / "products" / "helper"
    product.mkdir(parents=True)
    (product / "product.yaml").write_text(yaml.safe_dump({"profile": {
        "id": "helper", "runtime": {"conversation": {"mode": "singleton"}},
        "schedules": [{"id": "brief", "cron_expression": "0 8 * * *",
                       "messages": ["one"]}]}}))
    record = tmp_path / "record.jsonl"
    daemon = daemon_factory(console_config(record), home=home, env=env)
    return daemon, console_of(daemon), record


@pytest.fixture
def site(tmp_path: Path, daemon_factory: Callable[..., DaemonProcess]) -> Iterator[Site]:
    daemon, address, record = make_site(tmp_path, daemon_factory)
    with chromium() as driver:
        # Signed in on a page without a live view: every stream slot is free for the test.
        driver.get(f"{address.base}/schedules?token={address.token}")
        wait_for(driver, ready, what="the schedules")
        yield daemon, address, driver, record


def text_of(driver: Any, css: str) -> str:
    """An element's text, "" while the page is being replaced."""
    try:
        return str(driver.find_element(By.CSS_SELECTOR, css).text)
    except (NoSuchElementException, StaleElementReferenceException):
        return ""


@contextmanager
def held_streams(address: ConsoleAddress, paths: list[str]) -> Iterator[None]:
    """Live log streams held open (each seen accepted: its ``ready`` event)."""
    cookie = sign_in(address)
    parts = urlsplit(address.base)
    conns = []
    try:
        for path in paths:
            conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
            conns.append(conn)
            conn.request("GET", path, headers={"Host": address.host, "Cookie": cookie})
            answer = conn.getresponse()
            assert answer.status == 200
            while (line := answer.fp.readline()) != b"event: ready\n":
                assert line, f"{path}: the stream ended before it was accepted"
        yield
    finally:
        for conn in conns:
            conn.close()


def test_a_live_view_refused_says_busy_and_goes_live_once_a_stream_ends(site: Site) -> None:
    daemon, address, driver, _record = site
    daemon.call("workspaces.create", {"id": "ws", "name": "Team"})
    daemon.call("agents.create", {"id": "writer", "workspace_id": "ws", "name": "Writer"})
    daemon.call("agents.update", {"id": "writer", "status": "paused"})  # runs stay queued
    runs = [daemon.call("runs.enqueue", {"workspace_id": "ws", "agent_id": "writer",
                                         "reason": f"r{n}"})["run"]["id"] for n in range(4)]
    with held_streams(address, [f"/events/run/{run}" for run in runs]):
        open_page(driver, address, "/runs")
        box = driver.find_element(By.ID, "runs-live")
        notice = wait_for(driver, lambda d: d.find_element(By.CSS_SELECTOR, ".live-notice"),
                          what="the busy notice")
        assert notice.text.startswith("Busy, retrying:") and notice.is_displayed()
        assert box.get_attribute("data-live-state") == "busy"
        shot(driver, "runs-busy")
        daemon.call("runs.cancel", {"id": runs[0]})  # its stream ends: a slot is free
        wait_for(driver, lambda d: box.get_attribute("data-live-state") == "live"
                 and not d.find_elements(By.CSS_SELECTOR, ".live-notice"), timeout=60,
                 what="the browser's retry accepted and the notice gone")
        late = daemon.call("runs.enqueue", {"workspace_id": "ws", "agent_id": "writer",
                                            "reason": "late"})["run"]["id"]
        wait_for(driver, lambda d: d.find_elements(
            By.CSS_SELECTOR, f"#runs-live a[href='/runs/{late}']"), timeout=30,
            what="the new run in the list, without a reload")
        for run in [*runs[1:], late]:
            daemon.call("runs.cancel", {"id": run})


def test_a_long_unbroken_pause_note_wraps_instead_of_widening_the_page(site: Site) -> None:
    daemon, address, driver, _record = site
    open_page(driver, address, "/schedules")
    driver.find_element(By.NAME, "note").send_keys("maintenance" * 18)  # 198, no space
    click_and_confirm(driver, button(driver, "Pause the scheduler"))
    assert "paused" in flash(driver)
    assert daemon.call("scheduler.config.get")["globally_paused"] is True
    for width in (1280, 390):
        driver.set_window_size(width, 900)
        wide = driver.execute_script("return document.documentElement.scrollWidth"
                                     " - document.documentElement.clientWidth")
        assert wide <= 0, f"{wide} px too wide at {width}"
    shot(driver, "schedules-long-note")


def test_a_jobs_label_its_stop_followed_to_the_end_and_delete(site: Site) -> None:
    daemon, address, driver, record = site
    open_page(driver, address, "/schedules")
    row = driver.find_element(By.XPATH, "//table[@class='jobs']//tr[td//a[.='Digest']]")
    assert LABEL in row.text  # beside its schedule, as text
    open_page(driver, address, "/schedules/workflow:w:s")
    assert f"Workflow {LABEL} (w)" in driver.find_element(By.CSS_SELECTOR, ".subtitle").text
    assert driver.find_elements(By.CSS_SELECTOR, ".state-line time")  # "fires at" a time
    assert "T03:00:00" not in text_of(driver, ".state-line")  # not the raw ISO

    open_page(driver, address, "/schedules/workflow:w:held")
    click_and_confirm(driver, button(driver, "Trigger now"))
    daemon.wait_until(Path(str(record) + ".held").exists, what="the agent holding")
    open_page(driver, address, "/schedules/workflow:w:held")
    assert "follow it live" in text_of(driver, ".state-line")
    click_and_confirm(driver, button(driver, "Stop the session"))
    assert "workflow:w:held" in flash(driver)
    # Either it ended within the page's wait, or the page says "stopping" and looks again.
    wait_for(driver, lambda d: "running" not in text_of(d, ".state-line")
             and "stopping" not in text_of(d, ".state-line") and text_of(d, ".state-line"),
             timeout=60, what="the job no longer running")
    assert not driver.find_elements(By.XPATH, "//button[.='Stop the session']")
    assert "stopped" in text_of(driver, "table.history tbody tr")
    job = daemon.call("scheduler.jobs.get", {"id": "workflow:w:held"})
    assert not job["running"] and job["last_status"] == "stopped"
    shot(driver, "schedule-job-stopped")

    click_and_confirm(driver, button(driver, "Delete"))
    assert "Deleted workflow:w:held from w/workflow.json" in flash(driver)
    manifest = json.loads((daemon.home / "workspace" / "Workflow" / "w" /
                           "workflow.json").read_text())
    assert [s["id"] for s in manifest["schedules"]] == ["s"]
    assert not driver.find_elements(By.XPATH, "//a[.='Held']")


def preview_backfill(driver: Any, start: str, end: str) -> None:
    """Fill the job page's backfill range (the browser's date and time inputs) and ask
    for its dry run."""
    for name, value in (("from", start), ("to", end)):
        field = driver.find_element(By.CSS_SELECTOR, f"form.backfill input[name={name}]")
        driver.execute_script("arguments[0].value = arguments[1]", field, value)
    leads_on(driver, button(driver, "Preview the fire times"))


def test_fires_that_will_not_happen_backfill_form_and_delete_of_a_product_refused(
        tmp_path: Path, daemon_factory: Callable[..., DaemonProcess]) -> None:
    daemon, address, _record = make_site(tmp_path, daemon_factory,
                                         env={"SCHEDULER_ENABLED": "false"})
    with chromium() as driver:
        driver.get(f"{address.base}/schedules?token={address.token}")
        wait_for(driver, ready, what="the schedules")
        open_page(driver, address, "/schedules/workflow:w:s")
        note = driver.find_element(By.CSS_SELECTOR, ".wont-fire")
        assert note.text.startswith("None of these fires while the job is blocked: "
                                    "SCHEDULER_ENABLED=false")
        assert "not-firing" in driver.find_element(By.CSS_SELECTOR, "ol.fires"
                                                   ).get_attribute("class")
        for name in ("from", "to"):
            field = driver.find_element(By.CSS_SELECTOR, f"form.backfill input[name={name}]")
            assert field.get_attribute("type") == "datetime-local"
        zone = driver.find_element(By.CSS_SELECTOR, "input[name=zone]").get_attribute("value")
        assert zone  # the browser's own zone
        preview_backfill(driver, "2026-01-01T00:00", "2026-01-03T00:00")
        preview = driver.find_element(By.ID, "backfill-preview").text
        assert "(dry run: nothing ran)" in preview
        assert len(driver.find_elements(By.CSS_SELECTOR, "#backfill-preview li")) in (2, 3)
        assert driver.find_elements(  # a past range may run
            By.XPATH, "//button[starts-with(normalize-space(), 'Run these')]")
        shot(driver, "schedule-job-blocked")
        # A range that ends after now is a look ahead: nothing is offered to run.
        preview_backfill(driver, "2099-01-01T00:00", "2099-01-03T00:00")
        preview = driver.find_element(By.ID, "backfill-preview").text
        assert "The range ends after now" in preview and "Run these" not in preview
        # A refusal names the form's fields, not the method's params.
        preview_backfill(driver, "2026-01-03T00:00", "2026-01-01T00:00")
        said = driver.find_element(By.TAG_NAME, "main").text
        assert "“To”: must not be earlier than “From”" in said and "params." not in said

        open_page(driver, address, "/schedules")
        row = driver.find_element(By.XPATH, "//table[@class='jobs']//tr[td//a[.='Digest']]")
        assert "none (blocked)" in row.text
        open_page(driver, address, "/schedules?state=bogus")  # a link typed by hand
        assert "There is no state 'bogus': jobs of every state are shown." in flash(driver)
        assert driver.find_elements(By.XPATH, "//table[@class='jobs']//a[.='Digest']")

        # A product schedule is its product.yaml's: no Delete, and the method refuses it.
        open_page(driver, address, "/schedules/product:helper:brief")
        assert not driver.find_elements(By.XPATH, "//button[.='Delete']")
        assert "product.yaml" in driver.find_element(By.CSS_SELECTOR, ".actions").text
        page = driver.find_element(By.TAG_NAME, "html")
        driver.execute_script(
            "const form = document.createElement('form'); form.method = 'post';"
            "form.action = '/schedules/product:helper:brief/delete';"
            "for (const [k, v] of [['csrf', document.querySelector('meta[name=csrf-token]')"
            ".content], ['back', location.pathname]]) { const i = document.createElement("
            "'input'); i.type = 'hidden'; i.name = k; i.value = v; form.append(i); }"
            "document.body.append(form); form.submit();")
        wait_for(driver, staleness_of(page), what="the answer to the delete")
        wait_for(driver, ready, what="the job's page again")
        assert "refused" in flash(driver).lower() or "product" in flash(driver)
        assert "error" in driver.find_element(By.CSS_SELECTOR, ".flash").get_attribute("class")
        assert daemon.call("scheduler.jobs.get", {"id": "product:helper:brief"})

        # The browser's check of the id works in Chrome (the pattern compiles).
        open_page(driver, address, "/schedules/new")
        field = driver.find_element(By.ID, "f-id")
        field.send_keys("bad id!")
        assert driver.execute_script("return arguments[0].validity.patternMismatch", field)
        field.clear()
        field.send_keys("zero-jitter.1")
        assert driver.execute_script("return arguments[0].validity.valid", field)
        cron = driver.find_element(By.ID, "f-cron")
        cron.clear()
        cron.send_keys("0 99 * * *")
        # (the preview's answer changes the page's height: clicks wait for it)
        wait_for(driver, lambda d: "'0 99 * * *'" in d.find_element(By.ID, "preview").text,
                 what="the preview's answer")
        driver.find_element(By.CSS_SELECTOR, "input[name=group_ids][value=g1]").click()
        driver.find_element(By.NAME, "jitter_s").send_keys("0")
        leads_on(driver, button(driver, "Create"))
        body = driver.find_element(By.TAG_NAME, "main").text
        said = ("'0 99 * * *' is not a valid cron expression: in its hour field ('99'), "
                "99 is out of range 0-23")
        assert body.count("is not a valid") == 1 and said in body  # once, in words
        assert "cron_expression:" not in body and "workflow 'w'" not in body
        assert driver.find_element(By.NAME, "jitter_s").get_attribute("value") == "0"
        shot(driver, "schedule-cron-error")
        cron = driver.find_element(By.ID, "f-cron")
        cron.clear()
        cron.send_keys("0 5 * * *")
        wait_for(driver, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#preview li")) == 5,
                 what="the preview of the corrected expression")
        assert "is not a valid" not in driver.find_element(By.TAG_NAME, "main").text
        leads_on(driver, button(driver, "Create"))
        assert "Created workflow:w:zero-jitter.1" in flash(driver)
        open_page(driver, address, "/schedules/workflow:w:zero-jitter.1/edit")
        assert driver.find_element(By.NAME, "jitter_s").get_attribute("value") == "0"
        assert driver.find_element(By.NAME, "catchup_window_s").get_attribute("value") == "0"
        # Saved as shown: nothing is written, not even the defaults the form shows.
        manifest = daemon.home / "workspace" / "Workflow" / "w" / "workflow.json"
        before = manifest.read_bytes()
        leads_on(driver, button(driver, "Save"))
        assert "No change to workflow:w:zero-jitter.1" in flash(driver)
        assert manifest.read_bytes() == before
        open_page(driver, address, "/schedules/workflow:w:zero-jitter.1/edit")
        driver.find_element(By.NAME, "name").send_keys("Renamed")
        leads_on(driver, button(driver, "Save"))
        assert "Saved workflow:w:zero-jitter.1" in flash(driver)
        [saved] = [e for e in json.loads(manifest.read_text())["schedules"]
                   if e["id"] == "zero-jitter.1"]
        assert saved["name"] == "Renamed"
        assert "catchup_window_s" not in saved  # (shown as 0, never set: left unset)


def test_runs_listed_with_duration_cost_the_dead_letter_retried_whole_and_budgets(
        site: Site) -> None:
    daemon, address, driver, _record = site
    daemon.call("workspaces.create", {"id": "ws", "name": "Team"})
    breakers = [f"b{n}" for n in range(5)]
    for agent in breakers:
        daemon.call("agents.create", {"id": agent, "workspace_id": "ws", "name": agent,
                                      "profile": "broken"})
    daemon.call("agents.create", {"id": "writer", "workspace_id": "ws", "name": "Writer"})
    done = daemon.call("runs.enqueue", {"workspace_id": "ws", "agent_id": "writer",
                                        "reason": "fine"})["run"]["id"]
    daemon.call("runs.enqueue_many", {"runs": [
        {"workspace_id": "ws", "agent_id": breakers[n % 5], "reason": f"doomed-{n}",
         "coalesce": False} for n in range(55)]})
    daemon.wait_until(lambda: daemon.call("runs.list", {"status": "failed"})["total"] == 55
                      and daemon.call("runs.get", {"id": done})["status"] == "finished",
                      timeout=120, what="55 runs in the dead letter, one finished")

    open_page(driver, address, "/runs?agent_id=writer")
    heads = [h.text for h in driver.find_elements(By.CSS_SELECTOR, "table.runs th")]
    assert "Duration" in heads and "Cost" in heads
    link = driver.find_element(By.CSS_SELECTOR, f"a[href='/runs/{done}']")
    assert link.get_attribute("title") == done and link.text == done[:12] + "…"
    assert link.size["height"] < 30  # one line
    row = link.find_element(By.XPATH, "./ancestor::tr")
    assert "$0.03" in row.text and "s" in row.find_elements(By.CSS_SELECTOR, "td.num")[1].text
    shot(driver, "runs-columns")
    leads_on(driver, link)
    said = driver.find_element(By.CSS_SELECTOR, ".subtitle").text
    assert said.startswith("finished finished at ") and "after 1 attempt(s)" in said
    assert "not waiting" not in said

    open_page(driver, address, "/runs?status=bogus&agent_id=writer")  # a link typed by hand
    assert "There is no status 'bogus': runs of every status are shown." in flash(driver)
    assert driver.find_elements(By.CSS_SELECTOR, f"a[href='/runs/{done}']")
    shot(driver, "runs-unknown-status")

    open_page(driver, address, "/runs/dead")
    assert len(driver.find_elements(By.CSS_SELECTOR, "input[name=run]")) == 50  # one page
    for agent in breakers:  # their runs wait once queued again
        daemon.call("agents.update", {"id": agent, "status": "paused"})
    click_and_confirm(driver, button(driver, "Retry all 55"))
    assert "Retried 55 run(s)" in flash(driver)
    assert daemon.call("runs.list", {"status": "queued"})["total"] == 55
    assert "The dead letter is empty." in driver.find_element(By.CSS_SELECTOR, "table").text

    daemon.call("office.budgets.create", {"workspace_id": "ws", "scope_type": "agent",
                                          "scope_id": "writer", "limit_cents": 10,
                                          "period": "monthly", "alert_threshold_pct": 40})
    open_page(driver, address, "/office")
    spend = driver.find_element(By.CSS_SELECTOR, ".spend").text
    assert "30%" in spend and "alert at 40%" in spend
    shot(driver, "office-budget")


def test_charts_read_on_a_phone(site: Site) -> None:
    _daemon, address, _driver, _record = site
    with chromium(390, 844, dark=True) as phone:
        phone.get(address.url)
        wait_for(phone, ready, what="the overview")
        sizes = phone.execute_script(
            "return [...document.querySelectorAll('.plot .y-ticks span, .plot .x-ticks span,"
            " .plot .unit, .legend')].map(e => parseFloat(getComputedStyle(e).fontSize))")
        assert sizes and min(sizes) >= 11  # not 4 px of a scaled-down picture
        ticks = phone.execute_script(
            "return [...document.querySelectorAll('.plot .y-ticks span')].map(e => e.textContent)")
        assert all(t.isdigit() for t in ticks)
        assert phone.execute_script("return document.documentElement.scrollWidth") <= 390
        shot(phone, "overview-phone-charts")
