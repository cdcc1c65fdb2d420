"""A real browser on the built site: headless Chromium (Debian's ``chromium`` + ``chromium-driver``) driven by
selenium, on pages served from a loopback HTTP server, with every other host unreachable (the site must work
offline). Used by tests/test_browser.py; ``python tests/browser.py SITE_DIR`` prints the same report by hand."""

from __future__ import annotations

import functools
import http.server
import json
import shutil
import socketserver
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

#: Raw TeX left in the visible text means MathJax did not run (or a formula failed to parse).
RAW_TEX = ("\\(", "\\)", "\\[", "\\]", "$$", "\\begin{", "\\frac", "\\texttt", "\\#", "\\&")

PAGE_PROBE = """
const widgets = [...document.querySelectorAll('.jupyter-widgets, .widget-interact, .ga-explorer')];
const tooWide = [...document.querySelectorAll('main *')].filter(e => {
    const r = e.getBoundingClientRect();
    return r.width > 0 && r.right > document.documentElement.clientWidth + 1 && !e.closest('.highlight, pre, '
        + '.table-wrapper, .pst-scrollable-table-container, .output, .cell_output, mjx-container, .MathJax');
}).map(e => e.tagName + '.' + [...e.classList].join('.') + ': ' + (e.textContent || '').slice(0, 60));
// printed output must wrap inside the column (a cut-off line is unreadable on the static page)
const cutOutput = [...document.querySelectorAll('.cell_output .output pre')]
    .filter(e => e.scrollWidth > e.clientWidth + 1).map(e => (e.textContent || '').slice(0, 60));
return {
    cutOutput: cutOutput.slice(0, 5),
    text: document.body.innerText,
    widgets: widgets.map(w => w.getBoundingClientRect().height),
    widgetErrors: [...document.querySelectorAll('.jupyter-widgets-error, .widget-error')].length,
    mathjax: document.querySelectorAll('mjx-container').length,
    scrollWidth: document.documentElement.scrollWidth,
    clientWidth: document.documentElement.clientWidth,
    tooWide: tooWide.slice(0, 5),
    links: [...document.querySelectorAll('a[href]')].map(a => a.href),
    ids: [...document.querySelectorAll('[id]')].map(e => e.id),
    schematics: [...document.querySelectorAll('figure[id$="-schematic"] img')]
        .map(i => i.getBoundingClientRect().width),
};
"""

#: At desktop widths (≥ 1200 px, where the page's contents panel shares the right-hand column with the margin notes):
#: the margin notes that lie, even in part, under the contents panel, below the sticky header row. Each note is
#: checked with the page at its top, and scrolled to just inside the window's bottom third (where the theme unfolds
#: the panel) and to near its top (where it folds it); three frames after each scroll, for the theme's observer.
NOTES_UNDER_CONTENTS = """
const done = arguments[arguments.length - 1];
const panel = document.querySelector('.bd-sidebar-secondary');
if (!panel || innerWidth < 1200) { done([]); return; }
const frames = n => new Promise(r => { const f = k => k ? requestAnimationFrame(() => f(k - 1)) : r(); f(n); });
const header = () => {
  const h = document.querySelector('.bd-header-article');
  return h ? h.getBoundingClientRect().bottom : 0;
};
const covered = [];
const look = (where) => {
  const s = panel.getBoundingClientRect(), top = Math.max(s.top, header());
  document.querySelectorAll('.margin').forEach((note, i) => {
    const r = note.getBoundingClientRect();
    if (Math.min(r.right, s.right) > Math.max(r.left, s.left) + 1
        && Math.min(r.bottom, s.bottom, innerHeight) > Math.max(r.top, top) + 1)
      covered.push(`note ${i + 1} (${note.innerText.slice(0, 30)}) ${where}`);
  });
};
(async () => {
  window.scrollTo(0, 0); await frames(3); look('at the top of the page');
  for (const note of document.querySelectorAll('.margin')) {
    for (const at of [0.7, 0.12]) {
      window.scrollBy(0, note.getBoundingClientRect().top - at * innerHeight);
      await frames(3); look(`with a note at ${at} of the window's height`);
    }
  }
  window.scrollTo(0, 0);
  done([...new Set(covered)]);
})();
"""


