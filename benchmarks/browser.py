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
