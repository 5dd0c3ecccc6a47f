"""Debian's Chromium under Playwright, as the dashboard's browser tests and ``bench/dashboard_render.py`` drive it
(``executable_path``: no browser download)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from playwright.sync_api import Page

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@contextmanager
def chromium_page(flags: Sequence[str] = CHROMIUM_FLAGS) -> Iterator[Page]:
    """A page of a headless Chromium with a profile of its own (1400 × 1000), closed and its profile removed
    however the block ends."""
    from playwright.sync_api import sync_playwright

    profile = tempfile.mkdtemp(prefix="octacloud-chromium-")
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch_persistent_context(
                profile, executable_path=str(CHROMIUM), headless=True, args=list(flags),
                viewport={"width": 1400, "height": 1000},
            )  # fmt: skip
            try:
                yield browser.new_page()
            finally:
                browser.close()
    finally:
        shutil.rmtree(profile, ignore_errors=True)
