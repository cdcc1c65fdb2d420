"""Issue 39: ``check`` on a ``torch.compile``'d model. The checker runs the model eagerly
(``torch.compiler.set_stance("force_eager")``): it checks the loop and the model's code, not the compiler, and its
per-sample replay of dropout is then exact. The process keeps its compiled code: Dynamo, meeting the checker's
dispatch modes, would otherwise have marked the model's code eager for good."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradaccum.checker import check

K = 4


def _model(p: float) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Dropout(p), nn.Linear(16, 4)).double()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(32, 10, dtype=torch.float64), torch.randint(0, 4, (32,))


def _loop(scale: float = 1.0, scheduler_each: bool = False):
    def step(model, loss_fn, x, y, k):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, 10)
        opt.zero_grad()
        for xb, yb in zip(x.chunk(k), y.chunk(k)):
            (loss_fn(model(xb), yb) * scale / k).backward()
            if scheduler_each:
                sched.step()
        opt.step()
        if not scheduler_each:
            sched.step()

    return step


@pytest.mark.slow  # about 5 s on 2 cores, the first import of torch's compiler included
@pytest.mark.parametrize("p", [0.0, 0.3], ids=["no dropout", "dropout"])
def test_compiled_loops_get_the_verdicts_of_their_eager_twins(p):
    x, y = _data()
    loops = {
        (): _loop(),
        ("missing_1_over_k",): _loop(scale=K),
        ("scheduler_step_inside_window",): _loop(scheduler_each=True),
    }
    for codes, step in loops.items():
        report = check(torch.compile(_model(p)), nn.CrossEntropyLoss(), x, y, K, step=step)
        eager = check(_model(p), nn.CrossEntropyLoss(), x, y, K, step=step)
        assert tuple(report.codes) == codes and report.ok == (not codes), report
        assert report.rel_error == pytest.approx(eager.rel_error, abs=1e-15)
        assert report.weights == pytest.approx(eager.weights, abs=1e-12)
    assert report.rel_error <= 1e-9  # the replayed dropout masks are the eager model's: the window matches


def test_a_compiled_model_still_runs_compiled_after_the_check():
    graphs = {"compiled": 0, "ran": 0}

    def backend(gm, example_inputs):  # counts compilations and runs of compiled code
        graphs["compiled"] += 1

        def run(*args):
            graphs["ran"] += 1
            return gm.forward(*args)

        return run

    x, y = _data()
    model = torch.compile(_model(0.0), backend=backend)
    model(x)
    assert graphs == {"compiled": 1, "ran": 1}
    report = check(model, nn.CrossEntropyLoss(), x, y, K, step=_loop())
    assert report.ok and graphs == {"compiled": 1, "ran": 1}, graphs  # the check itself compiles and runs nothing
    model(x)
    other = torch.compile(nn.Sequential(nn.Linear(3, 2)).double(), backend=backend)
    other(torch.randn(2, 3, dtype=torch.float64))
    assert graphs == {"compiled": 2, "ran": 3}, graphs
