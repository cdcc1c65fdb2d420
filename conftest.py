"""Hooks for every test of the repository, chapters included (the fixtures are in tests/conftest.py).

Chapter 5's timing cell measures how much ``no_sync()`` saves and checks a cost model's prediction against it.
Under ``make test`` it never runs while another test runs an eight-process job: see ``tests/layout.heavy_job``.
"""

import pytest
from layout import TIMING_CELL, heavy_job


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    cell = getattr(item, "cell", None)  # an nbval cell
    if cell is not None and TIMING_CELL in cell.get("source", ""):
        with heavy_job():
            yield
    else:
        yield