@dataclass
class PageReport:
    path: str
    console_errors: list[str] = field(default_factory=list)
    raw_tex: list[str] = field(default_factory=list)
    widget_heights: list[float] = field(default_factory=list)
    widget_errors: int = 0
    formulas: int = 0
    overflow_px: int = 0
    too_wide: list[str] = field(default_factory=list)
    cut_output: list[str] = field(default_factory=list)  # printed output wider than its box (it must wrap)
    links: list[str] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    explorers: list[dict] = field(default_factory=list)
    schematic_widths: list[float] = field(default_factory=list)  # CSS px, each chapter-opening schematic's image
    notes_under_contents: list[str] = field(default_factory=list)  # margin notes under the contents panel
    settled: bool = False


def chromium_available() -> bool:
    return bool(shutil.which("chromium") or shutil.which("chromium-browser")) and bool(shutil.which("chromedriver"))


@contextmanager
def serve(root: Path) -> Iterator[str]:
    """Serve ``root`` on 127.0.0.1 at a free port; yields the base URL."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    handler = functools.partial(Quiet, directory=str(root))
    with socketserver.TCPServer(("127.0.0.1", 0), handler) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}/"
        finally:
            server.shutdown()


@contextmanager
def browser(width: int, height: int) -> Iterator[object]:
    """Headless Chromium at ``width``×``height`` CSS pixels, console captured, every host but 127.0.0.1 unreachable."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or shutil.which("chromium-browser") or ""
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        f"--window-size={width},{height}",
        "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",
        "--force-device-scale-factor=1",
        "--hide-scrollbars",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))
    driver.set_window_size(width, height)
    try:
        yield driver
    finally:
        driver.quit()


#: True once a page other than the one marked :data:`LEAVING` is loaded and MathJax's first typeset has settled.
#: The hook is set on each page's own ``window``: ``driver.get`` can return before the browser has left the
#: previous page (it did, after pages with explorers, at 320 px), whose flags must not count.
SETTLED = """
if (window.__gaLeaving || document.readyState !== 'complete') return false;
if (!window.__gaHooked) {
  window.__gaHooked = true;
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) {
    const done = () => { window.__gaSettled = true; };
    MathJax.startup.promise.then(done, done);
  } else {
    window.__gaSettled = true;
  }
}
return window.__gaSettled === true;
"""


LEAVING = "window.__gaLeaving = true;"


