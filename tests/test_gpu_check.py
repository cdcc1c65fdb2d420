"""scripts/gpu_check.py: every chapter's code as a script, its printed output compared with the stored one."""

import importlib.util
import json
import sys

import pytest
from layout import ROOT, UNCOMPARED

pytestmark = pytest.mark.commands


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def notebook(path, cells):
    """Code cells given as (source, stored text/plain or None)."""
    nb_cells = []
    for i, (src, text) in enumerate(cells):
        outputs = (
            []
            if text is None
            else [
                {
                    "output_type": "execute_result",
                    "execution_count": i + 1,
                    "metadata": {},
                    "data": {"text/plain": text},
                }
            ]
        )
        nb_cells.append(
            {
                "cell_type": "code",
                "execution_count": i + 1,
                "id": f"c{i}",
                "metadata": {},
                "outputs": outputs,
                "source": src,
            }
        )
    path.write_text(json.dumps({"cells": nb_cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    return path


def test_the_last_expression_is_displayed_as_in_a_notebook(gpu_check):
    assert "display(x)" in gpu_check.cell_program("x = 6 * 7\nx")
    assert gpu_check.cell_program("x = 1") == "x = 1"
    assert "%time" not in gpu_check.cell_program("%time x = 1\nx = 2")


def test_a_printed_number_that_differs_is_reported_with_its_cell(gpu_check, tmp_path, monkeypatch):
    monkeypatch.setenv("GRADACCUM_DEVICE", "cpu")
    path = notebook(
        tmp_path / "tiny.ipynb", [("x = 6 * 7\nx", "42"), ("print(f'{x / 7:.2f}')", None), ("y = 0.1 + 0.2\ny", "0.3")]
    )
    report = gpu_check.run(path)
    assert report.ok and report.compared == 3
    assert len(report.wrong) == 2 and report.wrong[0].startswith("cell 2: stored '', here '6.00'")
    assert "0.30000000000000004" in report.wrong[1] and report.allowed == []


def test_a_cell_the_page_lists_may_differ(gpu_check, tmp_path, monkeypatch):
    """The chapters' own list of measurement cells (tests/layout.py UNCOMPARED) is what gpu_check allows."""
    monkeypatch.setenv("GRADACCUM_DEVICE", "cpu")
    stem, (cell_id, _) = "02_ghost_batchnorm", next(iter(UNCOMPARED["02_ghost_batchnorm"].items()))
    path = notebook(tmp_path / f"{stem}.ipynb", [("print(1.0)", "0.9")])
    nb = json.loads(path.read_text())
    nb["cells"][0]["id"] = cell_id
    path.write_text(json.dumps(nb))
    report = gpu_check.run(path)
    assert report.ok and report.allowed == ["cell 1"] and report.wrong == []


def test_a_failing_assert_fails_the_chapter(gpu_check, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GRADACCUM_DEVICE", "cpu")
    path = notebook(tmp_path / "bad.ipynb", [("assert 1 == 2, 'wrong'", None)])
    assert gpu_check.main([str(path)]) == 1
    assert "AssertionError: wrong" in capsys.readouterr().err
