"""Each chapter's opening picture: *when* things happen across the K micro-batches of one optimizer step.

A schematic is a table of lanes. Each lane is one way to run the step (a wrong one, the right one), read left to
right as time: a forward (``F``) and a backward (``B``) box per micro-batch, and between them the events the chapter
is about (where BatchNorm takes its statistics, where the clip, ``unscale_``, the scaler's update, the all-reduce
and the optimizer step fall). A new chapter or case is a new row in :data:`SCHEMATICS`, not new drawing code.

Tokens of a lane, separated by spaces:

``F3`` / ``B3``
    forward / backward of micro-batch 3;
``P:one~pass~over~all~K``
    a pass over the whole batch (``~`` is a space);
``!label`` / ``+label`` / ``.label``
    an event: wrong here / right here / neutral (``~`` is a space);
``S``
    the optimizer step;
``[label`` … ``]``
    a span of the lane shaded and labelled below (for example what runs inside ``no_sync()``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.font_manager import FontProperties
from matplotlib.patches import FancyBboxPatch
from matplotlib.textpath import text_to_path

from gradaccum.book.plotting import PALETTE

Verdict = Literal["wrong", "right", ""]

#: The site shows a chapter's opening figure across its content column: 672 CSS px in a 1280-px-wide window
#: (sphinx-book-theme, measured in the built page). The notebook stores the figure with 0.1 inch around what is drawn
#: (``bbox_inches="tight"``), so the page draws about COLUMN_PX / (WIDTH + 0.2) px per inch, and a font of s points
#: at s / 72 of that: 9 pt, the smallest here, at 11.7 px (tests/test_schematics.py checks every text).
COLUMN_PX = 672
WIDTH = 7.0  # inches: every schematic, so that its text shows at one size in every chapter
DPI = 150  # wider than the column in pixels, so the browser shrinks it (sharp on a high-density screen too)
#: Font sizes (points): the figure's title, a lane's title, a box's label, an event's label, the small notes.
SIZE = {"title": 11.0, "lane": 10.0, "box": 9.5, "event": 9.0, "note": 9.0}

#: Widths and heights in inches (the axes' data units are inches; see :func:`draw`).
_WIDTH = {"F": 0.34, "B": 0.46, "S": 0.48, "event": 0.2}
_BOX_H = 0.40
_MARGIN = 0.06  # the figure's edge to the nearest text
_LABEL_GAP = 0.14  # the horizontal space kept between two event labels on one level
_TICK_ROOM = 0.14  # from the top of a box to the lowest event label: the tick and its triangle
_MAX_STRETCH = 1.7  # a short lane's boxes widen to fill the figure, up to this factor
_EVENT_COLOR = {"!": PALETTE["vermillion"], "+": PALETTE["green"], ".": PALETTE["blue"]}
_TOKEN = re.compile(r"^(?:[FB]\d+|P:\S+|[!+.]\S+|S|\[\S+|\])$")


@dataclass(frozen=True)
class Lane:
    """One way to run the step: a title, whether it is wrong or right, and its tokens (see the module)."""

    title: str
    verdict: Verdict
    tokens: str

    def __post_init__(self) -> None:
        if not self.tokens.split():
            raise ValueError(f"lane {self.title!r} has no tokens; give it at least one, for example 'F1 B1 S'.")
        bad = [t for t in self.tokens.split() if not _TOKEN.match(t)]
        if bad:
            raise ValueError(
                f"lane {self.title!r}: unknown tokens {bad}; use F<k>, B<k>, P:<label>, !<label>, "
                f"+<label>, .<label> or S."
            )
        if self.verdict not in ("wrong", "right", ""):
            raise ValueError(f"verdict must be 'wrong', 'right' or '', got {self.verdict!r}.")


@dataclass(frozen=True)
class Schematic:
    """A chapter's picture: its title, K, and its lanes (top to bottom)."""

    title: str
    lanes: tuple[Lane, ...]


def _window(k: int, between: str = "", last: str = "", after_forward: str = "") -> str:
    """The tokens of K micro-batches: ``F k [after_forward] B k [between]`` for each, ``last`` after the K-th."""
    parts = []
    for i in range(1, k + 1):
        parts += [f"F{i}", after_forward, f"B{i}", between if i < k else last]
    return " ".join(p for p in parts if p)


