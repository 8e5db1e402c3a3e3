"""The dashboard in a real headless browser: Debian's chromium driven by Playwright's Python
package (never `playwright install`). The server runs the embedded model with the default arm
from an empty store, behind an API key; after a few requests the page, given the key in its
form, draws every chart with data, loading nothing from anywhere but the server.

Without a browser (no playwright package, no chromium, or one that cannot start) this test alone
is skipped, with the reason. ADASPARK_CHROMIUM names another chromium binary;
ADASPARK_DASHBOARD_SCREENSHOT=PATH saves a full-page screenshot (docs/dashboard.png is one).
"""

from __future__ import annotations

import os
import shutil
import tempfile

import openai
import pytest
from test_watch import KEY, keyed_server  # noqa: F401 - the shared keyed server fixture

pytestmark = pytest.mark.slow

CHARTS = ("decode-rate", "width-share", "cost-curve", "calibration", "accepted-source")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
PROMPTS = ["Repeat exactly: The quick brown fox jumps over the lazy dog. The quick brown fox "
           "jumps over the lazy dog.", "Name three colours.", "Count from one to ten in words."]


def launch(playwright, profile: str):
    """Chromium with an empty profile, or a skip that says why not."""
    binary = os.environ.get("ADASPARK_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    if not os.path.exists(binary):
        pytest.skip(f"no chromium at {binary} (apt-get install chromium): browser test skipped")
    try:
        return playwright.chromium.launch_persistent_context(
            profile, executable_path=binary, headless=True, args=ARGS,
            viewport={"width": 1300, "height": 1000})
    except Exception as err:  # a browser that cannot start here: this test alone is skipped
        pytest.skip(f"chromium at {binary} cannot be launched: {str(err).splitlines()[0]}")


@pytest.fixture(scope="module")
def browser():
    """Launched before the server loads, so a machine without a browser skips at once."""
    sync_api = pytest.importorskip("playwright.sync_api",
                                   reason="no playwright package: browser test skipped")
    with sync_api.sync_playwright() as playwright, tempfile.TemporaryDirectory() as profile:
        context = launch(playwright, profile)
        try:
            yield context
        finally:
            context.close()


def test_dashboard_draws_every_chart_in_a_real_browser(browser, keyed_server):  # noqa: F811
    base = keyed_server["base"]
    client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=300)
    for prompt in PROMPTS:
        client.chat.completions.create(model="m", max_tokens=24,
                                       messages=[{"role": "user", "content": prompt}])
    page = browser.new_page()
    requested, errors = [], []
    page.on("request", lambda r: requested.append(r.url))
    page.on("pageerror", lambda e: errors.append(str(e)))
    # console errors: a CSP violation shows here; the one expected is the unkeyed fetch's 401
    page.on("console", lambda m: m.type == "error" and "401" not in m.text and
            errors.append(m.text))
    page.goto(base + "/dashboard")
    # keyed: the page asks for the key before it shows anything
    page.wait_for_selector("#key-form:not([hidden])", timeout=20_000)
    assert page.get_attribute("#cost-curve", "data-marks") is None
    page.fill("#key-input", KEY)
    page.click("#key-form button")
    page.wait_for_function(
        "ids => ids.every(id => Number(document.getElementById(id).dataset.marks) > 0)",
        arg=list(CHARTS), timeout=30_000)
    for chart in CHARTS:
        marks = int(page.get_attribute(f"#{chart}", "data-marks"))
        drawn = page.locator(f"#{chart} svg .mark").count()
        assert drawn == marks > 0, chart
    # the learned cost curve: a law line and measured samples for the measured widths
    assert page.locator("#cost-curve svg polyline.law").count() >= 1
    assert page.locator("#cost-curve svg circle.mark").count() >= 3
    assert page.locator("#decode-rate svg circle.mark").count() == len(PROMPTS)
    assert page.locator("#key-form").is_hidden()
    assert "requests" in page.inner_text("#summary")
    shot = os.environ.get("ADASPARK_DASHBOARD_SCREENSHOT")
    if shot:
        page.screenshot(path=shot, full_page=True)
    assert not errors, errors
    outside = [url for url in requested if not url.startswith(base) and
               not url.startswith("data:")]
    assert not outside, outside
