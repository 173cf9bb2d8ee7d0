"""``kandevd web url``: the address of the running console (with its token), the one the
config names while no daemon runs, and a clear error when the console is off."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from tests.support.console import console_of
from tests.support.daemon import FAST_CONFIG, DaemonProcess, run_cli

pytestmark = pytest.mark.integration


def test_web_url_prints_the_running_consoles_address(
        tmp_path: Path, daemon_factory: Callable[..., DaemonProcess]) -> None:
    home = tmp_path / "home"
    daemon = daemon_factory({**FAST_CONFIG, "web": {"listen": "127.0.0.1:0"}}, home=home)
    address = console_of(daemon)
    printed = run_cli(home, "web", "url")
    assert printed.returncode == 0 and printed.stdout.strip() == address.url
    assert daemon.stop() == 0
    assert not (home / "web.url").exists()  # gone with the daemon
    stopped = run_cli(home, "web", "url")  # port 0: known only while it runs
    assert stopped.returncode == 69 and "port 0" in stopped.stderr


def test_web_url_without_a_daemon_and_with_the_console_off(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    off = run_cli(home, "web", "url")
    assert off.returncode == 78 and "web.listen" in off.stderr
    (home / "kandevd.yaml").write_text(yaml.safe_dump({"web": {"listen": "127.0.0.1:7999"}}))
    on = run_cli(home, "web", "url")
    token = (home / "web.token").read_text().strip()
    assert on.stdout.strip() == f"http://127.0.0.1:7999/?token={token}"
    assert (home / "web.token").stat().st_mode & 0o777 == 0o600
    assert run_cli(home, "web", "url").stdout == on.stdout  # the same token each time
