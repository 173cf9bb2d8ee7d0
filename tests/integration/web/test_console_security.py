"""The console's guards through the real daemon: no token no data, a foreign Host refused,
CSRF required, what comes from files, agents and logs escaped, nothing outside its own
static files served."""

from __future__ import annotations

import http.client
import json
import re
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support.console import ConsoleAddress, console_of, request, sign_in
from tests.support.daemon import FAST_CONFIG, DaemonProcess
from tests.support.workflows import RECORDER, schedule, write_workflow

pytestmark = pytest.mark.integration

EVIL = "<script>alert(1)</script>"


@pytest.fixture
def console(tmp_path: Path, daemon_factory: Callable[..., DaemonProcess]
            ) -> tuple[DaemonProcess, ConsoleAddress]:
    home = tmp_path / "home"
    write_workflow(home / "workspace", "w", [schedule("s", name=EVIL, messages=[EVIL])],
                   label=EVIL)
    daemon = daemon_factory({**FAST_CONFIG, "web": {"listen": "127.0.0.1:0"},
                             "agents": {"default": {"command": [sys.executable, RECORDER],
                                                    "env": {"RECORD_FILE": str(tmp_path / "r")}}}},
                            home=home)
    return daemon, console_of(daemon)


PAGES = ["/", "/schedules", "/runs", "/runs/dead", "/agents", "/office",
         "/fragments/overview", "/schedules/workflow:w:s", "/events/overview"]


def test_no_token_no_page_nor_data(console: tuple[DaemonProcess, ConsoleAddress]) -> None:
    _daemon, address = console
    for path in PAGES:
        answer = request(address, "GET", path)
        assert answer.status == 401, path
        assert "workflow:w" not in answer.body and EVIL not in answer.body  # no data
        assert 'action="/login"' in answer.body  # only the sign-in form
    wrong = request(address, "GET", "/?token=not-the-token")
    assert wrong.status == 403
    assert request(address, "GET", "/", cookie=f"{address.cookie_name}=forged").status == 401


def test_the_token_buys_a_strict_cookie_and_leaves_the_url(
        console: tuple[DaemonProcess, ConsoleAddress]) -> None:
    daemon, address = console
    answer = request(address, "GET", f"/runs?status=queued&token={address.token}")
    assert answer.status == 200  # a page that moves on (SameSite=Strict survives a link)
    assert 'content="0; url=/runs?status=queued"' in answer.body
    assert address.token not in answer.body
    cookie = answer.headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
    token_file = daemon.home / "web.token"
    assert oct(token_file.stat().st_mode & 0o777) == "0o600"
    page = request(address, "GET", "/runs", cookie=cookie.split(";")[0])
    assert page.status == 200
    csp = page.headers["Content-Security-Policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp
    assert "default-src 'none'" in csp and "frame-ancestors 'none'" in csp
    assert page.headers["X-Content-Type-Options"] == "nosniff"


def test_a_foreign_host_is_refused_even_signed_in(
        console: tuple[DaemonProcess, ConsoleAddress]) -> None:
    _daemon, address = console
    cookie = sign_in(address)
    port = address.host.rsplit(":", 1)[1]
    for host in (f"evil.example:{port}", "evil.example", f"127.0.0.1.evil.example:{port}", ""):
        answer = request(address, "GET", "/", cookie=cookie, host=host)
        assert answer.status in (400, 421), host
        assert "workflow:w" not in answer.body
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "localhost:9999"):  # a tunnel
        assert request(address, "GET", "/", cookie=cookie, host=host).status == 200


