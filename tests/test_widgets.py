import matplotlib
import pytest

from gradaccum.book.widgets import interactive_figure, show_errors

matplotlib.use("Agg")


def test_value_error_becomes_a_message(capsys):
    def f(k):
        raise ValueError(f"K must be >= 1, got {k}")

    assert show_errors(f)(0) is None
    out = capsys.readouterr().out
    assert out == "⚠ K must be >= 1, got 0\n" and "Traceback" not in out


def test_other_errors_are_not_hidden():
    def f():
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError):
        show_errors(f)()


def test_figures_are_shown_and_closed():
    import matplotlib.pyplot as plt

    plt.close("all")

    def f():
        return plt.figure()

    show_errors(f)()
    assert plt.get_fignums() == []


def test_interactive_figure_wraps_the_function(capsys):
    ipywidgets = pytest.importorskip("ipywidgets")
    calls = []

    def plot(k):
        calls.append(k)
        if k < 1:
            raise ValueError("K must be at least 1; move the slider to 1 or more")

    w = interactive_figure(plot, k=ipywidgets.IntSlider(2, min=0, max=4))
    assert isinstance(w, ipywidgets.interactive)
    w.children[0].value = 0  # an invalid choice: the message, never a traceback
    w.update()
    assert calls[0] == 2 and 0 in calls
    out = capsys.readouterr().out
    assert "⚠ K must be at least 1" in out and "Traceback" not in out


def _bars(k, label="x"):
    import matplotlib.pyplot as plt

    if k < 1:
        raise ValueError(f"K must be at least 1, got {k}; move the slider to 1 or more")
    fig, ax = plt.subplots(figsize=(2, 1.5))
    ax.bar([label], [k])
    return fig


def test_explorer_precomputes_every_grid_point_with_the_live_function():
    import base64
    import json
    import re

    import matplotlib.pyplot as plt
    from ipywidgets import Dropdown, IntSlider

    from gradaccum.book.widgets import explorer, render_frame

    plt.close("all")
    e = explorer(
        _bars,
        grid={"k": [0, 1, 3], "label": ["a", "b"]},
        alt="bars",
        k=IntSlider(1, min=0, max=5, description="K"),
        label=Dropdown(options=["a", "b", "c"], value="a"),
    )
    assert sorted(e.frames) == ["0-0", "0-1", "1-0", "1-1", "2-0", "2-1"]
    assert e.frames["0-1"].message == "K must be at least 1, got 0; move the slider to 1 or more"
    assert e.frames["0-1"].src is None and e.frames["2-1"].message is None
    png = base64.b64decode(e.frames["1-0"].src.split(",", 1)[1])
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert e.frames["1-0"] == render_frame(_bars, {"k": 1, "label": "a"})  # the live picture at the grid point
    assert e.frames["1-0"] != e.frames["2-0"] and e.frames["1-0"] != e.frames["1-1"]
    assert plt.get_fignums() == [], "frames are closed, none displayed"
    page = e.html()
    assert page.count('type="range"') == 1 and page.count("<select") == 1 and page.count("<option") == 2
    assert 'value="1"><output' in page and e.frames["1-0"].src in page.split("<script")[0]  # initial = (k=1, a)
    data = json.loads(re.search(r'class="ga-explorer-data">(.*?)</script>', page).group(1))
    assert data["labels"] == [["0", "1", "3"], ["a", "b"]] and data["names"] == ["K", "label"]
    assert data["frames"]["0-0"] == {"message": e.frames["0-0"].message}
    bundle = e._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle and bundle["text/html"] == page
    again = explorer(
        _bars,
        grid={"k": [0, 1, 3], "label": ["a", "b"]},
        alt="bars",
        k=IntSlider(1, min=0, max=5, description="K"),
        label=Dropdown(options=["a", "b"], value="a"),
    )
    assert again.html() == page, "the stored HTML is deterministic"


def test_explorer_refuses_a_grid_that_misses_the_initial_picture():
    from ipywidgets import IntSlider

    from gradaccum.book.widgets import explorer

    with pytest.raises(ValueError, match="grid"):
        explorer(_bars, grid={"k": [1, 3]}, alt="bars", k=IntSlider(2))
    with pytest.raises(ValueError, match="not controls"):
        explorer(_bars, grid={"K": [1, 3]}, alt="bars", k=IntSlider(1))


