"""The checker on loops it was not written for: every correct loop ok, every planted bug named, nothing else.

The matrix (families × loops) is in test_check_zoo.py. A case passes only when the set of bug codes the checker
reports equals the planted set exactly: a missed cause and an extra one both fail. The figures the book reports
(false positives on correct loops, planted bugs named) are recomputed from the same runs.
"""

from __future__ import annotations

import pytest
from test_check_zoo import K, all_cases, family

from gradaccum import checker as C

CASES = all_cases()
IDS = [f"{fam}: {name}" for fam, name, _, _ in CASES]
_REPORTS: dict[str, C.Report] = {}


def _report(i: int, digits) -> C.Report:
    fam, name, step, _ = CASES[i]
    if IDS[i] not in _REPORTS:
        model, loss_fn, x, y = family(fam, digits)
        _REPORTS[IDS[i]] = C.check(model, loss_fn, x, y, K, step=step)
    return _REPORTS[IDS[i]]


@pytest.mark.parametrize("i", range(len(CASES)), ids=IDS)
def test_loop(i, digits):
    expected = CASES[i][3]
    report = _report(i, digits)
    assert set(report.codes) == expected, f"{IDS[i]}\n{report}"
    assert report.ok == (not expected), str(report)


@pytest.mark.slow
def test_false_positive_and_detection_figures(digits):
    """Correct loops flagged / planted bugs named exactly, over the whole matrix."""
    correct = [i for i, case in enumerate(CASES) if not case[3]]
    planted = [i for i, case in enumerate(CASES) if case[3]]
    flagged = [IDS[i] for i in correct if not _report(i, digits).ok]
    named = [i for i in planted if set(_report(i, digits).codes) == CASES[i][3]]
    families = {case[0] for case in CASES}
    assert (len(correct), len(planted), len(families)) == (29, 69, 6)
    assert flagged == [] and len(named) == len(planted) == 69


def test_the_exact_full_batch_scheme_passes_the_checker_without_notes():
    """A loop built on gradaccum.fullbatch_bn is the full-batch step, for full and partial windows; the RNG state
    the scheme restores internally is not a seed the loop sets."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from gradaccum.fullbatch_bn import full_batch_stats_backward

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.2), nn.Linear(8, 3)).double()
    x, y = torch.randn(16, 5, dtype=torch.float64), torch.randint(0, 3, (16,))

    def exact(model, loss_fn, xs, ys, k):
        full_batch_stats_backward(model, loss_fn, xs, ys, k, exact=True)

    report = C.check(model, F.cross_entropy, x, y, 4, step=exact)
    assert report.ok and not report.findings, report