#: Every chapter's schematic, K = 4 micro-batches.
SCHEMATICS: dict[str, Schematic] = {
    "01_microbatch_statistics": Schematic(
        "BatchNorm's statistics: from each micro-batch, or from the whole batch",
        (
            Lane(
                "accumulate K micro-batches: trains at batch size b",
                "",
                _window(4, after_forward=".stats~of~b,~running~update", last="S"),
            ),
            Lane(
                "one pass: trains at batch size K·b",
                "",
                "P:forward~of~K·b .stats~of~K·b,~one~running~update P:backward S",
            ),
        ),
    ),
    "02_ghost_batchnorm": Schematic(
        "Full-batch statistics inside an accumulated step",
        (
            Lane(
                "plain accumulation (= Ghost BN over each micro-batch)",
                "",
                _window(4, after_forward=".stats~of~b,~running~update", last="S"),
            ),
            Lane(
                "full-batch statistics as constants",
                "wrong",
                "P:~statistics~pass~ " + _window(4, after_forward="!backward~skips~the~stats", last="S"),
            ),
            Lane(
                "exact scheme: L + 1 sweeps over all K micro-batches",
                "right",
                "P:~~statistics~pass,~layer~by~layer~~ P:~~~L~correction~sweeps~(F+B)~~~ "
                + _window(4, after_forward="+backward~adds~correction", last="S"),
            ),
        ),
    ),
    "03_clip_ordering": Schematic(
        "Where the clip goes",
        (
            Lane("clip inside the loop", "wrong", _window(4, between="!clip", last="!clip S")),
            Lane("clip once", "right", _window(4, last="+clip S")),
        ),
    ),
    "04_mixed_precision_scaling": Schematic(
        "One loss scale S per window: each backward adds (S/K)·g to .grad; unscale_, clip, step and update once",
        (
            Lane(
                "unscale_ and update per micro-batch: .grad ÷ S again each time",
                "wrong",
                _window(4, between="!unscale_,~update", last="!unscale_,~update S"),
            ),
            Lane(
                "the recipe: .grad sums (S/K)·g; one ÷ S; an inf skips the step",
                "right",
                _window(4, last="+unscale_ .clip S +update .zero_grad"),
            ),
        ),
    ),
    "05_no_sync": Schematic(
        "Communicate once per optimizer step",
        (
            Lane(
                "without no_sync(): K all-reduces (right, slow)",
                "",
                _window(4, between=".all-reduce", last=".all-reduce S"),
            ),
            Lane(
                "K-th forward inside no_sync()", "wrong", "[inside~no_sync() F1 B1 F2 B2 F3 B3 F4 ] B4 !no~all-reduce S"
            ),
            Lane("no_sync() for the first K − 1", "right", "[inside~no_sync() F1 B1 F2 B2 F3 B3 ] F4 B4 +all-reduce S"),
        ),
    ),
    "06_loss_normalization_and_friends": Schematic(
        "One window must compute what one full batch would",
        (
            Lane(
                "mean per micro-batch, scheduler per micro-batch",
                "wrong",
                _window(4, after_forward="!÷~own~tokens~and~K", between="!sched.step", last="S !sched.step"),
            ),
            Lane(
                "seed re-set before each micro-batch: micro-batch k draws the same masks in every window",
                "wrong",
                " ".join(f"!re-seed F{i} B{i}" for i in range(1, 5)) + " S",
            ),
            Lane(
                "count N, the window's tokens on all ranks; sum ÷ N; fresh masks; one step of each",
                "right",
                "+count~N " + _window(4, after_forward="+÷~N", between=".no~step", last="S +sched.step"),
            ),
        ),
    ),
    "07_frameworks": Schematic(
        "Every framework gets the core right; check what is around it",
        (
            Lane(
                "the core, every framework: loss ÷ K, one sync over p processes, one step",
                "right",
                _window(4, after_forward=".÷K", last="+sync~over~p S +sched.step"),
            ),
            Lane(
                "Accelerate on p processes: p scheduler steps per step",
                "wrong",
                _window(4, after_forward=".÷K", last="+sync~over~p S !sched.step~×~p"),
            ),
            Lane(
                "last window of k′ = 2 < K (Accelerate, Lightning): weight k′/K",
                "wrong",
                _window(2, after_forward="!÷K", last="+sync S"),
            ),
            Lane(
                "last window ÷ k′ (Trainer, timm-style): weight 1",
                "right",
                _window(2, after_forward="+÷k′", last="+sync S"),
            ),
            Lane(
                "Trainer, forward(**kwargs) returning a mean: K× the gradient",
                "wrong",
                _window(4, after_forward="!no~÷K", last="+sync S"),
            ),
        ),
    ),
    "08_beyond_batchnorm": Schematic(
        "Couplings over the window (all K·b samples); BatchNorm frozen in the rerun",
        (
            Lane("in-batch negatives, per micro-batch", "wrong", _window(4, after_forward="!b−1~negatives", last="S")),
            Lane(
                "GradCache",
                "right",
                "P:embed~all~K·b~(no~grad) +loss~over~K·b,~its~G " + _window(4, after_forward=".gets~G_k", last="S"),
            ),
            Lane("load balancing, per micro-batch", "wrong", _window(4, after_forward="!counts~of~b", last="S")),
            Lane(
                "load balancing, window's counts",
                "right",
                "P:route~all~K·b~(no~grad) +count~the~window " + _window(4, after_forward=".window's~f", last="S"),
            ),
            Lane(
                "checkpointed BatchNorm, plain",
                "wrong",
                " ".join(f"F{k} .update !its~rerun~updates~again B{k}" for k in range(1, 5)) + " S",
            ),
            Lane(
                "checkpointed BatchNorm, frozen in the rerun",
                "right",
                " ".join(f"F{k} .update +its~rerun~frozen B{k}" for k in range(1, 5)) + " S",
            ),
        ),
    ),
}