def test_a_post_needs_the_pages_csrf_token(
        console: tuple[DaemonProcess, ConsoleAddress]) -> None:
    daemon, address = console
    cookie = sign_in(address)
    page = request(address, "GET", "/schedules", cookie=cookie).body
    csrf = re.search(r'name="csrf-token" content="([0-9a-f]+)"', page).group(1)
    body = "paused=yes&note=x"
    assert request(address, "POST", "/schedules/pause", cookie=cookie, body=body).status == 403
    assert request(address, "POST", "/schedules/pause", cookie=cookie,
                   body=body + "&csrf=0000").status == 403
    for foreign in ("http://evil.example", "null"):  # (null: a sandboxed frame, a file)
        cross = request(address, "POST", "/schedules/pause", cookie=cookie,
                        body=body + f"&csrf={csrf}", headers={"Origin": foreign})
        assert cross.status == 403, foreign
    assert daemon.call("scheduler.config.get")["globally_paused"] is False  # none acted
    for path in ("/schedules/workflow:w:s/delete", "/runs/dead/retry-all"):
        assert request(address, "POST", path, cookie=cookie, body="back=/").status == 403
        assert request(address, "POST", path, cookie=cookie, body=f"csrf={csrf}",
                       headers={"Origin": "http://evil.example"}).status == 403
    assert daemon.call("scheduler.jobs.get", {"id": "workflow:w:s"})  # not deleted
    done = request(address, "POST", "/schedules/pause", cookie=cookie,
                   body=body + f"&csrf={csrf}", headers={"Origin": address.base})
    assert done.status == 303
    assert daemon.call("scheduler.config.get")["globally_paused"] is True


def test_a_form_sent_signed_out_signs_in_back_to_its_page(
        console: tuple[DaemonProcess, ConsoleAddress]) -> None:
    """Signing in does not repeat the POST: it goes back to the page the form was on
    (never to another site's), and the action's address opened as a page says what it
    is in the console's dress."""
    daemon, address = console
    job_page = f"{address.base}/schedules/workflow:w:s?user=x"
    for referer, back in ((job_page, "/schedules/workflow:w:s?user=x"),
                          ("http://evil.example/schedules", "/"), (None, "/")):
        answer = request(address, "POST", "/schedules/workflow:w:s/disable", body="csrf=x",
                         headers={"Referer": referer} if referer else {})
        assert answer.status == 401
        assert f'name="next" value="{back}"' in answer.body, referer
    assert daemon.call("scheduler.jobs.get", {"id": "workflow:w:s"})["enabled"] is True
    cookie = sign_in(address)
    opened = request(address, "GET", "/schedules/workflow:w:s/disable", cookie=cookie)
    assert opened.status == 405
    assert "takes a form&#39;s submission" in opened.body and 'href="/schedules"' in opened.body


def test_a_runs_page_past_the_end_says_so_and_any_offset_is_a_page(
        console: tuple[DaemonProcess, ConsoleAddress]) -> None:
    daemon, address = console
    daemon.call("workspaces.create", {"id": "ws", "name": "ws"})
    daemon.call("agents.create", {"id": "a", "workspace_id": "ws", "name": "a",
                                  "status": "paused"})
    daemon.call("runs.enqueue", {"workspace_id": "ws", "agent_id": "a", "reason": "r"})
    cookie = sign_in(address)
    past = request(address, "GET", "/runs?agent_id=a&offset=100", cookie=cookie)
    assert past.status == 200
    assert "Nothing on this page: the list holds 1 run(s)." in past.body
    assert 'href="/runs?agent_id=a">The first page' in past.body
    none = request(address, "GET", "/runs?agent_id=nobody", cookie=cookie)
    assert "No run matches." in none.body
    for offset in ("-5", "abc", str(10 ** 20)):
        assert request(address, "GET", f"/runs?offset={offset}", cookie=cookie).status == 200


def test_names_labels_outputs_and_logs_are_shown_as_text(
        console: tuple[DaemonProcess, ConsoleAddress]) -> None:
    daemon, address = console
    cookie = sign_in(address)
    daemon.call("scheduler.jobs.trigger", {"id": "workflow:w:s"})

    def ended() -> dict[str, Any] | None:
        items = daemon.call("scheduler.jobs.runs", {"id": "workflow:w:s"})["items"]
        return items[0] if items and items[0]["status"] != "running" else None
    entry = daemon.wait_until(ended, what="the session's end")
    assert EVIL[:15] in entry["turns"][0]["output"]  # the agent's output has the tag
    assert EVIL[:15] in Path(entry["turns"][0]["log_path"]).read_text()  # and so has the log
    pages = ["/schedules", "/schedules/workflow:w:s",
             f"/schedules/workflow:w:s/runs/{entry['id']}"]
    for path in pages:
        body = request(address, "GET", path, cookie=cookie).body
        assert "<script>alert" not in body and "<script" not in body.replace(
            '<script src="/static/console.js" defer></script>', ""), path
        assert "&lt;script&gt;" in body, path


