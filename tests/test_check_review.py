"""Regressions from an independent review of gradaccum.check: each test is one of the reviewer's loops (a small
float64 MLP, K = 4) and pins the finding, and the numbers its evidence states."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import clip_grad_norm_

from gradaccum import check as C

K = 4


def make() -> tuple[nn.Module, object, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 20, generator=g, dtype=torch.float64)
    y = torch.randint(0, 5, (32,), generator=g)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 5)).double()
    return model, F.cross_entropy, x, y


def missing_k(clip: float | None = None, running: bool = False, noise: bool = False):
    def step(model, loss_fn, x, y, k):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        opt.zero_grad()
        for xb, yb in zip(x.chunk(k), y.chunk(k)):
            if noise:
                xb = xb + 0.01 * torch.randn_like(xb)
            loss = loss_fn(model(xb), yb)
            (loss if not noise else loss / k).backward()
            if clip is not None and running:
                clip_grad_norm_(model.parameters(), clip)
        if clip is not None and not running:
            clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return step


def correct(clip: float | None = None):
    def step(model, loss_fn, x, y, k):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        opt.zero_grad()
        for xb, yb in zip(x.chunk(k), y.chunk(k)):
            (loss_fn(model(xb), yb) / k).backward()
        if clip is not None:
            clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return step


def several(model, loss_fn, x, y, k):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=50)
    for i, (xb, yb) in enumerate(zip(x.chunk(k), y.chunk(k))):
        if i % 2 == 0:
            opt.zero_grad()
        loss_fn(model(xb), yb).backward()
        sched.step()
    opt.step()


def by_code(report: C.Report) -> dict[str, object]:
    return {f.code: f for f in report.findings}


def test_missing_k_hidden_by_clip_once_is_named_from_the_unclipped_weights():
    report = C.check(*make(), K, step=missing_k(clip=0.1), partial=False)
    assert report.codes == ["missing_1_over_k"], str(report)
    ev = by_code(report)["missing_1_over_k"].evidence
    assert "each backward added [1, 1, 1, 1]×" in ev and "the micro-batch weights are 4× the full batch's" in ev
    assert "hides part or all of this" in ev and "gradient_scaled" not in report.codes


def test_missing_k_with_loose_running_clip_names_both_causes():
    report = C.check(*make(), K, step=missing_k(clip=2.0, running=True), partial=False)
    assert set(report.codes) == {"clip_running_buffer", "missing_1_over_k"}, str(report)
    assert report.weights[0] == pytest.approx(1.0, rel=1e-9)  # 4× the full batch's 0.25: the clip bit only late
    assert "each backward added [1, 1, 1, 1]×" in by_code(report)["missing_1_over_k"].evidence


def test_correct_loops_with_clipping_stay_ok():
    for clip in (0.1, 2.0):
        report = C.check(*make(), K, step=correct(clip), partial=False)
        assert report.ok and not report.findings, str(report)


def test_evidence_states_what_it_measured_in_a_three_bug_loop():
    report = C.check(*make(), K, step=several, partial=False)
    assert set(report.codes) == {"scheduler_step_inside_window", "missing_1_over_k", "zero_grad_inside_window"}
    ev = by_code(report)["missing_1_over_k"].evidence
    assert "the micro-batch weights are 4× the full batch's" in ev
    assert f"relative error {C.num(report.rel_error)}," in ev  # 1.963, the number measured
    assert "K − 1" not in ev and "gradient is 4×" not in ev


def test_noise_added_in_the_step_is_inconclusive_not_unexplained():
    report = C.check(*make(), K, step=missing_k(noise=True), partial=False)
    assert report.codes == ["randomness_not_replayed"], str(report)
    f = report.findings[0]
    assert f.severity == "inconclusive" and "outside model.forward" in f.evidence
    assert "accumulate_backward" not in str(report)


def test_the_unexplained_fix_shows_the_correct_loop_not_an_internal_name():
    assert "accumulate_backward" not in C.__dict__.get("CORRECT_LOOP", "")
    from gradaccum.check_fingerprints import CORRECT_LOOP
    assert "/ K).backward()" in CORRECT_LOOP and "optimizer.step()" in CORRECT_LOOP


def test_a_clip_threshold_other_than_the_loops_is_said_explicitly():
    report = C.check(*make(), K, step=correct(0.3), clip=2.0, partial=False)  # full-batch norm 0.4889
    f = report.findings[0]
    assert f.code == "clip_threshold_differs" and f.severity == "note", str(report)
    assert "you gave 2; your loop's clip call(s) use 0.3" in f.evidence
    assert "gradient_scaled" in report.codes  # the step is really 0.3 / 0.4889 of the reference's length
    assert any(n.startswith("clipping:") and "threshold 0.3" in n for n in report.notes)


def test_a_threshold_given_without_a_clip_call_is_a_note_when_it_does_not_bite():
    report = C.check(*make(), K, step=correct(), clip=1.0, partial=False)
    assert [f.code for f in report.findings] == ["clip_missing"], str(report)
    assert report.findings[0].severity == "note" and report.ok
    assert "0.4889" in report.findings[0].evidence  # the full-batch norm, below the threshold 1


@pytest.mark.parametrize("args", [("nomodule:make", "--json"), ("x:y", "-k", "0", "--json"),
                                  ("x:y", "--bogus", "--json")])
def test_json_usage_errors_are_json_on_stdout(args, capsys):
    status = C.main(list(args))
    out = capsys.readouterr().out
    assert status == 2 and json.loads(out)["ok"] is False and json.loads(out)["usage_error"]


def test_rel_error_not_measured_is_null_in_json():
    report = C.Report(K, float("nan"), float("nan"), 1e-9)
    assert report.to_dict()["rel_error"] is None and report.to_dict()["cosine"] is None
