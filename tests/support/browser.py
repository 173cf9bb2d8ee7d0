"""A real headless Chromium (Debian's ``chromium`` and ``chromium-driver``) driven by
Selenium, for the console's end-to-end tests and its screenshots."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
#: Chromium's own network chatter is refused on a closed machine: switched off.
FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--disable-extensions",
         "--disable-default-apps", "--mute-audio")


def available() -> bool:
    return Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()


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
        driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
            "width": width, "height": height, "deviceScaleFactor": 1, "mobile": True})
    try:
        yield driver
    finally:
        driver.quit()
        if profile_dir is None:
            shutil.rmtree(profile, ignore_errors=True)


def wait_for(driver: Any, condition: Callable[[Any], Any], timeout: float = 20.0,
             what: str = "condition") -> Any:
    return WebDriverWait(driver, timeout).until(condition, message=f"waiting for {what}")


def ready(driver: Any) -> bool:
    """The page's script has run (it marks the document)."""
    return driver.execute_script("return document.documentElement.dataset.ready") == "yes"


def full_screenshot(driver: Any, path: Path) -> None:
    """The whole page, not just the window: the window grows to the page's height."""
    height = driver.execute_script("return document.documentElement.scrollHeight")
    width = driver.get_window_size()["width"]
    driver.set_window_size(width, min(max(height + 120, 600), 6000))
    path.parent.mkdir(parents=True, exist_ok=True)
    driver.find_element(By.TAG_NAME, "body").screenshot(str(path))
