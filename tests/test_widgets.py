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
