"""A real browser for the tests of the dashboard page: Debian's chromium (scripts/system-deps.sh installs
it), driven by Playwright (the `[dev]` extra: its absence fails, tests/support/devdeps.py). Without the
chromium binary the test skips, saying so. What it must not do: download a browser (Playwright's own
builds are not used), or wait without a timeout.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from tests.support.procs import wait_until

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def playwright() -> Any:
    """playwright.sync_api; skips the test where there is no chromium to drive."""
    if not shutil.which(CHROMIUM):
        pytest.skip(f"no chromium at {CHROMIUM} (Debian: apt-get install chromium)")
    return pytest.importorskip(
        "playwright.sync_api", reason="playwright is not installed (pip install -e .[dev])"
    )


@contextmanager
def chromium() -> Iterator[Any]:
    """A headless chromium, closed after the block."""
    with playwright().sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield browser
        finally:
            browser.close()


def wait_for_polls(page: Any, polls: int = 2) -> None:
    """Until the dashboard page is connected and has polled its API `polls` times (30 s at most)."""
    wait_until(
        "the page to poll the API with its token",
        lambda: page.evaluate(f"() => window.sdDashboard.connected && window.sdDashboard.polls >= {polls}"),
        timeout=30,
    )
