"""Headless Chromium for the report tests: Debian's ``chromium`` driven by ``playwright``."""

from __future__ import annotations

import os
import shutil

import pytest

CHROMIUM = os.environ.get("MEGASCALE_CHROMIUM", "/usr/bin/chromium")


def browser_or_skip():
    """``playwright.sync_api.sync_playwright``; skips the test without playwright or chromium,
    or fails it when ``MEGASCALE_REQUIRE_TEST_DEPS=1`` (CI)."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
    missing = sync_playwright is None or not shutil.which(CHROMIUM)
    if missing:
        why = "needs playwright and Debian chromium: run scripts/install-test-deps.sh"
        if os.environ.get("MEGASCALE_REQUIRE_TEST_DEPS") == "1":
            pytest.fail(why)
        pytest.skip(why)
    return sync_playwright
