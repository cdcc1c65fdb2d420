"""One look for every figure: fixed sizes, a colour-blind-safe palette, labelled axes.

Figures have fixed sizes so that the ``<Figure size …>`` line that nbval compares never changes.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import NullLocator

#: Okabe & Ito's colour-blind-safe palette (black first).
PALETTE: dict[str, str] = {
    "black": "#000000",
    "orange": "#E69F00",
    "sky": "#56B4E9",
    "green": "#009E73",
    "yellow": "#F0E442",
    "blue": "#0072B2",
    "vermillion": "#D55E00",
    "purple": "#CC79A7",
}

#: A fixed colour per normalization, used in every chapter.
NORM_COLORS: dict[str, str] = {
    "batch": PALETTE["vermillion"],
    "group": PALETTE["blue"],
    "layer": PALETTE["green"],
    "none": PALETTE["black"],
}

#: A fixed marker per normalization, so that colour is never the only cue.
NORM_MARKERS: dict[str, str] = {"batch": "o", "group": "s", "layer": "^", "none": "x"}


def figure(ncols: int = 1, width: float = 6.4, height: float = 3.6) -> tuple[Figure, list[Axes]]:
    """A figure with ``ncols`` side-by-side axes (always returned as a list) and a tight layout."""
    if ncols < 1:
        raise ValueError(f"ncols must be >= 1, got {ncols}.")
    fig, axes = plt.subplots(1, ncols, figsize=(width, height), layout="constrained", squeeze=False)
    return fig, list(axes[0])


def decorate(
    ax: Axes,
    xlabel: str = "",
    ylabel: str = "",
    title: str = "",
    xscale: str | None = None,
    yscale: str | None = None,
    xticks: Sequence[float] | None = None,
    legend: bool = True,
) -> Axes:
    """Label an axes in one call (after Allen Downey's ``decorate``)."""
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    if xscale:
        ax.set_xscale(xscale)
    if yscale:
        ax.set_yscale(yscale)
    if xticks is not None:
        ax.set_xticks(list(xticks), [str(t) for t in xticks])
        ax.xaxis.set_minor_locator(NullLocator())
    ax.grid(alpha=0.3)
    if legend and ax.get_legend_handles_labels()[0]:
        ax.legend(frameon=False)
    return ax