def text_size(text: str, size: float, weight: str = "normal") -> tuple[float, float]:
    """The width and height in inches of ``text`` (lines split at ``\\n``) in the default font at ``size`` points.

    Measured on the glyphs' outlines, so it does not depend on a renderer; the height is ``lines × 1.2 × size``, the
    line spacing matplotlib uses.
    """
    font = FontProperties(size=size, weight=weight)
    lines = text.split("\n")
    width = max(text_to_path.get_text_width_height_descent(line, font, ismath=False)[0] for line in lines)
    return width / 72, len(lines) * 1.2 * size / 72


def wrap(text: str, width: int) -> str:
    """``text`` on one line if it has at most ``width`` characters, else on two, split at the space that makes the
    longer line shortest (a label reads best in two balanced lines)."""
    spaces = [i for i, c in enumerate(text) if c == " "]
    if len(text) <= width or not spaces:
        return text
    cut = min(spaces, key=lambda i: (max(i, len(text) - i - 1), -i))  # on a tie, the longer line first
    return text[:cut] + "\n" + text[cut + 1 :]


def _token(token: str) -> tuple[str, str, float]:
    """One token's (kind, label, width in inches)."""
    if token[0] in "FB" and token[1:].isdigit():
        return token[0], token, _WIDTH[token[0]]
    if token.startswith("P:"):
        label = wrap(token[2:].replace("~", " "), 18)
        return "P", label, max(0.9, text_size(label, SIZE["box"])[0] + 0.22)
    if token == "S":
        return "S", "step", _WIDTH["S"]
    if token.startswith("["):
        return "[", token[1:].replace("~", " "), 0.0
    if token == "]":
        return "]", "", 0.0
    return token[0], wrap(token[1:].replace("~", " "), 14), _WIDTH["event"]


def layout(lane: Lane) -> list[tuple[str, float, float, str]]:
    """Where each token of a lane goes, before the figure stretches it: (kind, x, width, label), x and width in
    inches, kind one of F, B, P, S, [, ], !, +, . (a label may be wrapped onto two lines)."""
    x, placed = 0.0, []
    for token in lane.tokens.split():
        kind, label, width = _token(token)
        placed.append((kind, x, width, label))
        x += width
    return placed


def _overhang(placed: list[tuple[str, float, float, str]], index: int) -> float:
    """How far the label of the event at ``placed[index]`` (the first or last token) reaches past the lane's end."""
    kind, _, width, label = placed[index]
    return max(0.0, text_size(label, SIZE["event"])[0] / 2 - width / 2) if kind in _EVENT_COLOR else 0.0


def _stretch(lanes: list[list[tuple[str, float, float, str]]]) -> tuple[float, float]:
    """The left edge of time 0 and the factor every lane's widths are multiplied by: the longest lane, with the
    labels that stick out at its ends, fills the figure's width (a factor up to ``_MAX_STRETCH``)."""
    left = _MARGIN + max(_overhang(p, 0) for p in lanes if p)
    factor = _MAX_STRETCH
    for placed in lanes:
        length = placed[-1][1] + placed[-1][2]
        factor = min(factor, (WIDTH - _MARGIN - _overhang(placed, -1) - left) / length)
    return left, factor


