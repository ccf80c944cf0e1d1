"""Headless Chromium driven through selenium, for the tests of `nmt serve`'s page and the script that makes its
screenshot (docs/page_screenshot.py)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

CHROMIUM = ("chromium", "chromium-browser", "google-chrome")
DRIVER = "chromedriver"
# No sandbox (the tests may run as root), no GPU, and none of the connections Chromium makes on its own: a
# machine without internet refuses them, many at a time.
FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
         "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-default-apps", "--disable-extensions")


class BrowserMissing(RuntimeError):
    """Chromium, its driver or selenium is not installed."""


def headless_chromium(width: int = 1000, height: int = 800) -> Any:
    """A selenium WebDriver on the machine's own Chromium and ChromeDriver (nothing downloaded), with a new
    empty profile; BrowserMissing names what is not installed."""
    try:
        from selenium import webdriver
    except ImportError:
        raise BrowserMissing("selenium is not installed (pip install selenium)") from None
    browser = next((found for name in CHROMIUM if (found := shutil.which(name))), None)
    driver = shutil.which(DRIVER)
    if browser is None or driver is None:
        raise BrowserMissing("Chromium or ChromeDriver is not installed (apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in (*FLAGS, f"--window-size={width},{height}",
                 f"--user-data-dir={tempfile.mkdtemp(prefix='nmt-chromium-')}"):
        options.add_argument(flag)
    return webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=driver))


def page_text(driver: Any, css: str) -> list[str]:
    """The text of each element `css` selects (textContent, so whitespace is kept as the page holds it)."""
    return [e.get_attribute("textContent") for e in driver.find_elements("css selector", css)]


def shot(driver: Any, path: Path) -> Path:
    """A PNG screenshot of the whole page."""
    driver.save_screenshot(str(path))
    return path
