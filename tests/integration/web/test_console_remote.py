"""A console reachable from other machines: refused over plain HTTP unless said out loud,
served over HTTPS with a certificate, and a TLS client that never finishes its handshake
stalls nobody."""

from __future__ import annotations

import http.client
import socket
import ssl
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from kandevd import exits
from tests.support.certs import make_certificate
from tests.support.console import console_of
from tests.support.daemon import FAST_CONFIG, DaemonProcess, run_cli

pytestmark = pytest.mark.integration


def test_a_remote_listen_address_needs_tls_or_consent(
        tmp_path: Path, daemon_factory: Callable[..., DaemonProcess]) -> None:
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    (home / "kandevd.yaml").write_text(yaml.safe_dump({"web": {"listen": "0.0.0.0:0"}}))
    checked = run_cli(home, "validate")
    assert checked.returncode == 1 and "web.listen" in checked.stdout + checked.stderr
    daemon = daemon_factory({**FAST_CONFIG, "web": {"listen": "0.0.0.0:0"}}, home=home,
                            start=False)
    daemon.start(wait_ready=False)
    assert daemon.wait(timeout=30) == exits.CONFIG
    assert "web.listen" in daemon.log_text and "tls_cert" in daemon.log_text

    consent = daemon_factory({**FAST_CONFIG, "web": {"listen": "0.0.0.0:0",
                                                     "insecure_remote": True}},
                             home=tmp_path / "consent")
    consent.wait_for_line("over plain HTTP (web.insecure_remote)")
    assert console_of(consent).url.startswith("http://127.0.0.1:")


def test_an_unusable_certificate_is_a_config_error(
        tmp_path: Path, daemon_factory: Callable[..., DaemonProcess]) -> None:
    daemon = daemon_factory({**FAST_CONFIG, "web": {
        "listen": "127.0.0.1:0", "tls_cert": str(tmp_path / "missing.pem"),
        "tls_key": str(tmp_path / "missing.key")}}, start=False)
    checked = run_cli(daemon.home, "validate")
    assert checked.returncode == 1 and "web.tls_cert" in checked.stderr
    daemon.start(wait_ready=False)
    assert daemon.wait(timeout=30) == exits.CONFIG
    assert "web.tls_cert" in daemon.log_text


def test_the_console_over_https(tmp_path: Path,
                                daemon_factory: Callable[..., DaemonProcess]) -> None:
    cert, key = make_certificate(tmp_path)
    daemon = daemon_factory({**FAST_CONFIG, "web": {
        "listen": "127.0.0.1:0", "tls_cert": str(cert), "tls_key": str(key)}})
    address = console_of(daemon)
    assert address.url.startswith("https://127.0.0.1:")
    context = ssl.create_default_context(cafile=str(cert))

    def get(path: str, cookie: str | None = None) -> http.client.HTTPResponse:
        conn = http.client.HTTPSConnection("127.0.0.1", address.port, context=context,
                                           timeout=30)
        conn.request("GET", path, headers={"Cookie": cookie} if cookie else {})
        answer = conn.getresponse()
        answer.read()
        conn.close()
        return answer

    # A client that opens a connection and never says hello holds up nobody.
    silent = socket.create_connection(("127.0.0.1", address.port))
    try:
        started = time.monotonic()
        signed = get(f"/?token={address.token}")
        assert signed.status == 200
        cookie = signed.headers["Set-Cookie"]
        assert "Secure" in cookie and "HttpOnly" in cookie
        assert get("/schedules", cookie.split(";", 1)[0]).status == 200
        assert time.monotonic() - started < 5.0
    finally:
        silent.close()
    # Plain HTTP on the HTTPS port gets nothing.
    plain = http.client.HTTPConnection("127.0.0.1", address.port, timeout=30)
    with pytest.raises((http.client.HTTPException, OSError)):
        plain.request("GET", f"/?token={address.token}")
        plain.getresponse().read()
    plain.close()
    url = run_cli(daemon.home, "web", "url")
    assert url.returncode == 0 and url.stdout.startswith("https://")
