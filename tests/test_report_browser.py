"""report.html in a real headless browser: it loads, renders, and its key elements exist.

Needs a Chromium binary (Debian/Ubuntu: ``apt-get install -y chromium``); without one the test is
skipped with that reason.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from gradian.report import write_report
from tests.test_report import _logs, full_report

_BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def _browser() -> str:
    for name in _BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("no headless Chromium found (install it with `apt-get install -y chromium`)")


def _run(browser: str, *args: str) -> subprocess.CompletedProcess:
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           "--no-first-run", "--hide-scrollbars", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


KEY_ELEMENTS = ('id="verdict-kind"', 'id="verdict-summary"', 'id="capability"', 'id="cluster-table"',
                'id="plot-capability"', 'id="plot-clusters"', 'id="plot-scores"', 'id="plot-training"',
                'id="findings-table"', 'id="top-harmful"', 'id="provenance"', 'id="config-hash"')


def render_page(html_path) -> str:
    """Screenshot ``html_path`` (beside it, checked non-blank) and return its DOM after loading."""
    browser = _browser()
    url = html_path.as_uri()
    shot = html_path.parent / "screenshot.png"
    done = _run(browser, f"--screenshot={shot}", "--window-size=1280,4000", url)
    assert done.returncode == 0, done.stderr[-2000:]
    assert shot.exists() and shot.stat().st_size > 20_000  # a rendered page, not a blank one
    dom = _run(browser, "--dump-dom", url)
    assert dom.returncode == 0, dom.stderr[-2000:]
    return dom.stdout


def test_report_html_opens_in_headless_chromium(tmp_path):
    report, rankings = full_report(evil="<img src=x onerror=alert(1)>")
    write_report(report, tmp_path, rankings=rankings, logs=_logs())
    page = render_page(tmp_path / "report.html")
    for element in KEY_ELEMENTS:
        assert element in page, element
    # the escaped payload stayed text: no element was injected
    assert "<img src=\"x\"" not in page and "&lt;img src=x onerror=alert(1)&gt;" in page


def test_the_accused_set_and_its_marked_span_render_in_chromium(tmp_path):
    """The accused section, its table of spans and the marked harmful words survive a real browser's
    parse (the escaped span text included), not only string assembly."""
    from tests.test_report import _report_with_accused

    report = _report_with_accused(evil="<b>x</b>")
    write_report(report, tmp_path, logs=_logs())
    page = render_page(tmp_path / "report.html")
    assert 'id="accused"' in page and 'id="accused-spans"' in page
    assert '<mark class="harmful"' in page and "Accused set: the rows to act on" in page
    assert report["attribution"]["accused"]["example_ids"][0] in page
    assert "<b>x</b>" not in page and "&lt;b&gt;x&lt;/b&gt;" in page  # the span text stayed text
