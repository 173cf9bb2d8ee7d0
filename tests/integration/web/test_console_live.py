"""Live views through the real daemon's console: a page that leaves ends its streams at
once (``POST /events/leave``), so the next page finds a slot; only with the page's
CSRF token; and a real browser says so as it navigates away."""

from __future__ import annotations

import http.client
import json
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from selenium.webdriver.common.by import By

from tests.support.browser import chromium, needs_chromium, open_page, ready, shot, wait_for
from tests.support.console import ConsoleAddress, console_config, console_of, request, sign_in
from tests.support.daemon import DaemonProcess

pytestmark = pytest.mark.integration

#: Well below the streams' keep-alive (20 s): a stream that ends within it was ended by
#: its page's leave, not found gone by a keep-alive written to a closed connection.
ENDED_WITHIN_S = 10.0


@pytest.fixture
def console(tmp_path: Path, daemon_factory: Callable[..., DaemonProcess]
            ) -> tuple[DaemonProcess, ConsoleAddress]:
    daemon = daemon_factory(console_config(tmp_path / "record.jsonl"), home=tmp_path / "home")
    daemon.call("workspaces.create", {"id": "ws", "name": "Team"})
    daemon.call("agents.create", {"id": "writer", "workspace_id": "ws", "name": "Writer"})
    daemon.call("agents.update", {"id": "writer", "status": "paused"})  # runs stay queued
    return daemon, console_of(daemon)


class Opened:
    """One stream asked for: accepted (with its id) or refused as busy."""

    def __init__(self, address: ConsoleAddress, cookie: str, path: str) -> None:
        parts = urlsplit(address.base)
        self.conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
        self.conn.request("GET", path, headers={"Host": address.host, "Cookie": cookie})
        self.answer = self.conn.getresponse()
        assert self.answer.status == 200
        self.id: str | None = None
        self.busy = False
        event = None
        while (line := self.answer.fp.readline()) and self.id is None and not self.busy:
            if line.startswith(b"event: "):
                event = line[7:].strip()
            elif line.startswith(b"data: ") and event in (b"ready", b"busy"):
                self.busy = event == b"busy"
                self.id = json.loads(line[6:]).get("id") if event == b"ready" else None
        assert self.id or self.busy, f"{path}: neither accepted nor refused"

    def rest_until(self, last: bytes) -> bytes:
        """What the stream sends up to a line ``last`` (raw, chunked; a socket timeout if
        it does not come within :data:`ENDED_WITHIN_S`)."""
        assert self.conn.sock is not None
        self.conn.sock.settimeout(ENDED_WITHIN_S)
        sent = b""
        while (line := self.answer.fp.readline()) != last:
            assert line, "the connection closed"
            sent += line
        return sent

    def rest_until_ended(self) -> bytes:
        """What the stream still sends before its response ends (its last, empty chunk)."""
        return self.rest_until(b"0\r\n")

    def close(self) -> None:
        self.conn.close()


@contextmanager
def streams(address: ConsoleAddress, cookie: str, paths: list[str]) -> Iterator[list[Opened]]:
    opened: list[Opened] = []
    try:
        for path in paths:
            opened.append(Opened(address, cookie, path))
        yield opened
    finally:
        for stream in opened:
            stream.close()


def csrf_of(address: ConsoleAddress, cookie: str) -> str:
    page = request(address, "GET", "/runs", cookie=cookie).body
    found = re.search(r'name="csrf-token" content="([0-9a-f]+)"', page)
    assert found is not None
    return found.group(1)


def test_a_page_that_leaves_frees_its_live_views_at_once(
        console: tuple[DaemonProcess, ConsoleAddress]) -> None:
    daemon, address = console
    run = daemon.call("runs.enqueue", {"workspace_id": "ws", "agent_id": "writer",
                                       "reason": "r"})["run"]["id"]
    cookie = sign_in(address)
    csrf = csrf_of(address, cookie)
    paths = ["/events/overview", f"/events/run/{run}", "/events/runs", "/events/overview"]
    with streams(address, cookie, paths) as held:
        assert all(stream.id for stream in held)
        with streams(address, cookie, ["/events/overview"]) as (late,):
            assert late.busy  # every slot is held

        overview, log = held[0], held[1]
        leaving = f"streams={overview.id},{log.id}"
        # Not without the page's token, nor from another origin: the streams stay.
        assert request(address, "POST", "/events/leave", cookie=cookie,
                       body=leaving).status == 403
        assert request(address, "POST", "/events/leave", cookie=cookie,
                       body=f"{leaving}&csrf={csrf}",
                       headers={"Origin": "http://evil.example"}).status == 403
        with streams(address, cookie, ["/events/overview"]) as (late,):
            assert late.busy

        # An id the console never gave changes nothing; the page's own ids end its streams.
        assert request(address, "POST", "/events/leave", cookie=cookie,
                       body=f"streams=nosuch&csrf={csrf}").status == 204
        answer = request(address, "POST", "/events/leave", cookie=cookie,
                         body=f"{leaving}&csrf={csrf}", headers={"Origin": address.base})
        assert answer.status == 204 and answer.body == ""
        for stream in (overview, log):
            assert b"keepalive" not in stream.rest_until_ended()  # ended by the leave

        with streams(address, cookie, ["/events/overview", f"/events/run/{run}"]) as again:
            assert all(stream.id for stream in again)  # both freed slots taken at once
        # The streams not named go on.
        daemon.call("runs.cancel", {"id": run})
        held[2].rest_until(b"event: refresh\n")


