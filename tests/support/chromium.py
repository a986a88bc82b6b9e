"""Headless Chromium, to test what kvtune's HTML reports look like in a real browser's layout.

`require_chromium()` finds the browser (Debian package `chromium`, installed by
scripts/install-test-deps.sh): a missing one skips the test, except when the `CI` environment
variable is set (non-empty): then it fails, so CI can never skip silently.
`layout(html, width)` opens a copy of the page with LAYOUT_PROBE appended, lets Chromium lay it
out at `width` CSS pixels and returns what the probe measured in the real layout (--dump-dom
prints the DOM after the probe has written its JSON into it)."""

from __future__ import annotations

import html as html_lib
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest

BROWSERS = ("chromium", "chromium-browser", "google-chrome")

# Measures, in the laid-out page: every table cell whose content overflows it (scrollWidth >
# clientWidth), every line break inside a word (between two characters with no space or name
# joint _ / . = - before the break), the title, the <pre class="command"> blocks, and whether
# the page scrolls sideways.
LAYOUT_PROBE = r"""
<script>
(() => {
  const out = {overflowed: [], broken: [], cells: 0, title: document.title,
               h1: document.querySelector("h1").textContent,
               commands: [...document.querySelectorAll("pre.command")].map(p => p.textContent),
               page_width: document.documentElement.scrollWidth, viewport_width: window.innerWidth};
  for (const cell of document.querySelectorAll("td, th")) {
    out.cells += 1;
    if (cell.scrollWidth > cell.clientWidth + 1) {
      out.overflowed.push(`${cell.textContent.trim().slice(0, 60)} (${cell.scrollWidth} > ${cell.clientWidth})`);
    }
  }
  const blocks = "td, th, p, li, h1, h2, h3, div, pre";
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT | NodeFilter.SHOW_ELEMENT);
  const range = document.createRange();
  let block = null, top = null, last = "", spaced = true, word = "";
  for (let node; (node = walker.nextNode());) {
    if (node.nodeType === Node.ELEMENT_NODE) {  // a <br> is a line break, as a space is
      if (node.tagName === "BR") { spaced = true; word = ""; }
      continue;
    }
    const el = node.parentElement;
    if (!el || el.closest("svg, script, style, #kvtune-layout")) continue;
    const here = el.closest(blocks);
    if (here !== block) { block = here; top = null; last = ""; spaced = true; word = ""; }
    const text = node.textContent;
    for (let i = 0; i < text.length; i++) {
      const ch = text[i];
      if (/\s/.test(ch)) { spaced = true; word = ""; continue; }
      range.setStart(node, i); range.setEnd(node, i + 1);
      const rects = range.getClientRects();
      if (!rects.length) continue;
      const y = rects[0].top;
      if (top !== null && y > top + 2 && !spaced && !/[_\/.=\-]/.test(last)) {
        out.broken.push(`${word}|${text.slice(i, i + 12)}`);
      }
      top = y; last = ch; spaced = false; word = (word + ch).slice(-24);
    }
  }
  const pre = document.createElement("pre");
  pre.id = "kvtune-layout";
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
})();
</script>
"""


def chromium() -> str | None:
    """The headless browser's executable, or None."""
    return next((found for name in BROWSERS if (found := shutil.which(name))), None)


def require_chromium() -> str:
    """The browser; missing, the test is skipped (failed under CI)."""
    found = chromium()
    if found is not None:
        return found
    message = "headless Chromium is not installed (apt-get install chromium, or run scripts/install-test-deps.sh)"
    if os.environ.get("CI"):
        pytest.fail(message + "; CI must run these tests, not skip them", pytrace=False)
    pytest.skip(message)


def layout(page: Path, width: int, probe: str = LAYOUT_PROBE) -> dict[str, Any]:
    """What `probe` (a script that writes its JSON into <pre id="kvtune-layout">; default
    LAYOUT_PROBE) measures in `page` laid out `width` CSS pixels wide, and under "console" every
    message the page wrote to the browser's console (errors included), which Chromium logs to
    stderr with --enable-logging."""
    browser = require_chromium()
    text = page.read_text()
    with tempfile.TemporaryDirectory() as tmp:
        probed = Path(tmp) / page.name
        probed.write_text(text.replace("</body>", probe + "</body>"))
        done = subprocess.run(
            [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
             f"--user-data-dir={tmp}/profile", f"--window-size={width},900", "--virtual-time-budget=2000",
             "--enable-logging=stderr", "--v=0", "--dump-dom", probed.as_uri()],
            capture_output=True, text=True, timeout=120)
    found = re.search(r'<pre id="kvtune-layout">(.*?)</pre>', done.stdout, re.S)
    assert found, f"Chromium printed no layout (exit {done.returncode}): {done.stderr[-2000:]}"
    measured = json.loads(html_lib.unescape(found.group(1)))
    measured["console"] = [line for line in done.stderr.splitlines() if ":CONSOLE" in line]
    return measured
