"""A thin ipywidgets layer over the book's pure, tested functions.

A widget never shows a traceback: a ``ValueError`` raised by the function behind it (an impossible
combination of K and micro-batch size, say) is shown as its message, which says what to change.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import html
import io
import itertools
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ipywidgets
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from PIL import Image


def _call_closing_on_error(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``; if it raises, the figures it had begun are closed first (no half-drawn figure is
    left open beside the message)."""
    before = set(plt.get_fignums())
    try:
        return fn(*args, **kwargs)
    except Exception:
        for number in set(plt.get_fignums()) - before:
            plt.close(number)
        raise


def show_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``fn`` so that a ``ValueError`` is printed as a one-line message instead of raised, and a
    matplotlib figure that ``fn`` returns is shown (and closed)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        try:
            result = _call_closing_on_error(fn, *args, **kwargs)
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


#: The explorer's front end: sliders (or menus) over the precomputed grid swap the figure; an impossible
#: combination shows its ``ValueError`` message instead. Plain DOM, no library, no kernel, no network.
_EXPLORER_JS = """(function () {
  var script = document.currentScript;
  var root = script && script.parentNode && script.parentNode.classList.contains("ga-explorer")
    ? script.parentNode : document.getElementById("%(id)s");
  if (!root || root.getAttribute("data-ready")) { return; }
  root.setAttribute("data-ready", "1");
  var data = JSON.parse(root.querySelector("script.ga-explorer-data").textContent);
  var inputs = Array.prototype.slice.call(root.querySelectorAll("[data-param]"));
  var img = root.querySelector("img"), msg = root.querySelector(".ga-explorer-message");
  function update() {
    var parts = inputs.map(function (el, n) {
      var label = data.labels[n][+el.value], out = root.querySelector("output[for='" + el.id + "']");
      if (out) { out.textContent = label; }
      el.setAttribute("aria-valuetext", data.names[n] + " = " + label);
      return data.names[n] + " = " + label;
    });
    var frame = data.frames[inputs.map(function (el) { return el.value; }).join("-")];
    root.setAttribute("data-frame", parts.join(", "));
    if (frame.src) {
      img.src = frame.src; img.alt = data.alt + " (" + parts.join(", ") + ")";
      img.hidden = false; msg.hidden = true;
    } else {
      msg.textContent = "\\u26a0 " + frame.message; msg.hidden = false; img.hidden = true;
    }
  }
  inputs.forEach(function (el) { el.addEventListener("input", update); el.addEventListener("change", update); });
  update();
})();"""


@dataclass(frozen=True)
class Frame:
    """One precomputed picture of the explorer: a PNG data URI, or the message of the ``ValueError`` raised."""

    src: str | None = None
    message: str | None = None


def render_frame(plot_fn: Callable[..., Any], params: Mapping[str, Any], dpi: int = 72) -> Frame:
    """Call ``plot_fn(**params)`` and return its figure as a small PNG (an adaptive 64-colour palette), or the
    message of the ``ValueError`` it raised. The figure is closed; nothing is displayed."""

    try:
        fig = _call_closing_on_error(plot_fn, **params)
    except ValueError as err:
        return Frame(message=str(err))
    if not isinstance(fig, Figure):
        raise TypeError(
            f"{getattr(plot_fn, '__name__', plot_fn)!r} must return a matplotlib Figure, got {type(fig).__name__}"
        )
    fig.set_dpi(dpi)
    # drawn once and its pixels taken as they are: what savefig(dpi=dpi) writes under the default savefig.*
    # settings (the book changes none), in less time
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    rgb = Image.fromarray(np.asarray(canvas.buffer_rgba())).convert("RGB")
    plt.close(fig)
    png = io.BytesIO()
    rgb.quantize(colors=64).save(png, format="PNG", optimize=True)
    return Frame(src="data:image/png;base64," + base64.b64encode(png.getvalue()).decode("ascii"))


def _grid_label(value: Any) -> str:
    """A grid value as the page shows it: strings as they are, floats to 12 significant digits, others by str."""
    if isinstance(value, float):
        return f"{value:.12g}"
    return value if isinstance(value, str) else str(value)


def _check_on_control(name: str, control: Any, values: Sequence[Any]) -> None:
    """Every grid value must be one the live control can take, so the static page offers no picture the live
    widget cannot show."""
    if not isinstance(control, ipywidgets.ValueWidget):
        raise ValueError(
            f"control {name!r} is {control!r}: pass an ipywidgets control (IntSlider, FloatSlider, "
            "Dropdown, ...), not an abbreviation, so the static and the live widget agree."
        )
    options = getattr(control, "options", None)
    if options is not None:
        allowed = [o[1] if isinstance(o, tuple) else o for o in options]
        bad = [v for v in values if v not in allowed]
    else:
        low, high = getattr(control, "min", None), getattr(control, "max", None)
        if isinstance(control, ipywidgets.FloatLogSlider):  # its min and max are exponents
            low, high = control.base**control.min, control.base**control.max
        bad = [v for v in values if low is not None and not low <= v <= high]
    if bad:
        raise ValueError(
            f"grid values {bad} of {name!r} are outside what its control allows; use values the live widget can take."
        )


