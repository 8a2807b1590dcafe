"""The HTML report in a real browser: Debian's Chromium, headless, offline.

A small harness page (the test's own, not the report) loads the report in an iframe and writes what the
browser made of it into its DOM: every image decoded with a natural size, the trial table's rows, no
script run. `--dump-dom` prints that DOM; `--screenshot` shows the page is drawn, curves included.
Skipped where Chromium is not installed, except in CI: .ci/run installs it (Debian package `chromium`)
and sets BATCHTUNE_CI, under which a missing browser fails these tests.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from test_report_html import EVIL, tuned, typed

from batchtune.report import curves_png
from batchtune.report_html import html_report

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# CI (.ci/run sets BATCHTUNE_CI) installs Chromium, so there a missing browser fails these tests, never skips them.
IN_CI = bool(os.environ.get("BATCHTUNE_CI"))
pytestmark = pytest.mark.skipif(CHROMIUM is None and not IN_CI, reason="Chromium is not installed (Debian: apt-get "
                                                                         "install chromium); .ci/run installs it")

HARNESS = """<!DOCTYPE html><html><head><meta charset="utf-8"></head><body>
<pre id="result">pending</pre>
<iframe id="plain" src="plain.html" width="1250" height="2400"></iframe>
<iframe id="hostile" src="hostile.html" width="1250" height="2400"></iframe>
<iframe id="injected" src="injected.html" width="1250" height="2400"></iframe>
<script>
const EVIL = %s;
const found = {};
function inspect(frame) {
  const doc = frame.contentDocument;
  const trials = [...doc.querySelectorAll("h2")].find(h => h.textContent === "Trials");
  let table = null;
  for (let el = trials; el && !table; el = el.nextElementSibling)
    table = el.tagName === "TABLE" ? el : el.querySelector("table");
  return {
    images: [...doc.images].map(i => ({complete: i.complete, width: i.naturalWidth, height: i.naturalHeight,
                                       shown: i.getBoundingClientRect().width})),
    trialRows: table ? table.tBodies[0].rows.length : -1,
    trialCells: table ? table.rows[0].cells.length : -1,
    scripts: doc.scripts.length,
    iframes: doc.querySelectorAll("iframe").length,
    pwned: frame.contentWindow.pwned === undefined ? null : frame.contentWindow.pwned,
    title: doc.title,
    evilShownAsText: doc.body.innerText.includes(EVIL.slice(0, 40)),
  };
}
// A frame's load event waits for its images: each is then decoded (naturalWidth > 0) or broken (0).
for (const frame of document.querySelectorAll("iframe")) {
  frame.addEventListener("load", () => {
    found[frame.id] = inspect(frame);
    if (Object.keys(found).length === 3) document.getElementById("result").textContent = JSON.stringify(found);
  });
}
</script></body></html>"""


def chromium(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None, "Chromium is not installed, and BATCHTUNE_CI is set: .ci/run should have installed it"
    return subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
         "--disable-background-networking", "--hide-scrollbars", f"--user-data-dir={cwd / 'profile'}", *args],
        cwd=cwd, capture_output=True, text=True, timeout=120, check=False)


def _png(bt: dict) -> bytes:
    return curves_png(typed(bt), title="inference/tune: target llm")


def hostile() -> dict:
    bt = tuned()
    for trial in bt["status"]["trials"]:
        trial.update(name=EVIL, verdictReason=EVIL, message=EVIL)
    bt["status"]["recommendation"]["reason"] = EVIL
    bt["status"]["recommendation"]["args"] = [EVIL]
    bt["metadata"]["name"] = EVIL
    return bt


@pytest.fixture(scope="module")
def browser(tmp_path_factory) -> dict:
    """What one Chromium run made of three reports: a plain one, one full of hostile text, and one with
    markup injected after rendering (as if escaping had failed)."""
    folder = tmp_path_factory.mktemp("browser")
    plain = tuned()
    (folder / "plain.html").write_text(html_report(typed(plain), _png(plain), "test"))
    bad = hostile()
    (folder / "hostile.html").write_text(html_report(typed(bad), _png(bad)))
    (folder / "injected.html").write_text(html_report(typed(plain), _png(plain)).replace(
        "</body>", '<script>window.pwned = 1</script><img src="https://example.invalid/x.png">'
                   '<img src="x" onerror="window.pwned = 2"></body>'))
    (folder / "harness.html").write_text(HARNESS % json.dumps(EVIL).replace("</", "<\\/"))  # inside <script>
    done = chromium("--allow-file-access-from-files", "--virtual-time-budget=20000", "--dump-dom",
                    (folder / "harness.html").as_uri(), cwd=folder)
    result = re.search(r'<pre id="result">(.*?)</pre>', done.stdout, re.S)
    assert result, f"no result in the dumped DOM (rc {done.returncode}): {done.stdout[-500:]} {done.stderr[-1500:]}"
    text = html.unescape(result.group(1))
    assert text != "pending", "the harness never saw the three reports load"
    return {"folder": folder, "trials": len(plain["status"]["trials"]), **json.loads(text)}


def test_the_report_renders_its_curves_and_trial_table_in_chromium(browser):
    found = browser["plain"]
    assert len(found["images"]) == 1
    image = found["images"][0]
    assert image["complete"] and image["width"] == 960 and image["height"] > 600 and image["shown"] > 0
    assert found["trialRows"] == browser["trials"] and found["trialCells"] >= 10
    assert found["scripts"] == 0 and found["pwned"] is None
    assert found["title"] == "batchtune report: inference/tune"


def test_hostile_text_stays_text_in_the_browser(browser):
    found = browser["hostile"]
    assert found["scripts"] == 0 and found["iframes"] == 0 and found["pwned"] is None
    assert len(found["images"]) == 1 and found["images"][0]["width"] == 960
    assert found["evilShownAsText"] and found["trialRows"] == browser["trials"]


def test_the_pages_policy_blocks_script_and_fetches_even_if_markup_got_in(browser):
    # Defence in depth: were escaping ever to fail, the page's Content-Security-Policy still runs no
    # script and loads nothing from outside.
    found = browser["injected"]
    assert found["scripts"] == 1 and found["pwned"] is None
    assert [i["width"] for i in found["images"]] == [960, 0, 0]


def test_a_screenshot_shows_the_page_drawn(browser):
    from matplotlib import image as mpimg

    folder = browser["folder"]
    shot = folder / "shot.png"
    done = chromium("--window-size=1250,1800", f"--screenshot={shot}", (folder / "plain.html").as_uri(),
                    cwd=folder)
    assert shot.exists(), done.stderr[-1500:]
    pixels = mpimg.imread(shot)[:, :, :3]
    colours = {tuple(p) for p in (pixels[::7, ::7].reshape(-1, 3) * 255).astype(int)}
    ink = float((pixels.sum(axis=2) < 2.9).mean())
    assert len(colours) > 100 and 0.03 < ink < 0.9, (len(colours), ink)