def free_slots(address: ConsoleAddress, cookie: str, csrf: str, count: int) -> bool:
    """Whether ``count`` streams are accepted now; those that were end at once (a
    connection closed here would hold its slot until its next keep-alive)."""
    with streams(address, cookie, ["/events/overview"] * count) as opened:
        accepted = [stream.id for stream in opened if stream.id]
        if accepted:
            assert request(address, "POST", "/events/leave", cookie=cookie,
                           body=f"streams={','.join(accepted)}&csrf={csrf}").status == 204
        return len(accepted) == count


@contextmanager
def signed_in_browser(address: ConsoleAddress, path: str) -> Iterator[tuple[Any, str, str]]:
    """Chromium signed in on ``path``; and the cookie and CSRF token of a plain client."""
    cookie = sign_in(address)
    csrf = csrf_of(address, cookie)
    with chromium() as driver:
        driver.get(f"{address.base}{path}?token={address.token}")
        wait_for(driver, ready, what=f"{path} ready")
        yield driver, cookie, csrf


@needs_chromium
def test_a_browser_ends_its_live_views_as_it_navigates_away(
        console: tuple[DaemonProcess, ConsoleAddress]) -> None:
    _daemon, address = console
    with signed_in_browser(address, "/schedules") as (driver, cookie, csrf):
        # Quick navigation: more pages with a live view than the console has slots. (Each
        # may take a while to go live on a busy machine: what tells is the end.)
        for path in ["/", "/runs", "/", "/runs", "/", "/runs"]:
            open_page(driver, address, path)
            box = driver.find_element(By.CSS_SELECTOR, "[data-events]")
            wait_for(driver, lambda _d, box=box: box.get_attribute("data-live-state") == "live",
                     timeout=60, what=f"{path}'s live view accepted")
        # No live view here. Every slot is free again well before the last page's stream
        # would have written its first keep-alive (which is when a stream whose page
        # left without a word ends).
        open_page(driver, address, "/schedules")
        wait_for(driver, lambda _d: free_slots(address, cookie, csrf, 4), timeout=ENDED_WITHIN_S,
                 what="every slot free after the pages left")


@needs_chromium
def test_a_live_view_says_when_it_reconnects_and_when_it_is_refused(
        console: tuple[DaemonProcess, ConsoleAddress]) -> None:
    _daemon, address = console
    with signed_in_browser(address, "/runs") as (driver, cookie, csrf):
        box = driver.find_element(By.ID, "runs-live")
        wait_for(driver, lambda _d: box.get_attribute("data-live-state") == "live",
                 what="the list live")

        def end_the_pages_stream() -> None:
            ids = driver.execute_script("return [...liveSources].map(s => s.streamId)")
            assert request(address, "POST", "/events/leave", cookie=cookie,
                           body=f"streams={','.join(ids)}&csrf={csrf}").status == 204

        # The stream breaks: the page says it reconnects, and goes live again by itself.
        end_the_pages_stream()
        wait_for(driver, lambda _d: box.get_attribute("data-live-state") in
                 ("reconnecting", "live"), what="the stream broken")
        wait_for(driver, lambda _d: box.get_attribute("data-live-state") == "live"
                 and not _d.find_elements(By.CSS_SELECTOR, ".live-notice"), timeout=30,
                 what="live again, the notice gone")

        # Signed out meanwhile: the console refuses the stream, and the page says so.
        driver.delete_all_cookies()
        end_the_pages_stream()
        notice = wait_for(driver, lambda d: box.get_attribute("data-live-state") == "closed"
                          and d.find_element(By.CSS_SELECTOR, ".live-notice"), timeout=30,
                          what="the refusal said")
        assert notice.text.startswith("Not live any more")
        assert notice.find_element(By.TAG_NAME, "a").text == "Load the page again"
        shot(driver, "runs-not-live")
