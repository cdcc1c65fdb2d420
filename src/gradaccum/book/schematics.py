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

import re
import textwrap
from dataclasses import dataclass
from typing import Literal

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import FancyBboxPatch

from gradaccum.book.plotting import PALETTE

Verdict = Literal["wrong", "right", ""]

_TITLE_SPACE = 7.0  # x units left of time 0 for the lanes' titles
_WIDTH = {"F": 1.0, "B": 1.4, "S": 1.0, "event": 0.5}
_EVENT_COLOR = {"!": PALETTE["vermillion"], "+": PALETTE["green"], ".": PALETTE["blue"]}
_TOKEN = re.compile(r"^(?:[FB]\d+|P:\S+|[!+.]\S+|S|\[\S+|\])$")


@dataclass(frozen=True)
class Lane:
    """One way to run the step: a title, whether it is wrong or right, and its tokens (see the module)."""

    title: str
    verdict: Verdict
    tokens: str

    def __post_init__(self) -> None:
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
                "seed re-set before each micro-batch: the same masks every step",
                "wrong",
                " ".join(f"!re-seed F{i} B{i}" for i in range(1, 5)) + " S",
            ),
            Lane(
                "sum ÷ tokens in the window, fresh masks",
                "right",
                _window(4, after_forward="+÷~N~(window)", last="S +sched.step"),
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
        "Couplings over the window; state updated once per micro-batch",
        (
            Lane("in-batch negatives, plain", "wrong", _window(4, after_forward="!negatives~of~b", last="S")),
            Lane("GradCache", "right", "P:embed~all~K·b~(no~grad) +loss~over~K·b " + _window(4, last="S")),
            Lane(
                "checkpointed BatchNorm, plain",
                "wrong",
                _window(4, after_forward=".update", between="!rerun~updates~again", last="!rerun~updates~again S"),
            ),
            Lane(
                "checkpointed BatchNorm, frozen on rerun",
                "right",
                _window(4, after_forward=".update", between="+rerun~frozen", last="+rerun~frozen S"),
            ),
        ),
    ),
}


def _box(ax, x: float, y: float, w: float, label: str, color: str, text_color: str = "black") -> None:
    ax.add_patch(
        FancyBboxPatch(
            (x + 0.04, y - 0.28),
            w - 0.08,
            0.56,
            boxstyle="round,pad=0,rounding_size=0.08",
            facecolor=color,
            edgecolor="black",
            linewidth=0.6,
        )
    )
    ax.text(x + w / 2, y, label, ha="center", va="center", fontsize=9, color=text_color)


def layout(lane: Lane) -> list[tuple[str, float, float, str]]:
    """Where each token of a lane goes: (kind, x, width, label), kind one of F, B, P, S, !, +, ."""
    x, placed = 0.0, []
    for token in lane.tokens.split():
        if token[0] in "FB" and token[1:].isdigit():
            kind, label, width = token[0], token, _WIDTH[token[0]]
        elif token.startswith("P:"):
            label = token[2:].replace("~", " ")
            kind, width = "P", max(2.5, 0.17 * len(label))
        elif token == "S":
            kind, label, width = "S", "step", _WIDTH["S"]
        elif token.startswith("["):
            kind, label, width = "[", token[1:].replace("~", " "), 0.0
        elif token == "]":
            kind, label, width = "]", "", 0.0
        else:
            kind, label, width = token[0], token[1:].replace("~", " "), _WIDTH["event"]
        placed.append((kind, x, width, label))
        x += width
    return placed


def draw(chapter: str) -> Figure:
    """The chapter's schematic as a figure (fixed size): one row per lane, time to the right."""
    if chapter not in SCHEMATICS:
        raise ValueError(f"no schematic for {chapter!r}; choose one of {sorted(SCHEMATICS)}.")
    spec = SCHEMATICS[chapter]
    rows = len(spec.lanes)
    fig, ax = plt.subplots(figsize=(11.0, 0.5 + 1.25 * rows), layout="constrained")
    longest = 0.0
    for r, lane in enumerate(spec.lanes):
        longest = _draw_lane(ax, lane, -1.25 * r, longest)
    ax.annotate(
        "",
        xy=(longest, -1.25 * rows + 0.55),
        xytext=(0, -1.25 * rows + 0.55),
        arrowprops=dict(arrowstyle="->", color="grey"),
    )
    ax.text(longest, -1.25 * rows + 0.45, "time, one optimizer step", ha="right", va="top", fontsize=8, color="grey")
    ax.set_xlim(-_TITLE_SPACE, longest + 0.2)
    ax.set_ylim(-1.25 * rows + 0.3, 1.0)
    ax.set_axis_off()
    ax.set_title(spec.title, fontsize=10, loc="left")
    return fig


#: The fill of each kind of box: forward, backward, padding; the optimizer step is black with white text.
_BOX_COLOR = {"F": "#DDEEFF", "B": "#A9CCE3", "P": "#EEEEEE"}


def _draw_lane(ax: Axes, lane: Lane, y: float, longest: float) -> float:
    """One lane at height ``y``: its title, boxes, windows and events; returns the rightmost x drawn so far."""
    mark = {"wrong": "✗ ", "right": "✓ ", "": ""}[lane.verdict]
    color = {"wrong": PALETTE["vermillion"], "right": PALETTE["green"], "": "black"}[lane.verdict]
    title = "\n".join(textwrap.wrap(mark + lane.title, 38, break_on_hyphens=False))
    ax.text(-0.3, y, title, ha="right", va="center", fontsize=9, color=color)
    high = False
    opened: tuple[float, str] | None = None
    for kind, x, w, label in layout(lane):
        if kind == "[":
            opened = (x, label)
        elif kind == "]" and opened is not None:
            _shade(ax, opened[0], x, y, opened[1])
            opened = None
        elif kind in _BOX_COLOR:
            _box(ax, x, y, w, label, _BOX_COLOR[kind])
        elif kind == "S":
            _box(ax, x, y, w, label, PALETTE["black"], "white")
        else:
            _event(ax, kind, x, y, w, label, high)
            high = not high
        longest = max(longest, x + w)
    return longest


def _shade(ax: Axes, start: float, x: float, y: float, name: str) -> None:
    """The shaded span of an accumulation window, from ``start`` to ``x``, named below."""
    ax.add_patch(
        FancyBboxPatch(
            (start, y - 0.42),
            x - start,
            0.84,
            boxstyle="round,pad=0,rounding_size=0.1",
            facecolor=PALETTE["yellow"],
            alpha=0.35,
            edgecolor="none",
            zorder=0,
        )
    )
    ax.text((start + x) / 2, y - 0.47, name, ha="center", va="top", fontsize=7.5, color="#555555")


def _event(ax: Axes, kind: str, x: float, y: float, w: float, label: str, high: bool) -> None:
    """An event marker (a tick with a label, raised when ``high`` so that neighbours do not collide)."""
    ev = _EVENT_COLOR[kind]
    ax.plot([x + w / 2] * 2, [y - 0.34, y + 0.34], color=ev, linewidth=2.2)
    ax.plot(x + w / 2, y + 0.34, marker="v", color=ev, markersize=6)
    ax.text(x + w / 2, y + (0.62 if high else 0.45), label, ha="center", va="bottom", fontsize=8.5, color=ev)