def wait_settled(driver, timeout: float = 20.0) -> bool:
    """After ``driver.execute_script(LEAVING)`` and ``driver.get(...)``: wait until the new page is loaded and
    MathJax's first typeset has settled; False on a timeout."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if driver.execute_script(SETTLED):
            time.sleep(0.2)  # the explorers' inline scripts have run by load; a moment for MathJax's last layout
            return True
        time.sleep(0.1)
    return False


def inspect_page(driver, url: str, path: str, screenshot: Path | None = None) -> PageReport:
    driver.execute_script(LEAVING)
    driver.get(url)
    settled = wait_settled(driver)
    data = driver.execute_script(PAGE_PROBE)
    report = PageReport(path)
    report.settled = settled
    # Jupyter Book's index.html is a bare redirect with no icon link: Chromium may ask for /favicon.ico before it
    # follows it (a race; seen once). That request is not the page's; every other error counts.
    report.console_errors = [
        entry["message"]
        for entry in driver.get_log("browser")
        if entry["level"] == "SEVERE" and not (path == "index.html" and "/favicon.ico - " in entry["message"])
    ]
    text = data["text"]
    report.raw_tex = [text[max(0, i - 30) : i + 30] for d in RAW_TEX for i in _find_all(text, d)][:10]
    report.widget_heights = data["widgets"]
    report.widget_errors = data["widgetErrors"]
    report.formulas = data["mathjax"]
    report.overflow_px = max(0, data["scrollWidth"] - data["clientWidth"])
    report.too_wide = data["tooWide"]
    report.cut_output = data["cutOutput"]
    report.links = data["links"]
    report.ids = data["ids"]
    report.schematic_widths = data["schematics"]
    report.notes_under_contents = driver.execute_async_script(NOTES_UNDER_CONTENTS)
    report.explorers = move_every_control(driver)
    if screenshot is not None:
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        driver.execute_script("window.scrollTo(0, 0);")
        driver.save_screenshot(str(screenshot))
        # and the page's first kernel-free explorer, as a reader finds it
        if driver.execute_script(
            "const e = document.querySelector('.ga-explorer'); if (!e) return false; "
            "e.scrollIntoView({block: 'start'}); window.scrollBy(0, -70); return true;"
        ):
            driver.save_screenshot(str(screenshot.with_name(screenshot.stem + "-explorer.png")))
    return report


PICTURE = """
const root = arguments[0], img = root.querySelector('img'), msg = root.querySelector('.ga-explorer-message');
return (img.hidden ? '' : img.src) + '|' + (msg.hidden ? '' : msg.textContent);
"""


def move_every_control(driver) -> list[dict]:
    """Move each control of every kernel-free explorer (``.ga-explorer``) one step as a reader would (an arrow
    key on a slider, a choice in a menu), record whether the picture changed, and move it back."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select

    out = []
    for root in driver.find_elements(By.CSS_SELECTOR, ".ga-explorer"):
        first = driver.execute_script(PICTURE, root)
        moves = []
        for el in root.find_elements(By.CSS_SELECTOR, "[data-param]"):
            driver.execute_script("arguments[0].scrollIntoView({block: 'center'});", el)
            if el.tag_name == "select":
                menu = Select(el)
                start = int(menu.first_selected_option.get_attribute("value"))
                menu.select_by_index((start + 1) % len(menu.options))
                moves.append(driver.execute_script(PICTURE, root) != first)
                menu.select_by_index(start)
            else:
                at_end = int(el.get_attribute("value")) == int(el.get_attribute("max"))
                forward, back = (Keys.ARROW_LEFT, Keys.ARROW_RIGHT) if at_end else (Keys.ARROW_RIGHT, Keys.ARROW_LEFT)
                el.send_keys(forward)
                moves.append(driver.execute_script(PICTURE, root) != first)
                el.send_keys(back)
        out.append(
            {
                "height": root.rect["height"],
                "moves": moves,
                "restored": driver.execute_script(PICTURE, root) == first,
                "ready": root.get_attribute("data-ready") == "1",
            }
        )
    return out


def _find_all(text: str, needle: str) -> list[int]:
    out, start = [], 0
    while (i := text.find(needle, start)) >= 0:
        out.append(i)
        start = i + 1
    return out


def pages(site: Path) -> list[str]:
    """Every HTML page of the built site, relative to its root (Sphinx's search and index pages excepted)."""
    skip = {"search.html", "genindex.html"}
    return sorted(
        str(p.relative_to(site))
        for p in site.rglob("*.html")
        if p.name not in skip and "_static" not in p.parts and "_sources" not in p.parts
    )


def main(argv: list[str]) -> int:
    site = Path(argv[0])
    width = int(argv[1]) if len(argv) > 1 else 1280
    with serve(site) as base, browser(width, 900) as driver:
        for path in pages(site):
            r = inspect_page(driver, base + path, path)
            print(
                json.dumps(
                    {
                        "page": path,
                        "console": r.console_errors[:3],
                        "raw_tex": r.raw_tex[:3],
                        "widgets": r.widget_heights,
                        "formulas": r.formulas,
                        "overflow": r.overflow_px,
                        "too_wide": r.too_wide[:3],
                    },
                    ensure_ascii=False,
                )
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