def test_explorer_fixes_the_controls_off_the_grid_and_passes_other_errors():
    from ipywidgets import Dropdown, IntSlider

    from gradaccum.book.widgets import explorer

    e = explorer(_bars, grid={"k": [1, 2]}, alt="bars", k=IntSlider(1), label=Dropdown(options=["z"], value="z"))
    assert sorted(e.frames) == ["0", "1"] and e.html().count("data-param=") == 1

    def broken(k):
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError):
        explorer(broken, grid={"k": [1]}, alt="x", k=IntSlider(1))
    with pytest.raises(TypeError, match="Figure"):
        explorer(lambda k: None, grid={"k": [1]}, alt="x", k=IntSlider(1))


def test_explorer_survives_hostile_text_and_refuses_impossible_grids():
    import matplotlib.pyplot as plt
    from ipywidgets import Dropdown, IntSlider

    from gradaccum.book.widgets import explorer

    def hostile(k):
        if k == 2:
            plt.figure()  # begun, then the error: it must not be left open
            raise ValueError("a <!--<script> b </script><b>x</b>")
        return _bars(k)

    plt.close("all")
    e = explorer(hostile, grid={"k": [1, 2]}, alt="x", k=IntSlider(1, min=1, max=3))
    page = e.html()
    data = page.split('class="ga-explorer-data">')[1].split("</script>")[0]
    assert "<" not in data and plt.get_fignums() == []
    with pytest.raises(ValueError, match="control"):
        explorer(_bars, grid={"k": [1, 100]}, alt="x", k=IntSlider(1, min=1, max=5))
    with pytest.raises(ValueError, match="control"):
        explorer(
            _bars,
            grid={"k": [1], "label": ["a", "zzz"]},
            alt="x",
            k=IntSlider(1),
            label=Dropdown(options=["a", "b"], value="a"),
        )
    with pytest.raises(ValueError, match="not an abbreviation"):
        explorer(_bars, grid={"k": [1, 2]}, alt="x", k=(1, 5))
    assert "⚠ " in explorer(hostile, grid={"k": [2]}, alt="x", k=IntSlider(2, min=1, max=3)).html()


@pytest.mark.slow
def test_a_frame_has_the_pixels_savefig_writes():
    """render_frame draws the figure once on an Agg canvas: the same pixels as ``savefig(format="png", dpi=dpi)``
    (before both are cut to a 64-colour palette), at two dpi values, for a constrained layout with text, a legend
    and bars, and for an image with a colour bar."""
    import base64
    import io

    import matplotlib.pyplot as plt
    import numpy as np
    from PIL import Image

    from gradaccum.book.plotting import figure
    from gradaccum.book.widgets import render_frame

    def bars(k: int):
        fig, (ax1, ax2) = figure(2, 7.2, 3.0)
        ax1.bar(range(k), np.arange(k) ** 0.5, label="√i")
        ax2.plot(np.linspace(0, 1, 50), np.sin(np.linspace(0, k, 50)))
        ax1.legend()
        ax1.set_title(f"K = {k}: α, β")
        return fig

    def image(k: int):
        fig, ax = plt.subplots(figsize=(4.0, 3.0))
        fig.colorbar(ax.imshow(np.outer(np.arange(k), np.arange(7)) % 5), ax=ax)
        return fig

    for plot, dpi, size in ((bars, 72, (518, 216)), (bars, 100, (720, 300)), (image, 100, (400, 300))):
        buf = io.BytesIO()
        fig = plot(5)
        fig.savefig(buf, format="png", dpi=dpi)
        plt.close(fig)
        expected = Image.open(buf).convert("RGB").quantize(colors=64).convert("RGB")
        frame = render_frame(plot, {"k": 5}, dpi=dpi)
        got = Image.open(io.BytesIO(base64.b64decode(frame.src.split(",", 1)[1]))).convert("RGB")
        assert got.size == expected.size == size
        assert np.array_equal(np.asarray(got), np.asarray(expected)), (plot.__name__, dpi)
    assert plt.get_fignums() == []
