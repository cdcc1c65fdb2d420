"""Build the site from the stored outputs (as `make book` does) into a temporary folder and inspect it."""

import re

import pytest
from layout import CHAPTERS, ROOT, load, source

pytestmark = pytest.mark.site


@pytest.fixture(scope="module")
def site(built_site):
    return built_site


@pytest.mark.parametrize("stem", sorted(CHAPTERS))
def test_chapter_page(site, stem):
    page = (site / "chapters" / f"{stem}.html").read_text()
    nb = load(stem)
    images = sum("image/png" in o.get("data", {}) for c in nb["cells"] for o in c.get("outputs", []))
    assert page.count("<img") >= images > 0
    for img in re.findall(r'<img[^>]*src="([^"]+)"', page):
        if not img.startswith(("data:", "http")):
            assert (site / "chapters" / img).resolve().exists(), img
    # every widget shows its kernel-free form; no widget manager, no stored widget state in the page
    assert page.count('class="ga-explorer"') == sum("explorer(" in source(c) for c in nb["cells"]) >= 1
    assert "application/vnd.jupyter.widget-state+json" not in page and "widget-view+json" not in page
    assert "Traceback" not in page and "output stderr" not in page and "output error" not in page
    assert 'class="math' in page, "math renders"
    assert page.count('class="caption-number">Exercise') == sum(source(c).count("```{exercise}") for c in nb["cells"])
    assert "mybinder.org" in page and "colab.research.google.com" in page
    n_cites = sum(source(c).count("{cite}") for c in nb["cells"])
    assert page.count('href="../references.html#id') >= n_cites > 0, "every citation links to its reference"


def test_no_page_names_a_script_on_another_host(site):
    """Offline readers get every script from the site itself: no page loads or names a remote .js file."""
    remote = {}
    for page in site.rglob("*.html"):
        if "_static" in page.parts:
            continue
        found = re.findall(r"https?://[^\s\"'<>]+?\.js\b", page.read_text())
        if found:
            remote[str(page.relative_to(site))] = sorted(set(found))
    assert not remote, remote


def test_instructor_page(site):
    page = (site / "instructor.html").read_text()
    assert "Suggested assignments" in page and "nbgrader" in page
    assert all(f'href="chapters/{stem}.html' in page for stem in CHAPTERS), "the page links every chapter"


def test_intro_and_references(site):
    intro = (site / "intro.html").read_text()
    assert "equivalence theorem" in intro.lower() and "Symptom" in intro
    refs = (site / "references.html").read_text()
    assert "Ioffe" in refs and "Wu" in refs and "Goyal" in refs


def test_site_requirements_hold_no_torch_and_binder_gets_the_cpu_build():
    """`make book` installs requirements-site.txt only; Binder installs torch's CPU build at the book's version."""
    site = [line for line in (ROOT / "requirements-site.txt").read_text().splitlines() if not line.startswith("#")]
    assert not [line for line in site if "torch" in line] and any(line.startswith("jupyter-book") for line in site)
    full = (ROOT / "requirements.txt").read_text()
    assert "-r requirements-site.txt" in full
    pinned = re.search(r"^torch==(\S+)$", full, flags=re.M).group(1)
    binder = (ROOT / "binder" / "requirements.txt").read_text()
    assert f"torch=={pinned}+cpu" in binder and "--extra-index-url https://download.pytorch.org/whl/cpu" in binder
    for line in binder.splitlines():
        if re.match(r"^[a-z-]+[<>=]", line) and not line.startswith("torch"):
            assert line in full, f"binder/requirements.txt and requirements.txt disagree on {line}"
