"""An exception inside the checker's own call recorder is reported as an inconclusive ``checker_error`` finding
(with the exception's type and message), never dropped: a recorder bug must not become a silent wrong verdict."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gradaccum import check
from gradaccum.checker import CODES
from gradaccum.checker.recorder import CallRecorder


def _setup() -> tuple[nn.Module, object, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x, y = torch.randn(16, 6, dtype=torch.float64), torch.randint(0, 3, (16,))
    return model, F.cross_entropy, x, y


def _step(model, loss_fn, x, y, k):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.zero_grad()
    for xb, yb in zip(x.chunk(k), y.chunk(k)):
        (loss_fn(model(xb), yb) / k).backward()
    opt.step()


def test_gradaccum_check_is_the_function():
    assert callable(check) and check.__module__ == "gradaccum.checker.pipeline"


def test_a_correct_loop_has_no_checker_error():
    report = check(*_setup(), 4, step=_step)
    assert report.ok and report.findings == [], report


def test_an_exception_in_the_recorder_is_an_inconclusive_checker_error(monkeypatch):
    def broken(self, frame, name):
        raise RuntimeError("planted recorder failure")

    monkeypatch.setattr(CallRecorder, "_call", broken)
    report = check(*_setup(), 4, step=_step)
    assert "checker_error" in CODES
    errors = [f for f in report.findings if f.code == "checker_error"]
    assert len(errors) == 1 and errors[0].severity == "inconclusive", report
    assert "RuntimeError: planted recorder failure" in errors[0].evidence
    assert "bug in gradaccum" in errors[0].fix
    assert not report.ok
    assert not any(f.severity == "bug" for f in report.findings), report
