import copy
import subprocess
import sys

import pytest
import torch

from gradaccum import check as C
from gradaccum.models import make_cnn

CASES = C.demo_cases()
EXPECTED = {
    "correct loop, GroupNorm": None,
    "BatchNorm": "BatchNorm",
    "dropout, fresh masks (correct)": None,
    "clipping inside the loop": "clipping inside",
    "RNG re-seeded per micro-batch": "re-seeded",
    "scheduler stepped per micro-batch": "scheduler.step()",
    "loss scale changed inside the window": "loss scale changes",
    "mean of per-micro-batch token means": "token counts",
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_each_planted_bug_is_found_and_correct_loops_pass(name):
    model, loss_fn, x, y, step, clip = CASES[name]
    if name.startswith("mean of per-micro-batch"):
        loss_fn = C._FlatLoss(ignore_index=-100)
    report = C.check(model, loss_fn, x, y, 4, step=step, clip=clip)
    if EXPECTED[name] is None:
        assert report.ok and not report.findings, str(report)
    else:
        assert not report.ok and any(EXPECTED[name] in f.cause for f in report.findings), str(report)


def test_clip_placement_is_identified():
    model, loss_fn, x, y, step, clip = CASES["clipping inside the loop"]
    report = C.check(model, loss_fn, x, y, 4, step=step, clip=clip)
    assert any("placement 'running'" in f.cause for f in report.findings)


def test_check_leaves_model_and_rng_alone(digits, loss_fn):
    model = make_cnn("batch").train()
    before = copy.deepcopy(model.state_dict())
    torch.manual_seed(42)
    expected_next = torch.rand(3)
    torch.manual_seed(42)
    C.check(model, loss_fn, digits.x_train[:16], digits.y_train[:16], 4)
    assert torch.equal(torch.rand(3), expected_next)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_bad_input(digits, loss_fn):
    model = make_cnn("group")
    x, y = digits.x_train[:10], digits.y_train[:10]
    with pytest.raises(ValueError, match="divisors of 10"):
        C.check(model, loss_fn, x, y, 4)
    with pytest.raises(ValueError, match="K"):
        C.check(model, loss_fn, x, y, 0)

    class TupleModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = make_cnn("group")

        def forward(self, x):
            return self.inner(x), None

    with pytest.raises(ValueError, match="must return a tensor"):
        C.check(TupleModel(), loss_fn, x, y, 2)
    with pytest.raises(ValueError, match="scalar"):
        C.check(model, torch.nn.CrossEntropyLoss(reduction="none"), x, y, 2)


def test_command_line_demo():
    out = subprocess.run([sys.executable, "-m", "gradaccum.check", "--demo"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.count("== ") == len(EXPECTED) and "Traceback" not in out.stderr
