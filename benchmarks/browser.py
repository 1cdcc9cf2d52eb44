"""A headless Chromium for looking at the planner dashboard (tests and benchmarks).

Debian's `chromium` and `chromium-driver`, driven through selenium. No network
beyond loopback is needed: the dashboard bundles its chart library.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any


class BrowserUnavailable(RuntimeError):
    pass


@contextlib.contextmanager
def headless_chromium(width: int = 1400, height: int = 1400) -> Iterator[Any]:
    """A selenium WebDriver on a headless Chromium, its profile in a temporary dir."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError as e:
        raise BrowserUnavailable("selenium is not installed: pip install selenium") from e
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if binary is None or driver_path is None:
        raise BrowserUnavailable("Chromium is missing: apt-get install chromium chromium-driver")
    profile = tempfile.mkdtemp(prefix="diptych-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = binary
    for flag in (
        "--headless=new",
        "--no-sandbox",  # root in a container
        "--disable-dev-shm-usage",
        "--disable-gpu",
        f"--window-size={width},{height}",
        f"--user-data-dir={profile}",
        "--no-first-run",
        "--disable-extensions",
    ):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(driver_path), options=opts)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def wait_for(check: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll `check` until it returns something truthy; TimeoutError says `what`."""
    end = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > end:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.25)


def full_page_screenshot(driver: Any, path: str, width: int = 1400) -> None:
    """The whole page, not just the window: the window grows to the page's height (a
    second for the page to lay out again and redraw at that size) before the shot."""
    for _ in range(2):  # the window's own frame takes some of its height: measure again
        height = driver.execute_script("return document.documentElement.scrollHeight")
        inner = driver.execute_script("return window.innerHeight")
        driver.set_window_size(width, driver.get_window_size()["height"] + height - inner + 8)
        time.sleep(1.0)
    driver.save_screenshot(path)


def dashboard_filled(driver: Any) -> bool:
    """Every tile of the planner dashboard shows a value and every chart series has
    points (the page's own `window.dashboard` says)."""
    return bool(
        driver.execute_script(
            "const d = window.dashboard; if (!d || !d.tiles) return false;"
            "return Object.values(d.tiles()).every(v => v && v !== '–') &&"
            " Object.keys(d.charts).every(n => Math.min(...d.points(n)) >= 2)"
        )
    )
