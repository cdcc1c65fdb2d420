"""One look for every figure: fixed sizes, a colour-blind-safe palette, labelled axes.

Figures have fixed sizes so that the ``<Figure size …>`` line that nbval compares never changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import matplotlib.pyplot as plt
import numpy as np
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
    xticks: Sequence[float] | np.ndarray | None = None,
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


def heatmap(
    ax: Axes,
    grid: np.ndarray,
    rows: Sequence[object],
    cols: Sequence[object],
    fmt: str = "{:.2f}",
    vmin: float | None = None,
    vmax: float | None = None,
    xlabel: str = "",
    ylabel: str = "",
    title: str = "",
    aspect: Literal["equal", "auto"] | float = "auto",
):
    """An annotated heat map (first row at the bottom) in the colour-blind-safe cividis map; every cell shows its
    value, in white on the dark half of the scale. Returns the image, for a colour bar."""
    lo = float(grid.min()) if vmin is None else vmin
    hi = float(grid.max()) if vmax is None else vmax
    image = ax.imshow(grid, cmap="cividis", vmin=lo, vmax=hi, origin="lower", aspect=aspect)
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            ax.text(
                j,
                i,
                fmt.format(grid[i, j]),
                ha="center",
                va="center",
                fontsize=7,
                color="white" if grid[i, j] < lo + (hi - lo) / 2 else "black",
            )
    ax.set_xticks(range(len(cols)), [str(c) for c in cols])
    ax.set_yticks(range(len(rows)), [str(r) for r in rows])
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    return image
