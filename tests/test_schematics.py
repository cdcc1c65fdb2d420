"""Each chapter's opening schematic: a table of lanes, drawn the same way for every chapter."""

import io
import re
import struct
from itertools import combinations

import matplotlib
import matplotlib.pyplot as plt
import pytest
from layout import CHAPTERS, load, source, tags

from gradaccum.book import schematics

matplotlib.use("Agg")


def test_every_chapter_has_a_schematic_that_contrasts_ways_to_run_the_step():
    """Two lanes at least; a lane marked wrong comes with one marked right (chapter 1 contrasts two runs, neither a
    bug: accumulation with BatchNorm trains at batch size b, one pass at K·b)."""
    assert set(schematics.SCHEMATICS) == set(CHAPTERS)
    for stem, spec in schematics.SCHEMATICS.items():
        verdicts = [lane.verdict for lane in spec.lanes]
        assert len(spec.lanes) >= 2 and len({lane.tokens for lane in spec.lanes}) == len(spec.lanes), stem
        assert "right" in verdicts or "wrong" not in verdicts, stem


@pytest.mark.parametrize("stem", sorted(schematics.SCHEMATICS))
def test_lanes_run_their_micro_batches_in_order_and_step_once(stem):
    for lane in schematics.SCHEMATICS[stem].lanes:
        tokens = lane.tokens.split()
        forwards = [int(t[1:]) for t in tokens if re.fullmatch(r"F\d+", t)]
        backwards = [int(t[1:]) for t in tokens if re.fullmatch(r"B\d+", t)]
        assert forwards == backwards == sorted(forwards), lane.title
        for k in forwards:  # each micro-batch's backward follows its forward
            assert tokens.index(f"F{k}") < tokens.index(f"B{k}")
        if forwards:
            assert tokens.count("S") == 1 and tokens.index("S") > tokens.index(f"B{forwards[-1]}"), lane.title
        xs = [x for _, x, _, _ in schematics.layout(lane)]
        assert xs == sorted(xs) and len(xs) == len(tokens)  # time runs left to right


def test_drawn_at_a_fixed_size_with_every_label():
    """Every schematic is WIDTH inches wide and the same figure each time it is drawn (nbval compares the
    ``<Figure size …>`` line of the stored output)."""
    fig = schematics.draw("04_mixed_precision_scaling")
    texts = {t.get_text() for t in fig.axes[0].texts}
    assert {"F1", "B4", "step", "unscale_", "update", "clip"} <= texts
    plt.close(fig)
    for stem in schematics.SCHEMATICS:
        sizes = set()
        for _ in range(2):
            fig = schematics.draw(stem)
            sizes.add(tuple(fig.get_size_inches()))
            plt.close(fig)
        assert len(sizes) == 1 and next(iter(sizes))[0] == schematics.WIDTH, (stem, sizes)


def _shown_px_per_point(fig) -> float:
    """CSS pixels per point of the figure where the site shows it: the notebook stores the PNG that the inline
    backend writes (``bbox_inches="tight"``, the figure's dpi), and the page shrinks it to the content column."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    png_width = struct.unpack(">I", buf.getvalue()[16:20])[0]  # the IHDR chunk's width
    return min(png_width, schematics.COLUMN_PX) / png_width * fig.dpi / 72


@pytest.mark.parametrize("stem", sorted(schematics.SCHEMATICS))
def test_every_label_reads_on_the_page_and_stays_in_its_place(stem):
    """At the desktop column width (schematics.COLUMN_PX, measured in the built page at 1280 px; the browser test
    checks it) every text shows at 11 px or more; a box's label lies inside its box; every other text touches no
    box, no event's tick and no other text; nothing leaves the figure."""
    fig = schematics.draw(stem)
    px = _shown_px_per_point(fig)
    ax = fig.axes[0]
    renderer = fig.canvas.get_renderer()
    texts = [t for t in ax.texts if t.get_text()]
    small = [(t.get_text(), round(t.get_fontsize() * px, 1)) for t in texts if t.get_fontsize() * px < 11]
    assert not small, f"text under 11 px at {schematics.COLUMN_PX} px: {small}"
    boxes = [p.get_window_extent(renderer) for p in ax.patches if p.get_gid() == "box"]
    ticks = [line.get_window_extent(renderer) for line in ax.lines]
    extents = [t.get_window_extent(renderer) for t in texts]
    for text, e in zip(texts, extents, strict=True):
        label = text.get_text()
        assert e.x0 >= fig.bbox.x0 and e.x1 <= fig.bbox.x1 and e.y0 >= fig.bbox.y0 and e.y1 <= fig.bbox.y1, label
        home = [b for b in boxes if b.contains((e.x0 + e.x1) / 2, (e.y0 + e.y1) / 2)]
        if home:
            b = home[0]
            assert b.x0 < e.x0 and e.x1 < b.x1 and b.y0 < e.y0 and e.y1 < b.y1, f"{label!r} overflows its box"
        else:
            assert not [b for b in boxes if b.overlaps(e)], f"{label!r} lies over a box"
        assert not [t for t in ticks if t.overlaps(e)], f"{label!r} lies over an event's tick"
    crowded = [
        (a.get_text(), b.get_text()) for (a, ea), (b, eb) in combinations(zip(texts, extents), 2) if ea.overlaps(eb)
    ]
    assert not crowded, f"texts that overlap: {crowded}"
    plt.close(fig)


def test_a_label_too_long_for_one_line_reads_on_two_balanced_ones():
    assert schematics.wrap("clip", 14) == "clip"
    assert schematics.wrap("rerun updates again", 14) == "rerun updates\nagain"
    assert schematics.wrap("recompute running statistics once", 18) == "recompute running\nstatistics once"
    assert schematics.wrap("no_spaces_in_this_label", 5) == "no_spaces_in_this_label"


def test_bad_specs_are_refused():
    with pytest.raises(ValueError, match="unknown tokens"):
        schematics.Lane("x", "right", "F1 X2")
    with pytest.raises(ValueError):
        schematics.Lane("x", "right", "  ")
    with pytest.raises(ValueError, match="verdict"):
        schematics.Lane("x", "fine", "F1")
    with pytest.raises(ValueError, match="no schematic"):
        schematics.draw("99_nothing")


@pytest.mark.parametrize("stem", sorted(CHAPTERS))
def test_the_chapter_opens_with_its_key_idea_and_its_schematic(stem):
    cells = load(stem)["cells"]
    box = [i for i, c in enumerate(cells[:3]) if c["cell_type"] == "markdown" and "{admonition} Key idea" in source(c)]
    assert box, "a key-idea box in the chapter's first cells"
    words = len(re.findall(r"[\w'’]+", source(cells[box[0]]).split("\n", 2)[-1]))
    assert words <= 80, f"the key idea is {words} words; keep it to 80"
    figure = [i for i, c in enumerate(cells[:6]) if f'schematics.draw("{stem}")' in source(c)]
    assert figure, "the schematic figure right after the key idea"
    cell = cells[figure[0]]
    assert "hide-input" in tags(cell) or "remove-input" in tags(cell)
    meta = cell["metadata"].get("mystnb", {})
    assert meta.get("figure", {}).get("caption") and meta.get("image", {}).get("alt")
    assert any("image/png" in o.get("data", {}) for o in cell.get("outputs", []))
