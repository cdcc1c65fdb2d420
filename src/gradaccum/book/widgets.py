"""A thin ipywidgets layer over the book's pure, tested functions.

A widget never shows a traceback: a ``ValueError`` raised by the function behind it (an impossible
combination of K and micro-batch size, say) is shown as its message, which says what to change.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import ipywidgets
import matplotlib.pyplot as plt
from matplotlib.figure import Figure


def show_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``fn`` so that a ``ValueError`` is printed as a one-line message instead of raised, and a
    matplotlib figure that ``fn`` returns is shown (and closed)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        try:
            result = fn(*args, **kwargs)
        except ValueError as err:
            print(f"⚠ {err}")
            return None
        if isinstance(result, Figure):
            plt.show()
            plt.close(result)
        return None

    return wrapper


def interactive_figure(plot_fn: Callable[..., Any], **controls: Any):
    """``ipywidgets.interactive`` over ``plot_fn`` with errors shown as messages.

    ``controls`` are ipywidgets controls (or abbreviations) keyed by ``plot_fn``'s argument names. The
    returned widget, displayed as a cell's last value, draws ``plot_fn``'s figure with the controls' initial
    values, which is also the picture a reader of the static site sees.
    """

    return ipywidgets.interactive(show_errors(plot_fn), **controls)
