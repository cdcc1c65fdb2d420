"""Issue 39: weight decay written into the gradient, and model averages (EMA, SWA) updated per micro-batch.

A term proportional to the parameters added to ``.grad`` once per step (or an L2 term in the loss) is weight
decay: a note, the rest of the loop judged without it. Added after every micro-batch it is K times the decay the
loop writes: a bug. An ``AveragedModel`` (or an EMA written by hand) updated between backward passes is a bug;
once per step it is not. Loops and models written for the tests, in float64 unless a test says otherwise.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from gradaccum.checker import check

K = 4
WD = 5e-3


def _make(dtype: torch.dtype = torch.float64) -> tuple[nn.Module, nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3)).to(dtype)
    x, y = torch.randn(24, 6, dtype=dtype), torch.randint(0, 3, (24,))
    return model, nn.CrossEntropyLoss(), x, y


def _decay_step(per_micro_batch: bool, divide_by: int | None = None, spare_biases: bool = False):
    """SGD with ``p.grad += WD * p``; ``divide_by``: a fixed K the loss is divided by, whatever k is."""

    def step(model, loss_fn, x, y, k):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        opt.zero_grad()
        decayed = [p for name, p in model.named_parameters() if not spare_biases or "bias" not in name]
        for xb, yb in zip(x.chunk(k), y.chunk(k)):
            (loss_fn(model(xb), yb) / (divide_by or k)).backward()
            if per_micro_batch:
                with torch.no_grad():
                    for p in decayed:
                        p.grad += WD * p
        if not per_micro_batch:
            with torch.no_grad():
                for p in decayed:
                    p.grad += WD * p
        opt.step()

    return step


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_decay_added_once_is_a_note_and_the_gradient_compared_without_it(dtype):
    report = check(*_make(dtype), K, step=_decay_step(False))
    assert report.ok and report.rel_error <= report.tolerance, report
    (note,) = report.findings
    assert (note.code, note.severity) == ("weight_decay_in_gradient", "note")
    assert f"{WD:g}·θ" in note.evidence and "once" in note.evidence


def test_decay_added_after_every_micro_batch_is_a_bug_that_counts_the_additions():
    report = check(*_make(), K, step=_decay_step(True))
    assert report.codes == ["weight_decay_per_micro_batch"] and not report.ok, report
    evidence = report.findings[0].evidence
    assert f"{K}× in one window" in evidence and f"{K * WD:g}·θ in all" in evidence, evidence


def test_decay_that_spares_the_biases_is_found_on_the_other_tensors():
    report = check(*_make(), K, step=_decay_step(False, spare_biases=True))
    assert report.ok, report
    assert "on 2 of 4 parameter tensors (not on 0.bias, 2.bias)" in report.findings[0].evidence


def test_decay_does_not_hide_the_other_bugs_of_the_loop():
    """A loss divided by a fixed K: the whole window is right, the partial window of K − 1 is not."""
    report = check(*_make(), K, step=_decay_step(False, divide_by=K))
    assert [f.code for f in report.findings] == ["weight_decay_in_gradient", "partial_window"], report
    report = check(*_make(), K, step=_decay_step(False, divide_by=1))
    assert report.codes == ["missing_1_over_k"], report


def _average_step(per_micro_batch: bool, by_hand: bool):
    def step(model, loss_fn, x, y, k):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ema = copy.deepcopy(model) if by_hand else torch.optim.swa_utils.AveragedModel(model)

        def update():
            if by_hand:
                with torch.no_grad():
                    for e, p in zip(ema.parameters(), model.parameters()):
                        e.mul_(0.999).add_(p.detach(), alpha=0.001)
            else:
                ema.update_parameters(model)

        opt.zero_grad()
        for xb, yb in zip(x.chunk(k), y.chunk(k)):
            (loss_fn(model(xb), yb) / k).backward()
            if per_micro_batch:
                update()
        opt.step()
        if not per_micro_batch:
            update()

    return step


@pytest.mark.parametrize("by_hand", [False, True], ids=["AveragedModel", "by hand"])
def test_an_average_updated_per_micro_batch_is_named_and_once_per_step_is_not(by_hand):
    assert check(*_make(), K, step=_average_step(False, by_hand)).findings == []
    report = check(*_make(), K, step=_average_step(True, by_hand))
    assert report.codes == ["ema_per_micro_batch"], report
    finding = report.findings[0]
    assert f"updated {K}× in one window of {K}" in finding.evidence, finding.evidence
    assert "once per optimizer step" in finding.fix and "ρ^κ" in finding.fix and "Busbridge" in finding.fix