def draw(chapter: str) -> Figure:
    """The chapter's schematic as a figure ``WIDTH`` inches wide: the title, then one row per lane (its title above
    its boxes), time to the right. The axes fill the figure and their data units are inches, so every size below is
    the size on the page."""
    if chapter not in SCHEMATICS:
        raise ValueError(f"no schematic for {chapter!r}; choose one of {sorted(SCHEMATICS)}.")
    spec = SCHEMATICS[chapter]
    fig = plt.figure(figsize=(WIDTH, 3.0), dpi=DPI)
    ax = fig.add_axes((0.0, 0.0, 1.0, 1.0))
    lanes = [layout(lane) for lane in spec.lanes]
    left, factor = _stretch(lanes)
    title = _fit(spec.title, SIZE["title"], "bold")
    ax.text(_MARGIN, -_MARGIN, title, ha="left", va="top", fontsize=SIZE["title"], fontweight="bold")
    y = -_MARGIN - text_size(title, SIZE["title"], "bold")[1] - 0.1
    right = 0.0
    for lane, placed in zip(spec.lanes, lanes, strict=True):
        y = _draw_lane(ax, lane, [(k, left + x * factor, w * factor, s) for k, x, w, s in placed], y)
        right = max(right, left + (placed[-1][1] + placed[-1][2]) * factor)
    ax.annotate("", xy=(right, y), xytext=(left, y), arrowprops=dict(arrowstyle="->", color="grey"))
    ax.text(right, y - 0.05, "time, one optimizer step", ha="right", va="top", fontsize=SIZE["note"], color="#555555")
    height = math.ceil((-y + 0.05 + text_size("t", SIZE["note"])[1] + _MARGIN) * 10) / 10  # a size nbval can compare
    fig.set_size_inches(WIDTH, height)
    ax.set_xlim(0.0, WIDTH)
    ax.set_ylim(-height, 0.0)
    ax.set_axis_off()
    return fig


