"""Step counting under accumulation (chapter 6): what a learning-rate scheduler and Adam count when they are
stepped after every micro-batch instead of once per optimizer step.

A schedule sized in optimizer steps runs K times too fast when ``scheduler.step()`` follows every micro-batch
(:func:`lr_trajectory`); PyTorch warns about the order of the calls only at the scheduler's first step
(:func:`scheduler_order_warnings`); ``OneCycleLR`` raises after about 1/K of the windows
(:func:`onecycle_steps_before_error`); and Adam's step count, which drives its bias correction, advances K times
per window when ``optimizer.step()`` runs per micro-batch (:func:`adam_step_count`). Each is measured on a real
optimizer and scheduler, not modelled. :mod:`gradaccum.windows` re-exports them.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from gradaccum._validate import require_count, require_flag, require_k, require_positive


def lr_trajectory(
    optimizer_steps: int, k: int, warmup: int, per_micro: bool, lr: float = 1.0
) -> tuple[list[float], list[str]]:
    """The learning rate each *optimizer step* uses under a linear warmup of ``warmup`` steps
    (``LambdaLR``), when ``scheduler.step()`` is called per optimizer step or, wrongly, per micro-batch; and the
    warnings PyTorch raised along the way. The per-micro-batch loop it models makes the window's K scheduler steps
    before its optimizer step (one step ahead of the right loop even at K = 1); in a loop that steps the scheduler
    after each micro-batch's backward, with the optimizer step on the last one, the first optimizer step uses the
    rate after K − 1 scheduler steps instead of K (the same as the right loop at K = 1), and each later one K more."""

    require_k(k)
    require_count(optimizer_steps, "optimizer_steps")
    require_count(warmup, "warmup (schedule steps)")
    require_flag(per_micro, "per_micro", "True: scheduler.step() per micro-batch; False: per optimizer step")
    require_positive(lr, "lr")
    param = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: min(1.0, (t + 1) / warmup))
    used = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(optimizer_steps):
            for _ in range(k):
                if per_micro:
                    sched.step()
            used.append(opt.param_groups[0]["lr"])
            opt.step()
            if not per_micro:
                sched.step()
    return used, [str(w.message).split(". ")[0] for w in caught]


def scheduler_order_warnings(k: int, windows: int, optimizer_first: bool) -> list[str]:
    """The warnings PyTorch raises for a loop that (wrongly) calls ``scheduler.step()`` after every micro-batch and
    ``optimizer.step()`` once per window, K·windows scheduler steps in all. With ``optimizer_first`` one optimizer
    step runs before the loop (as in a loop whose first scheduler step follows an optimizer step). PyTorch checks
    the order only at the scheduler's first ``step()``."""

    require_k(k)
    require_count(windows, "windows")
    require_flag(optimizer_first, "optimizer_first", "one optimizer step before the loop")
    param = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if optimizer_first:
            opt.step()
        for _ in range(windows):
            for _ in range(k):
                sched.step()
            opt.step()
    return [str(w.message).split(". ")[0] for w in caught]


def onecycle_steps_before_error(total_steps: int, k: int) -> int | None:
    """Scheduler steps a ``OneCycleLR(total_steps=...)``, sized in optimizer steps, takes in a loop that (wrongly)
    steps it after every micro-batch before it raises its ``ValueError`` ("Tried to step ... times"): ``total_steps``
    (the next one raises, after about 1/K of the windows); None if the ``total_steps`` windows finish (K = 1)."""
    require_count(total_steps, "total_steps")
    require_k(k)
    param = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=0.1)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=total_steps)
    taken = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the order warning of the first step: scheduler_order_warnings shows it
        for _ in range(total_steps):
            for _ in range(k):
                try:
                    sched.step()
                except ValueError:
                    return taken
                taken += 1
            opt.step()
    return None


def adam_step_count(windows: int, k: int, step_per_micro: bool) -> int:
    """Adam's ``state['step']`` after ``windows`` accumulation windows (it drives the bias correction
    1/(1 − β^t)); stepping per micro-batch advances it K times per window."""
    require_k(k)
    require_count(windows, "windows", minimum=0)
    require_flag(step_per_micro, "step_per_micro", "optimizer.step() after every micro-batch")
    param = nn.Parameter(torch.zeros(3))
    opt = torch.optim.Adam([param], lr=1e-3)
    for _ in range(windows):
        for _ in range(k):
            param.grad = torch.ones(3)
            if step_per_micro:
                opt.step()
        if not step_per_micro:
            opt.step()
    return int(opt.state[param]["step"]) if opt.state else 0  # no step taken: no state yet
