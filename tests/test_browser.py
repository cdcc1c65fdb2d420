"""The site as a reader sees it: every page of the built site in headless Chromium, offline, at a desktop and a
phone width. Console clean, every formula typeset, every widget drawn, nothing wider than the screen, every internal
link and anchor resolving; the book and its student edition. Screenshots of the first chapter at both widths go to
_build/screenshots/.

Needs Debian's ``chromium`` and ``chromium-driver`` (``.ci/run`` installs them); under ``CI=true`` a missing
browser fails the test instead of skipping it."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urldefrag, urlparse

import pytest
from browser import PageReport, browser, chromium_available, inspect_page, pages, serve
from layout import CHAPTERS, ROOT

from gradaccum.book.schematics import COLUMN_PX

pytestmark = [pytest.mark.site, pytest.mark.browser]

WIDTHS = {"desktop": (1280, 900), "narrow": (320, 640)}
#: The crawls: the book at a desktop width and at the narrowest phone width (320 px; nothing wider than the
#: screen there means nothing wider at 390 px either — a 390-px crawl found nothing the 320-px one missed), the
#: student edition (the same pages and layout, solutions removed) at the desktop width. Each crawl of every page
#: costs about a minute of `make test` on the 2-core machine.
CRAWLS = [("book", "desktop"), ("book", "narrow"), ("student", "desktop")]
SCREENSHOTS = ROOT / "_build" / "screenshots"
SHOT_PAGE = "chapters/01_microbatch_statistics.html"


@pytest.fixture(scope="module", params=CRAWLS, ids=lambda p: f"{p[0]}-{p[1]}")
def reports(request) -> tuple[str, dict[str, PageReport], str]:
    if not chromium_available():
        if os.environ.get("CI") == "true":
            pytest.fail("CI=true but chromium/chromedriver are missing: .ci/run installs them with apt-get")
        pytest.skip("headless Chromium is not installed (apt-get install chromium chromium-driver)")
    edition, name = request.param
    site = request.getfixturevalue("built_site" if edition == "book" else "built_student_site")
    width, height = WIDTHS[name]
    out: dict[str, PageReport] = {}
    with serve(site) as base, browser(width, height) as driver:
        for path in pages(site):
            shot = SCREENSHOTS / f"{edition}-{Path(path).stem}-{name}.png" if path == SHOT_PAGE else None
            out[path] = inspect_page(driver, base + path, path, screenshot=shot)
    return f"{edition}-{name}", out, base


def test_every_page_is_seen(reports):
    _, out, _ = reports
    assert {f"chapters/{stem}.html" for stem in CHAPTERS} <= set(out), "every chapter's page is crawled"
    assert SHOT_PAGE in out and "references.html" in out
    assert not [path for path, r in out.items() if not r.settled], "pages not loaded and typeset within 20 s"


def test_console_is_clean(reports):
    width, out, _ = reports
    errors = {p: r.console_errors for p, r in out.items() if r.console_errors}
    assert not errors, f"{width}: {errors}"


def test_math_is_typeset_offline(reports):
    width, out, _ = reports
    raw = {p: r.raw_tex for p, r in out.items() if r.raw_tex}
    assert not raw, f"{width}: raw TeX left in the text (MathJax did not run or failed): {raw}"
    assert all(out[p].formulas > 20 for p in out if p.startswith("chapters/")), "every chapter has typeset math"


def test_every_widget_is_drawn(reports):
    width, out, _ = reports
    for path, r in out.items():
        if path.startswith("chapters/"):
            assert r.widget_heights and min(r.widget_heights) > 10 and r.widget_errors == 0, (width, path, r)


def test_moving_a_control_changes_the_figure_without_a_kernel(reports):
    width, out, _ = reports
    for path, r in out.items():
        if path.startswith("chapters/"):
            assert r.explorers, f"{width}: {path} has no kernel-free explorer"
            for e in r.explorers:
                assert e["ready"] and e["height"] > 100, (width, path, e)
                assert e["moves"] and all(e["moves"]), f"{width}: {path}: a control that changes nothing: {e}"
                assert e["restored"], (width, path, e)


def test_nothing_is_wider_than_the_screen(reports):
    width, out, _ = reports
    wide = {p: (r.overflow_px, r.too_wide[:3]) for p, r in out.items() if r.overflow_px > 0}
    assert not wide, f"{width}: the page scrolls sideways: {wide}"


def test_margin_notes_never_lie_under_the_contents_panel(reports):
    """At desktop widths the page's contents and the margin notes share the right-hand column; the contents panel
    never covers a note (chapter 4's first note lay under it at 1280×900; _ext/static/book.css)."""
    width, out, _ = reports
    covered = {p: r.notes_under_contents[:3] for p, r in out.items() if r.notes_under_contents}
    assert not covered, f"{width}: margin notes under the contents panel: {covered}"


def test_each_chapter_opens_with_its_schematic_across_the_column(reports):
    """The schematics' font sizes are chosen for the width the page shows them at (schematics.COLUMN_PX at the
    desktop width; tests/test_schematics.py checks 11 px and up there): a narrower column would shrink them."""
    width, out, _ = reports
    for stem in CHAPTERS:
        shown = out[f"chapters/{stem}.html"].schematic_widths
        assert len(shown) == 1, (width, stem, shown)
        if width.endswith("desktop"):
            assert shown[0] >= COLUMN_PX - 1, (width, stem, shown)


def test_printed_output_wraps_inside_the_column(reports):
    """A checker's evidence line or a wide printout wraps; it is not cut off at the edge of its box."""
    width, out, _ = reports
    cut = {p: r.cut_output[:3] for p, r in out.items() if r.cut_output}
    assert not cut, f"{width}: printed output wider than the column: {cut}"


def test_internal_links_and_anchors_resolve(reports):
    _, out, base = reports
    ids = {p: set(r.ids) for p, r in out.items()}
    broken = []
    for path, r in out.items():
        for href in r.links:
            if not href.startswith(base):
                continue
            url, anchor = urldefrag(href)
            target = urlparse(url).path.lstrip("/") or "index.html"
            if target.endswith("/"):
                target += "index.html"
            if target.startswith(("_static/", "_sources/", "_images/", "_downloads/")) or target in (
                "search.html",
                "genindex.html",
            ):
                continue
            if target not in ids:
                broken.append(f"{path} → {href}")
            elif anchor and anchor not in ids[target]:
                broken.append(f"{path} → {target}#{anchor}")
    assert not broken, broken[:20]


def test_screenshots_are_saved(reports):
    width, _, _ = reports
    shot = SCREENSHOTS / f"{width.split('-')[0]}-{Path(SHOT_PAGE).stem}-{width.split('-')[1]}.png"
    assert shot.exists() and shot.stat().st_size > 20_000
    assert shot.with_name(shot.stem + "-explorer.png").stat().st_size > 20_000
