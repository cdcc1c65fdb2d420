import pytest

from gradaccum.book.tables import Table


def test_text_and_html_forms_align_numbers_right_and_text_left():
    t = Table(
        ["norm", "b", "val acc"], [["batch", 64, "97.6% (96.4–98.3)"], ["group", 2, "-1.9%"]], caption="Fingerprint"
    )
    assert repr(t).split("\n") == [
        "Fingerprint",
        "norm    b            val acc",
        "batch  64  97.6% (96.4–98.3)",
        "group   2              -1.9%",
    ]
    page = t._repr_html_()
    assert page.startswith('<table class="ga-table"><caption>Fingerprint</caption>')
    assert '<td>batch</td><td class="ga-num">64</td>' in page and page.count("<tr>") == 3


def test_group_header_and_escaping():
    t = Table(["K", "norm/c", "cos"], [["1", "<b>", "1.000"]], groups=[("", 1), ("once", 2)])
    assert '<th colspan="2">once</th>' in t._repr_html_() and "&lt;b&gt;" in t._repr_html_()
    assert repr(t).split("\n")[0].strip() == "once"


@pytest.mark.parametrize(
    "columns, rows, groups, phrase",
    [
        (["a", "b"], [["1"]], (), "row 0 has 1 cells for 2 columns"),
        (["a"], [[0.1]], (), "format numbers yourself"),
        (["a", "b"], [["1", "2"]], [("x", 3)], "add up to 3"),
    ],
)
def test_bad_tables_are_refused_with_what_to_do(columns, rows, groups, phrase):
    with pytest.raises(ValueError, match=phrase):
        Table(columns, rows, groups=groups)


def test_placeholders_do_not_unalign_a_numeric_column_and_only_text_or_integers_go_in():
    import numpy as np

    t = Table(["v", "w"], [["0.1", "—"], ["n/a", "2.5×"], ["3", "—"]])
    assert t.numeric == [True, True]
    for bad in (np.float32(0.1), None, True, np.array([0.1])):
        with pytest.raises(ValueError, match="give text or an integer"):
            Table(["a"], [[bad]])
    with pytest.raises(ValueError, match="give a list of cells"):
        Table(["a", "b"], ["xy"])
    with pytest.raises(ValueError, match="at least one column"):
        Table(["a", "b"], [["1", "2"]], groups=[("x", 3), ("y", -1)])
    assert Table(["a", "b"], [["1", "2"]], groups=(g for g in [("x", 2)])).groups == [("x", 2)]
