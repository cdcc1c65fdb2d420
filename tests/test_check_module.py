"""``gradaccum.check`` is the checker's function however it is imported, and ``python -m gradaccum.check`` is its
command line (src/gradaccum/check.py replaces itself with the function in ``sys.modules`` unless it runs as
``__main__``)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
from layout import ROOT

import gradaccum
from gradaccum.checker import check as checker_check


def test_every_import_of_gradaccum_check_gives_the_function():
    import gradaccum.check as imported_as_module
    from gradaccum import check

    assert check is checker_check
    assert imported_as_module is checker_check
    assert gradaccum.check is checker_check
    assert importlib.import_module("gradaccum.check") is checker_check
    assert sys.modules["gradaccum.check"] is checker_check


def test_names_from_gradaccum_check_are_an_import_error():
    """``from gradaccum.check import Report`` fails at the import (the names are in gradaccum.checker)."""
    with pytest.raises(ImportError, match="Report"):
        exec("from gradaccum.check import Report", {})
    from gradaccum.checker import Report  # where it is

    assert isinstance(Report, type)


@pytest.mark.slow
def test_python_m_gradaccum_check_is_the_command_line_under_its_own_name():
    """--help exits 0 and names the command as typed; a usage error exits 2 with its message."""
    command = [sys.executable, "-m", "gradaccum.check"]
    helped = subprocess.run([*command, "--help"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert helped.returncode == 0, helped.stderr[-2000:]
    assert helped.stdout.startswith("usage: python -m gradaccum.check ") and "--allow CODE" in helped.stdout
    refused = subprocess.run([*command, "-k", "0", "mod:make"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert refused.returncode == 2 and "python -m gradaccum.check: error: -k must be >= 1" in refused.stderr
    assert "Traceback" not in refused.stderr, refused.stderr
