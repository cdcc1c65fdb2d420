"""Each chapter's opening schematic: a table of lanes, drawn the same way for every chapter."""

import re

import matplotlib
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
    fig = schematics.draw("04_mixed_precision_scaling")
    texts = {t.get_text() for t in fig.axes[0].texts}
    assert {"F1", "B4", "step", "unscale_", "update", "clip"} <= texts
    assert tuple(fig.get_size_inches()) == (11.0, 3.0)


def test_bad_specs_are_refused():
    with pytest.raises(ValueError, match="unknown tokens"):
        schematics.Lane("x", "right", "F1 X2")
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