def _fit(text: str, size: float, weight: str = "normal") -> str:
    """``text`` on one line if it fits the figure's width, else on two."""
    return text if text_size(text, size, weight)[0] <= WIDTH - 2 * _MARGIN else wrap(text, len(text) // 2)


#: The fill of each kind of box: forward, backward, padding; the optimizer step is black with white text.
_BOX_COLOR = {"F": "#DDEEFF", "B": "#A9CCE3", "P": "#EEEEEE"}


def _draw_lane(ax: Axes, lane: Lane, placed: list[tuple[str, float, float, str]], top: float) -> float:
    """One lane below ``top``: its title, its event labels (on as many levels as keep them apart), its boxes, its
    shaded spans; returns the top of the next lane. ``placed`` is in inches on the page."""
    mark = {"wrong": "✗ ", "right": "✓ ", "": ""}[lane.verdict]
    color = {"wrong": PALETTE["vermillion"], "right": PALETTE["green"], "": "black"}[lane.verdict]
    title = _fit(mark + lane.title, SIZE["lane"])
    ax.text(_MARGIN, top, title, ha="left", va="top", fontsize=SIZE["lane"], color=color)
    events = [(x + w / 2, label, kind) for kind, x, w, label in placed if kind in _EVENT_COLOR]
    labels = _event_labels(events)
    rows = max((row for _, _, row in labels), default=-1) + 1
    row_h = [max((text_size(s, SIZE["event"])[1] for _, s, r in labels if r == row), default=0) for row in range(rows)]
    box_top = top - text_size(title, SIZE["lane"])[1] - 0.06 - sum(row_h) - 0.04 * rows - (_TICK_ROOM if rows else 0.0)
    y = box_top - _BOX_H / 2
    for (cx, label, row), (x, _, kind) in zip(labels, events, strict=True):
        _event(ax, x, y, kind)
        bottom = box_top + _TICK_ROOM + sum(row_h[:row]) + 0.04 * row
        ax.text(cx, bottom, label, ha="center", va="bottom", fontsize=SIZE["event"], color=_EVENT_COLOR[kind])
    shaded = _draw_boxes(ax, placed, y)
    return y - _BOX_H / 2 - (0.3 if shaded else 0.14)


def _event_labels(events: list[tuple[float, str, str]]) -> list[tuple[float, str, int]]:
    """Each event label's centre (kept inside the figure), text and level. The occurrences of one label share a
    level (a repeated event reads as one row): the lowest on which none of them overlaps a label already placed."""
    spans = []
    for x, label, _ in events:
        half = text_size(label, SIZE["event"])[0] / 2
        cx = min(max(x, _MARGIN + half), WIDTH - _MARGIN - half)
        spans.append((cx, (cx - half - _LABEL_GAP / 2, cx + half + _LABEL_GAP / 2)))
    levels: list[list[tuple[float, float]]] = []
    row_of: dict[int, int] = {}
    for label in dict.fromkeys(label for _, label, _ in events):
        mine = [i for i, (_, other, _) in enumerate(events) if other == label]
        own = [spans[i][1] for i in mine]
        # Occurrences too close to share a level (a wide label over short boxes) are placed one by one.
        groups = [mine] if not _self_collide(own) else [[i] for i in mine]
        for group in groups:
            span = [spans[i][1] for i in group]
            row = next((r for r, lv in enumerate(levels) if not _collide(span, lv)), len(levels))
            if row == len(levels):
                levels.append([])
            levels[row] += span
            row_of.update(dict.fromkeys(group, row))
    return [(cx, label, row_of[i]) for i, ((cx, _), (_, label, _)) in enumerate(zip(spans, events, strict=True))]


def _self_collide(spans: list[tuple[float, float]]) -> bool:
    """Whether any two of ``spans`` overlap."""
    return any(_collide([a], spans[i + 1 :]) for i, a in enumerate(spans))


def _collide(spans: list[tuple[float, float]], placed: list[tuple[float, float]]) -> bool:
    """Whether any of ``spans`` overlaps any of ``placed`` (intervals)."""
    return any(a < d and c < b for a, b in spans for c, d in placed)


def _draw_boxes(ax: Axes, placed: list[tuple[str, float, float, str]], y: float) -> bool:
    """The lane's boxes and shaded spans at height ``y``; whether it has a shaded span (named below the lane)."""
    opened: tuple[float, str] | None = None
    shaded = False
    for kind, x, w, label in placed:
        if kind == "[":
            opened = (x, label)
        elif kind == "]" and opened is not None:
            _shade(ax, opened[0], x, y, opened[1])
            opened, shaded = None, True
        elif kind in _BOX_COLOR:
            _box(ax, x, y, w, label, _BOX_COLOR[kind])
        elif kind == "S":
            _box(ax, x, y, w, label, PALETTE["black"], "white")
    return shaded


def _box(ax: Axes, x: float, y: float, w: float, label: str, color: str, text_color: str = "black") -> None:
    """A box from ``x`` to ``x + w`` centred on ``y``, its label inside (its artist's gid is ``box``)."""
    patch = FancyBboxPatch(
        (x + 0.02, y - _BOX_H / 2),
        w - 0.04,
        _BOX_H,
        boxstyle="round,pad=0,rounding_size=0.05",
        facecolor=color,
        edgecolor="black",
        linewidth=0.6,
    )
    patch.set_gid("box")
    ax.add_patch(patch)
    ax.text(x + w / 2, y, label, ha="center", va="center", fontsize=SIZE["box"], color=text_color)


def _shade(ax: Axes, start: float, x: float, y: float, name: str) -> None:
    """The shaded span of an accumulation window, from ``start`` to ``x``, named below."""
    ax.add_patch(
        FancyBboxPatch(
            (start, y - _BOX_H / 2 - 0.05),
            x - start,
            _BOX_H + 0.1,
            boxstyle="round,pad=0,rounding_size=0.06",
            facecolor=PALETTE["yellow"],
            alpha=0.35,
            edgecolor="none",
            zorder=0,
        )
    )
    ax.text((start + x) / 2, y - _BOX_H / 2 - 0.08, name, ha="center", va="top", fontsize=SIZE["note"], color="#555555")


def _event(ax: Axes, x: float, y: float, kind: str) -> None:
    """An event's tick through the lane at ``x``, a triangle on top; its label is placed by :func:`_draw_lane`."""
    ev = _EVENT_COLOR[kind]
    ax.plot([x, x], [y - _BOX_H / 2, y + _BOX_H / 2 + 0.06], color=ev, linewidth=2.2)
    ax.plot(x, y + _BOX_H / 2 + 0.06, marker="v", color=ev, markersize=6)
