"""Signing a real Chromium in without leaving the token behind: ``kandevd web open``'s local
page posts it, the sign-in form takes it pasted; afterwards no file of the browser's
profile (its History database included) holds the token."""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
from selenium.webdriver.common.by import By

from tests.support.browser import chromium, needs_chromium, ready, wait_for
from tests.support.console import console_of, request
from tests.support.daemon import FAST_CONFIG, DaemonProcess, run_cli

pytestmark = [pytest.mark.integration, needs_chromium]


def files_holding(folder: Path, secret: str) -> list[Path]:
    found = []
    for root, _dirs, files in os.walk(folder):
        for name in files:
            path = Path(root) / name
            try:
                if secret.encode() in path.read_bytes():
                    found.append(path)
            except OSError:
                continue
    return found


def test_web_open_signs_in_and_the_token_stays_out_of_the_browser(
        tmp_path: Path, daemon_factory: Callable[..., DaemonProcess]) -> None:
    daemon = daemon_factory({**FAST_CONFIG, "web": {"listen": "127.0.0.1:0"}})
    address = console_of(daemon)
    opened = run_cli(daemon.home, "web", "open", env={"BROWSER": "true"})
    assert opened.returncode == 0, opened.stderr
    page = daemon.home / "web-open.html"
    assert stat.S_IMODE(page.stat().st_mode) == 0o600
    assert str(page) in opened.stdout and address.token not in opened.stdout
    profile = tmp_path / "profile"
    with chromium(profile_dir=profile) as driver:
        driver.get(page.as_uri())
        wait_for(driver, lambda d: d.current_url.rstrip("/") == address.base, what="the overview")
        wait_for(driver, ready, what="the overview ready")
        assert driver.find_element(By.TAG_NAME, "h1").text == "Overview"
        # The page's code was spent: posting it again signs nobody in.
        code = re.search(r'name="code" value="([^"]+)"', page.read_text()).group(1)
        again = request(address, "POST", "/login", body=f"code={code}")
        assert again.status == 403 and "Set-Cookie" not in again.headers
        assert "That sign-in page was used already, or it expired" in again.body
    assert address.token not in page.read_text()
    assert files_holding(profile, address.token) == []


def test_the_sign_in_form_takes_the_token_pasted(
        tmp_path: Path, daemon_factory: Callable[..., DaemonProcess]) -> None:
    daemon = daemon_factory({**FAST_CONFIG, "web": {"listen": "127.0.0.1:0"}})
    address = console_of(daemon)
    profile = tmp_path / "profile"
    with chromium(profile_dir=profile) as driver:
        driver.get(address.base + "/runs?status=queued")
        assert "not signed in" in driver.find_element(By.TAG_NAME, "main").text
        driver.find_element(By.NAME, "token").send_keys("not-the-token")
        driver.find_element(By.CSS_SELECTOR, "form.sign-in-form button").click()
        wait_for(driver, lambda d: d.find_element(By.ID, "sign-in-problem").is_displayed(),
                 what="the refusal")
        driver.find_element(By.NAME, "token").send_keys(address.token)
        driver.find_element(By.CSS_SELECTOR, "form.sign-in-form button").click()
        wait_for(driver, lambda d: d.current_url == address.base + "/runs?status=queued",
                 what="the page asked for")
        wait_for(driver, ready, what="the runs page ready")
    assert files_holding(profile, address.token) == []