@pytest.mark.parametrize("path", [
    "/static/../kandevd.yaml", "/static/..%2fweb.token", "/static/%2e%2e/web.token",
    "/static/templates/base.html", "/static/../../etc/passwd", "/static/console.css/../x",
    "/static/", "/static/app.py", "/../kandevd.yaml", "/web.token"])
def test_nothing_but_the_consoles_own_static_files_is_served(
        console: tuple[DaemonProcess, ConsoleAddress], path: str) -> None:
    _daemon, address = console
    cookie = sign_in(address)
    answer = request(address, "GET", path, cookie=cookie)
    assert answer.status in (400, 404), (path, answer.status)
    assert address.token not in answer.body and "listen" not in answer.body


def test_the_static_files_are_the_consoles_own(
        console: tuple[DaemonProcess, ConsoleAddress]) -> None:
    _daemon, address = console
    script = request(address, "GET", "/static/console.js")
    assert script.status == 200 and "EventSource" in script.body
    assert "text/javascript" in script.headers["Content-Type"]
    assert json.dumps("http") not in script.body  # no other origin named in it


def test_a_backfill_range_the_picker_cannot_give_is_named_not_a_500(
        console: tuple[DaemonProcess, ConsoleAddress]) -> None:
    """A form posted by hand (the page's date picker gives no such value): one that
    does not exist was a ValueError and a 500 with a traceback in the log."""
    daemon, address = console
    cookie = sign_in(address)
    page = request(address, "GET", "/schedules/workflow:w:s", cookie=cookie).body
    csrf = re.search(r'name="csrf-token" content="([0-9a-f]+)"', page).group(1)
    for start, end in (("2026-01-01T00:00", "2026-02-30T00:00"),
                       ("2026-12-01T25:00", "2026-12-02T00:00")):
        answer = request(address, "POST", "/schedules/workflow:w:s/backfill", cookie=cookie,
                         body=f"from={start}&to={end}&zone=UTC&csrf={csrf}",
                         headers={"Origin": address.base})
        assert answer.status == 303, answer.status  # back to the page, which says why
        flash = answer.headers["Set-Cookie"].split(";")[0]
        shown = request(address, "GET", answer.headers["Location"],
                        cookie=f"{cookie}; {flash}").body
        label, wrong = ("“To”", end) if start.startswith("2026-01") else ("“From”", start)
        assert f"{label}: &#39;{wrong}&#39; is not a date and time that exists" in shown, \
            shown
    assert "Traceback" not in daemon.log_text


def test_head_answers_headers_only_and_the_kept_connection_stays_in_step(
        console: tuple[DaemonProcess, ConsoleAddress]) -> None:
    _daemon, address = console
    cookie = sign_in(address)
    conn = http.client.HTTPConnection("127.0.0.1", address.port, timeout=30)
    try:
        for path in ("/runs", "/static/console.css"):
            conn.request("HEAD", path, headers={"Host": address.host, "Cookie": cookie})
            head = conn.getresponse()
            assert head.status == 200 and int(head.headers["Content-Length"]) > 0
            assert head.read() == b""
            conn.request("GET", path, headers={"Host": address.host, "Cookie": cookie})
            page = conn.getresponse()  # (a body sent after the HEAD would be read here)
            assert page.status == 200
            assert len(page.read()) == int(page.headers["Content-Length"])
    finally:
        conn.close()
    with socket.create_connection(("127.0.0.1", address.port), timeout=30) as sock:
        sock.sendall(b"HEAD / HTTP/1.1\r\nHost: " + address.host.encode() + b"\r\n\r\n")
        answer = b""
        while chunk := sock.recv(65536):  # (closed after an anonymous answer)
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 401") and answer.endswith(b"\r\n\r\n")
