"""A real headless Chromium for page tests: Debian's chromium driven by Playwright's Python
package (scripts/install.sh installs both; nothing is downloaded at test time)."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from typing import Any

__all__ = ["CHROMIUM_ARGS", "chromium_page"]

CHROMIUM_ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
"""The machine's network is closed: background-networking flags keep Chromium from trying."""


@contextlib.contextmanager
def chromium_page(*, width: int = 1280, height: int = 900) -> Iterator[Any]:
    """A fresh Playwright page in Debian's Chromium; closed on exit."""
    from playwright.sync_api import sync_playwright

    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        raise RuntimeError("chromium is not installed; run scripts/install.sh (Debian's chromium)")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            yield page
        finally:
            browser.close()
