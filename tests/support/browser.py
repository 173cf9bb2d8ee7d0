"""A real headless Chromium (Debian's ``chromium`` and ``chromium-driver``) driven by
Selenium, for the console's end-to-end tests and its screenshots."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from selenium import webdriver
from selenium.common.exceptions import WebDriverException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.expected_conditions import staleness_of
from selenium.webdriver.support.ui import WebDriverWait

from tests.support.console import ARTIFACTS, ConsoleAddress

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
#: Chromium's own network chatter is refused on a closed machine: switched off.
FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--disable-extensions",
         "--disable-default-apps", "--mute-audio")


def available() -> bool:
    return Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()


#: The mark of a test that drives this browser: skipped where it is not installed.
needs_chromium = pytest.mark.skipif(not available(),
                                    reason="needs Debian's chromium and chromium-driver")


@contextmanager
def chromium(width: int = 1280, height: int = 900, *, dark: bool = False,
             profile_dir: Path | None = None) -> Iterator[Any]:
    """A browser on a new profile (``profile_dir`` is kept after it quits; else removed)."""
    profile = str(profile_dir) if profile_dir else tempfile.mkdtemp(prefix="kandevd-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile}")
    options.add_argument(f"--window-size={width},{height}")
    if dark:
        options.add_argument("--force-dark-mode")
        options.add_argument("--blink-settings=preferredColorScheme=0")
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    if width < 500:  # narrower than a headless window gets: a phone's screen, emulated
        driver.phone_screen = (width, height)
        driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
            "width": width, "height": height, "deviceScaleFactor": 1, "mobile": True})
    try:
        yield driver
    finally:
        driver.quit()
        if profile_dir is None:
            shutil.rmtree(profile, ignore_errors=True)


#: What ChromeDriver answers when a command meets a page that is being replaced (a
#: navigation under way), instead of a stale element: the next poll sees the new page.
_IN_TRANSITION = ("Cannot find context with specified id", "unhandled inspector error",
                  "Execution context was destroyed")


def wait_for(driver: Any, condition: Callable[[Any], Any], timeout: float = 20.0,
             what: str = "condition") -> Any:
    def polled(d: Any) -> Any:
        try:
            return condition(d)
        except WebDriverException as exc:
            if any(text in str(exc) for text in _IN_TRANSITION):
                return False
            raise
    return WebDriverWait(driver, timeout).until(polled, message=f"waiting for {what}")


def ready(driver: Any) -> bool:
    """The page's script has run (it marks the document)."""
    # (Between two pages there may be no document element yet: not ready.)
    return driver.execute_script(
        "return document.documentElement && document.documentElement.dataset.ready") == "yes"


def full_screenshot(driver: Any, path: Path) -> None:
    """The whole page, not just the window: the window (an emulated phone's screen)
    grows to the page's height, and is put back after."""
    height = driver.execute_script("return document.documentElement.scrollHeight")
    path.parent.mkdir(parents=True, exist_ok=True)
    phone = getattr(driver, "phone_screen", None)
    if phone is None:
        width = driver.get_window_size()["width"]
        driver.set_window_size(width, min(max(height + 120, 600), 6000))
        driver.find_element(By.TAG_NAME, "body").screenshot(str(path))
        return
    metrics = {"width": phone[0], "deviceScaleFactor": 1, "mobile": True}
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                           {**metrics, "height": min(max(height, phone[1]), 6000)})
    try:
        driver.find_element(By.TAG_NAME, "body").screenshot(str(path))
    finally:
        driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                               {**metrics, "height": phone[1]})


def open_page(driver: Any, address: ConsoleAddress, path: str) -> None:
    driver.get(address.base + path)
    wait_for(driver, ready, what=f"{path} ready")


def shot(driver: Any, name: str) -> None:
    """The page as a screenshot among the test's artifacts."""
    full_screenshot(driver, ARTIFACTS / f"{name}.png")
    driver.set_window_size(1280, 900)


def leads_on(driver: Any, element: Any, *, confirm: bool = False) -> None:
    """Click what loads a new page (accepting its confirmation), and wait for that page."""
    old = driver.find_element(By.TAG_NAME, "html")
    element.click()
    if confirm:
        wait_for(driver, lambda d: d.switch_to.alert, what="the confirmation").accept()
    wait_for(driver, staleness_of(old), what="the next page")
    wait_for(driver, ready, what="the next page ready")


def click_and_confirm(driver: Any, element: Any) -> None:
    leads_on(driver, element, confirm=True)


def flash(driver: Any) -> str:
    """The line at the top of the page that says what the last action did."""
    return wait_for(driver, lambda d: d.find_element(By.CSS_SELECTOR, ".flash"),
                    what="the confirmation message").text


def button(driver: Any, label: str) -> Any:
    return driver.find_element(By.XPATH, f"//button[normalize-space()='{label}']")
