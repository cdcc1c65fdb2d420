"""A demonstration of :func:`gradaccum.checker.check`: correct loops, and one model or loop per planted bug,
on the book's data (the digits and the tiny character model); run by ``python -m gradaccum.checker --demo``,
chapter 6 and the "Check your own loop" page."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils import (
    clip_grad_norm_,  # imported by name: the checker must see it anyway
)

from gradaccum.accumulate import split_batch
from gradaccum.book.data import (
    encode_batch,
    load_corpus,
    load_digits_split,
    make_vocab,
    spread_lines,
)
from gradaccum.book.models import make_cnn, make_lm
from gradaccum.checker import Report, Step, check, token_cross_entropy

#: What :func:`demo_cases` plants: case → codes of the bugs the checker must name (empty: a correct loop).
DEMO_EXPECTED: dict[str, tuple[str, ...]] = {
    "correct loop, GroupNorm": (),
    "BatchNorm": ("batch_coupled_layer",),
    "dropout, fresh masks (correct)": (),
    "clipping inside the loop": ("clip_running_buffer",),
    "RNG re-seeded per micro-batch": ("rng_reseeded",),
    "scheduler stepped per micro-batch": ("scheduler_step_inside_window",),
    "loss scale changed inside the window": ("scaler_update_inside_window",),
    "mean of per-micro-batch token means": ("token_normalization",),
    "two dropout layers (correct)": (),
    "whole iteration, optimizer and LinearLR (correct)": (),
    "clip once after unscale_ (correct)": (),
    "missing 1/K": ("missing_1_over_k",),
    "zero_grad inside the window": ("zero_grad_inside_window",),
    "clip before unscale_": ("clip_before_unscale",),
    "scaler.update() after every micro-batch": ("step_raised", "scaler_update_inside_window"),
    "optimizer.step() after every micro-batch": ("optimizer_step_inside_window",),
    "partial last window divided by K": ("partial_window",),
    "BatchNorm and a missing 1/K": ("batch_coupled_layer", "missing_1_over_k"),
}


def demo_cases() -> dict[str, tuple[nn.Module, Callable, torch.Tensor, torch.Tensor, Step | None, float | None]]:
    """Correct loops and one model or loop per planted bug: name → (model, loss_fn, x, y, step, clip), usable as
    returned: ``check(model, loss_fn, x, y, 4, step=step, clip=clip)``. :data:`DEMO_EXPECTED` says what each
    plants. Needs the book's data (scikit-learn's digits)."""

    d = load_digits_split()
    x, y = d.x_train[:32], d.y_train[:32]
    ce = nn.CrossEntropyLoss()

    def clip_inside(model, loss_fn, xs, ys, k):
        for xb, yb in split_batch(xs, ys, k):
            (loss_fn(model(xb), yb) / k).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)

    def reseeding(model, loss_fn, xs, ys, k):
        for i, (xb, yb) in enumerate(split_batch(xs, ys, k)):
            torch.manual_seed(1234 + i)
            (loss_fn(model(xb), yb) / k).backward()

    sched = torch.optim.lr_scheduler.StepLR(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), step_size=1)

    def scheduler_inside(model, loss_fn, xs, ys, k):
        for xb, yb in split_batch(xs, ys, k):
            (loss_fn(model(xb), yb) / k).backward()
            sched.step()

    def scaler_update_inside(model, loss_fn, xs, ys, k):
        scaler = torch.amp.GradScaler("cpu")
        for xb, yb in split_batch(xs, ys, k):
            scaler.scale(loss_fn(model(xb), yb) / k).backward()
            scaler.update(new_scale=2 * float(scaler.get_scale()))
        for p in model.parameters():
            p.grad /= scaler.get_scale()

    def whole_iteration(model, loss_fn, xs, ys, k):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=10)  # steps once in here
        opt.zero_grad()
        for xb, yb in split_batch(xs, ys, k):
            (loss_fn(model(xb), yb) / k).backward()
        opt.step()
        warmup.step()
        opt.zero_grad()

    def amp_clip(unscale_first: bool) -> Step:
        def step(model, loss_fn, xs, ys, k):
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            scaler = torch.amp.GradScaler("cpu")
            for xb, yb in split_batch(xs, ys, k):
                scaler.scale(loss_fn(model(xb), yb) / k).backward()
            if unscale_first:
                scaler.unscale_(opt)
            clip_grad_norm_(model.parameters(), 1.0)  # imported by name
            scaler.step(opt)
            scaler.update()

        return step

    def missing_k(model, loss_fn, xs, ys, k):
        for xb, yb in split_batch(xs, ys, k):
            loss_fn(model(xb), yb).backward()

    def zero_grad_inside(model, loss_fn, xs, ys, k):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for xb, yb in split_batch(xs, ys, k):
            opt.zero_grad()
            (loss_fn(model(xb), yb) / k).backward()

    def update_every_micro(model, loss_fn, xs, ys, k):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu")
        for xb, yb in split_batch(xs, ys, k):
            scaler.scale(loss_fn(model(xb), yb) / k).backward()
            scaler.update()
        scaler.step(opt)

    def step_every_micro(model, loss_fn, xs, ys, k):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for xb, yb in split_batch(xs, ys, k):
            (loss_fn(model(xb), yb) / k).backward()
            opt.step()
            opt.zero_grad()

    accumulation_steps = 4  # a constant of the training script, used for every window

    def fixed_k(model, loss_fn, xs, ys, k):
        for xb, yb in split_batch(xs, ys, k):
            (loss_fn(model(xb), yb) / accumulation_steps).backward()

    lines = load_corpus()
    vocab = make_vocab(lines)
    tx, ty = encode_batch(spread_lines(lines, 16, 50, 39, seed=1, sort=True), vocab)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        dropout_model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.3),
                                      nn.Linear(32, 10)).double()
        two_dropouts = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 32),
                                     nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 10)).double()
    return {
        "correct loop, GroupNorm": (make_cnn("group"), ce, x, y, None, None),
        "BatchNorm": (make_cnn("batch"), ce, x, y, None, None),
        "dropout, fresh masks (correct)": (dropout_model, ce, x, y, None, None),
        "clipping inside the loop": (make_cnn("group"), ce, x, y, clip_inside, 0.1),
        "RNG re-seeded per micro-batch": (dropout_model, ce, x, y, reseeding, None),
        "scheduler stepped per micro-batch": (make_cnn("group"), ce, x, y, scheduler_inside, None),
        "loss scale changed inside the window": (make_cnn("group").float(), ce, x.float(), y, scaler_update_inside,
                                                 None),
        "mean of per-micro-batch token means": (make_lm(vocab), token_cross_entropy, tx, ty, _lm_mean_loss, None),
        "two dropout layers (correct)": (two_dropouts, ce, x, y, None, None),
        "whole iteration, optimizer and LinearLR (correct)": (make_cnn("group"), ce, x, y, whole_iteration, None),
        "clip once after unscale_ (correct)": (make_cnn("group").float(), ce, x.float(), y, amp_clip(True), None),
        "missing 1/K": (make_cnn("group"), ce, x, y, missing_k, None),
        "zero_grad inside the window": (make_cnn("group"), ce, x, y, zero_grad_inside, None),
        "clip before unscale_": (make_cnn("group").float(), ce, x.float(), y, amp_clip(False), None),
        "scaler.update() after every micro-batch": (make_cnn("group").float(), ce, x.float(), y, update_every_micro,
                                                    None),
        "optimizer.step() after every micro-batch": (make_cnn("group"), ce, x, y, step_every_micro, None),
        "partial last window divided by K": (make_cnn("group"), ce, x, y, fixed_k, None),
        "BatchNorm and a missing 1/K": (make_cnn("batch"), ce, x, y, missing_k, None),
    }


def _lm_mean_loss(model, loss_fn, xs, ys, k):
    for xb, yb in split_batch(xs, ys, k):
        (loss_fn(model(xb), yb) / k).backward()


@dataclass(frozen=True)
class DemoResult:
    """One demo case: its report, what it plants, and whether the checker named exactly that."""

    name: str
    report: Report
    expected: tuple[str, ...]

    @property
    def as_expected(self) -> bool:
        if not self.expected:
            return self.report.ok
        return not self.report.ok and set(self.expected) <= set(self.report.codes)


def run_demo(k: int = 4) -> list[DemoResult]:
    """Run :func:`check` on every :func:`demo_cases` case."""
    results = []
    for name, (model, loss_fn, x, y, step, clip) in demo_cases().items():
        results.append(DemoResult(name, check(model, loss_fn, x, y, k, step=step, clip=clip), DEMO_EXPECTED[name]))
    return results
