"""Local Sphinx extension of the book's site: each script once, and the site's own assets instead of CDNs.

* Scripts are de-duplicated per page (sphinx-thebe's configuration came twice, a SyntaxError in every console),
  and sphinx-thebe's scripts are dropped: the book has no Live Code button, and its configuration names a CDN
  URL (unpkg) that an offline reader must never need.
* The bibliography's labels read like the author–year citations in the text ("Hoffer et al. 2017", not
  "[HHS17]"), and titles keep the capitals they are written with ("Ethernet", not "ethernet").
* A few rules of CSS keep long inline code and URLs inside the column on a phone.
* The notebooks store their widgets' state (so Jupyter shows them before a kernel runs), but the site shows each
  widget's kernel-free HTML form instead (gradaccum.book.widgets.Explorer); the state, which no page script reads,
  is not copied into the pages.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pybtex.plugin import register_plugin
from pybtex.richtext import Text
from pybtex.style.formatting.unsrt import Style as UnsrtStyle
from pybtex.style.labels import BaseLabelStyle
from pybtex.style.template import field, sentence

WIDGET_STATE = "application/vnd.jupyter.widget-state+json"


def _last_names(entry: Any) -> list[str]:
    people = entry.persons.get("author") or entry.persons.get("editor") or []
    names = [" ".join(p.last_names) for p in people]
    return [re.sub(r"[{}]", "", n) for n in names]


def author_year(entry: Any) -> str:
    """"Last", "Last and Other" or "Last et al.", then the year: the words the text cites the entry with."""
    names = _last_names(entry)
    if not names:
        names = [re.sub(r"[{}\\]", "", entry.fields.get("organization", entry.fields.get("title", entry.key)))]
        names = [" ".join(names[0].split()[:3])]
    names = [re.sub(r"\\(.)", r"\1", n) for n in names]  # TeX escapes (\#, \&) read as the character
    who = names[0] if len(names) == 1 else (f"{names[0]} and {names[1]}" if len(names) == 2 else f"{names[0]} et al.")
    return f"{who} {entry.fields.get('year', 'n.d.')}"


class AuthorYearLabels(BaseLabelStyle):
    """Labels such as "Goyal et al. 2017"; a second entry with the same label gets "2017b"."""

    def format_labels(self, sorted_entries: Any) -> Any:
        labels = [author_year(e) for e in sorted_entries]
        counts: dict[str, int] = {}
        for label in labels:
            counts[label] = counts.get(label, 0) + 1
        seen: dict[str, int] = {}
        for label in labels:
            if counts[label] > 1:
                seen[label] = seen.get(label, 0) + 1
                yield label + "abcdefghij"[seen[label] - 1]
            else:
                yield label


class AuthorYearStyle(UnsrtStyle):
    """unsrt with author–year labels, and titles as written (no lower-casing)."""

    default_label_style = AuthorYearLabels

    def format_title(self, e: Any, which_field: str, as_sentence: bool = True) -> Any:
        formatted = field(which_field, apply_func=lambda text: text if isinstance(text, Text) else Text(text))
        return sentence[formatted] if as_sentence else formatted


register_plugin("pybtex.style.formatting", "authoryear", AuthorYearStyle)


def _is_thebe(filename: str, body: str) -> bool:
    """sphinx-thebe's scripts: the book has no Live Code button (thebe would load from a CDN), so a page needs
    neither its loader nor the configuration that names the CDN URL."""
    return filename.endswith("sphinx-thebe.js") or "THEBE_JS_URL" in body


def _dedupe_scripts(app: Any, pagename: str, templatename: str, context: dict, doctree: Any) -> None:
    scripts = context.get("script_files")
    if not scripts:
        return
    seen: set[tuple[str, str]] = set()
    kept = []
    for script in scripts:
        filename = getattr(script, "filename", script) or ""  # an inline script is filename None or ""
        attributes = getattr(script, "attributes", {})
        key = (str(filename), str(attributes.get("body", "")))
        if key in seen or attributes.get("type") == WIDGET_STATE or _is_thebe(str(filename), key[1]):
            continue
        seen.add(key)
        kept.append(script)
    scripts[:] = kept
    # pydata-sphinx-theme logs a console error on a first visit when no default mode is set
    context["default_mode"] = context.get("default_mode") or "auto"


def _add_static(app: Any, config: Any) -> None:
    config.html_static_path.append(str(Path(__file__).parent / "static"))


def setup(app: Any) -> dict[str, Any]:
    app.connect("config-inited", _add_static)
    app.connect("html-page-context", _dedupe_scripts, priority=900)
    app.add_css_file("book.css")
    return {"parallel_read_safe": True, "parallel_write_safe": True}