class Explorer:
    """A widget that also works without a kernel.

    With a live kernel (Jupyter, Colab, Binder) it is ``interactive_figure(plot_fn, **controls)``: every value
    of every control, computed fresh. Everywhere else (the static site, nbviewer) its HTML form is shown:
    the figures of ``plot_fn`` precomputed over ``grid`` (a few values of some of the controls; the other
    controls stay at their initial values), swapped by sliders in the browser. Both forms draw with the same
    tested function, so the static picture at a grid point is the live one.
    """

    def __init__(
        self,
        plot_fn: Callable[..., Any],
        grid: Mapping[str, Sequence[Any]],
        alt: str,
        controls: Mapping[str, Any],
        dpi: int = 72,
    ) -> None:
        initial = {name: getattr(c, "value", c) for name, c in controls.items()}
        unknown = set(grid) - set(controls)
        if unknown:
            raise ValueError(f"grid names {sorted(unknown)} are not controls; use some of {sorted(controls)}.")
        for name, values in grid.items():
            _check_on_control(name, controls[name], values)
            if initial[name] not in values:
                raise ValueError(
                    f"the initial {name} = {initial[name]!r} is not on its grid {list(values)}; "
                    "add it so the static picture matches the live one."
                )
        self.names = list(grid)
        self.values = [list(grid[n]) for n in self.names]
        self.frames: dict[str, Frame] = {}
        for index in itertools.product(*(range(len(v)) for v in self.values)):
            params = dict(initial, **{n: self.values[i][j] for i, (n, j) in enumerate(zip(self.names, index))})
            self.frames["-".join(map(str, index))] = render_frame(plot_fn, params, dpi=dpi)
        self.initial = [self.values[i].index(initial[n]) for i, n in enumerate(self.names)]
        self.alt = alt
        self.descriptions = [getattr(controls[n], "description", "") or n for n in self.names]
        digest = hashlib.sha1(
            repr(
                (getattr(plot_fn, "__qualname__", ""), self.names, self.values, alt, sorted(self.frames.items()))
            ).encode()
        )  # two explorers on a page differ
        self.id = "ga-explorer-" + digest.hexdigest()[:10]
        self.widget = interactive_figure(plot_fn, **controls)

    def html(self) -> str:
        """The kernel-free form: controls over the grid, the initial figure, the data and the script."""

        controls = []
        for n, (desc, values, start) in enumerate(zip(self.descriptions, self.values, self.initial)):
            cid = f"{self.id}-{n}"
            label = f'<label for="{cid}">{html.escape(desc)}</label>'
            if all(isinstance(v, str) for v in values):
                options = "".join(
                    f'<option value="{i}"{" selected" if i == start else ""}>{html.escape(v)}</option>'
                    for i, v in enumerate(values)
                )
                control = f'<select id="{cid}" data-param="{n}">{options}</select>'
            else:
                shown = html.escape(_grid_label(values[start]))
                control = (
                    f'<input type="range" id="{cid}" data-param="{n}" min="0" max="{len(values) - 1}" '
                    f'step="1" value="{start}"><output for="{cid}">{shown}</output>'
                )
            controls.append(f'<div class="ga-explorer-control">{label}{control}</div>')
        data = {
            "names": list(self.descriptions),
            "labels": [[_grid_label(v) for v in vs] for vs in self.values],
            "alt": self.alt,
            "frames": {k: {"src": f.src} if f.src else {"message": f.message} for k, f in self.frames.items()},
        }
        # no "<" at all in the script element: neither an early </script> nor <!-- can end it
        payload = json.dumps(data, separators=(",", ":")).replace("<", "\\u003c")
        first = self.frames["-".join(map(str, self.initial))]
        grid_text = "; ".join(
            f"{d} ∈ {{{', '.join(_grid_label(v) for v in vs)}}}" for d, vs in zip(self.descriptions, self.values)
        )
        return (
            f'<div class="ga-explorer" id="{self.id}">'
            f'<div class="ga-explorer-controls">{"".join(controls)}</div>'
            '<img class="ga-explorer-figure" style="max-width:100%;height:auto" '
            f'alt="{html.escape(self.alt)}" src="{first.src or ""}"'
            f"{' hidden' if first.src is None else ''}>"
            f'<p class="ga-explorer-message"{"" if first.message else " hidden"}>'
            f"{'⚠ ' + html.escape(first.message) if first.message else ''}</p>"
            f'<p class="ga-explorer-note">Precomputed for {html.escape(grid_text)}. '
            "Run the notebook (Binder, Colab) to compute any value.</p>"
            f'<script type="application/json" class="ga-explorer-data">'
            f"{payload}</script>"
            f"<script>{_EXPLORER_JS % {'id': self.id}}</script></div>"
        )

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        bundle = self.widget._repr_mimebundle_(**kwargs)
        bundle["text/html"] = self.html()
        return bundle


def explorer(plot_fn: Callable[..., Any], grid: Mapping[str, Sequence[Any]], alt: str, **controls: Any) -> Explorer:
    """The book's widget: live over ``controls`` with a kernel, precomputed over ``grid`` without one.

    ``grid`` maps some of the control names to the values the static page offers (each control's initial value
    among them); ``alt`` describes the figure for screen readers. See :class:`Explorer`."""

    return Explorer(plot_fn, grid, alt, controls)
