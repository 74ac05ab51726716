"""Headless Chromium from the system's packages, driven by selenium (no browser download).

``find_browser()`` locates Debian's ``chromium`` and ``chromium-driver`` (or Chrome and a
chromedriver on PATH; ``MTPSERVE_CHROMIUM`` / ``MTPSERVE_CHROMEDRIVER`` override) and says why
when it cannot. Selenium Manager, which would download a browser, is never consulted: the driver
path is given explicitly and ``SE_OFFLINE`` forbids it any network access.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
DRIVERS = ("chromedriver",)
#: Debian's chromium-driver also installs the driver here
DRIVER_PATHS = ("/usr/lib/chromium/chromedriver", "/usr/bin/chromedriver")


def find_browser() -> tuple[str, str] | str:
    """(browser, driver) paths, or the reason no headless browser can run here."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[dev]')"
    browser = os.environ.get("MTPSERVE_CHROMIUM") or next(
        (p for p in map(shutil.which, BROWSERS) if p), None
    )
    driver = os.environ.get("MTPSERVE_CHROMEDRIVER") or next(
        (p for p in map(shutil.which, DRIVERS) if p), None
    )
    driver = driver or next((p for p in DRIVER_PATHS if Path(p).exists()), None)
    if browser is None or driver is None:
        missing = " and ".join(
            name for name, path in (("chromium", browser), ("chromium-driver", driver)) if not path
        )
        return f"no {missing} on this machine (apt-get install chromium chromium-driver)"
    return browser, driver


def start_chromium(browser: str, driver: str, width: int = 1100, height: int = 900) -> Any:
    """A headless Chromium session (selenium WebDriver)."""
    os.environ["SE_OFFLINE"] = "true"
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for arg in (
        "--headless=new",
        "--no-sandbox",  # CI runs as root
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--no-first-run",
        "--disable-extensions",
        "--disable-background-networking",
        "--force-color-profile=srgb",
        f"--window-size={width},{height}",
    ):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(executable_path=driver), options=options)
