"""A demonstration of :func:`gradaccum.checker.check`: correct loops, and one model or loop per planted bug,
on the book's data (the digits and the tiny character model); run by ``python -m gradaccum.book.check_demo``
(exit status 0 when every verdict is as planted, 1 when one is not, 2 a usage error), chapter 6 and the "Check your
own loop" page."""

from __future__ import annotations

import argparse
import json
import sys
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


# ----------------------------------------------------------------------------------------- the planted loops
# Each is a `step(model, loss_fn, xs, ys, k)`: one window, as a reader's training script would write it.


def _clip_inside(model, loss_fn, xs, ys, k):
    for xb, yb in split_batch(xs, ys, k):
        (loss_fn(model(xb), yb) / k).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)


def _reseeding(model, loss_fn, xs, ys, k):
    for i, (xb, yb) in enumerate(split_batch(xs, ys, k)):
        torch.manual_seed(1234 + i)
        (loss_fn(model(xb), yb) / k).backward()


def _scheduler_inside() -> Step:
    """A step that steps a scheduler (of its own optimizer) after every micro-batch."""
    sched = torch.optim.lr_scheduler.StepLR(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), step_size=1)

    def step(model, loss_fn, xs, ys, k):
        for xb, yb in split_batch(xs, ys, k):
            (loss_fn(model(xb), yb) / k).backward()
            sched.step()

    return step


def _scaler_update_inside(model, loss_fn, xs, ys, k):
    scaler = torch.amp.GradScaler("cpu")
    for xb, yb in split_batch(xs, ys, k):
        scaler.scale(loss_fn(model(xb), yb) / k).backward()
        scaler.update(new_scale=2 * float(scaler.get_scale()))
    for p in model.parameters():
        p.grad /= scaler.get_scale()


def _whole_iteration(model, loss_fn, xs, ys, k):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=10)  # steps once in here
    opt.zero_grad()
    for xb, yb in split_batch(xs, ys, k):
        (loss_fn(model(xb), yb) / k).backward()
    opt.step()
    warmup.step()
    opt.zero_grad()


def _amp_clip(unscale_first: bool) -> Step:
    """The AMP window with a clip, after ``unscale_`` (right) or before it (wrong)."""

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


def _missing_k(model, loss_fn, xs, ys, k):
    for xb, yb in split_batch(xs, ys, k):
        loss_fn(model(xb), yb).backward()


def _zero_grad_inside(model, loss_fn, xs, ys, k):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for xb, yb in split_batch(xs, ys, k):
        opt.zero_grad()
        (loss_fn(model(xb), yb) / k).backward()


def _update_every_micro(model, loss_fn, xs, ys, k):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    for xb, yb in split_batch(xs, ys, k):
        scaler.scale(loss_fn(model(xb), yb) / k).backward()
        scaler.update()
    scaler.step(opt)


def _step_every_micro(model, loss_fn, xs, ys, k):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for xb, yb in split_batch(xs, ys, k):
        (loss_fn(model(xb), yb) / k).backward()
        opt.step()
        opt.zero_grad()


ACCUMULATION_STEPS = 4  # a constant of the training script, used for every window


def _fixed_k(model, loss_fn, xs, ys, k):
    for xb, yb in split_batch(xs, ys, k):
        (loss_fn(model(xb), yb) / ACCUMULATION_STEPS).backward()


def _lm_mean_loss(model, loss_fn, xs, ys, k):
    for xb, yb in split_batch(xs, ys, k):
        (loss_fn(model(xb), yb) / k).backward()


# ------------------------------------------------------------------------------------------------- the cases
Case = tuple[nn.Module, Callable, torch.Tensor, torch.Tensor, "Step | None", "float | None"]


def _dropout_models() -> tuple[nn.Module, nn.Module]:
    """An MLP with one dropout layer and one with two (float64, seed 0)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        one = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 10)).double()
        two = nn.Sequential(
            nn.Flatten(),
            nn.Linear(64, 32),
            nn.ReLU(),
            nn.Dropout(0.3),
            nn.Linear(32, 32),
            nn.ReLU(),
            nn.Dropout(0.3),
            nn.Linear(32, 10),
        ).double()
    return one, two


def demo_cases() -> dict[str, Case]:
    """Correct loops and one model or loop per planted bug: name → (model, loss_fn, x, y, step, clip), usable as
    returned: ``check(model, loss_fn, x, y, 4, step=step, clip=clip)``. :data:`DEMO_EXPECTED` says what each
    plants. Needs the book's data (scikit-learn's digits)."""
    d = load_digits_split()
    x, y = d.x_train[:32], d.y_train[:32]
    ce = nn.CrossEntropyLoss()
    lines = load_corpus()
    vocab = make_vocab(lines)
    tx, ty = encode_batch(spread_lines(lines, 16, 50, 39, seed=1, sort=True), vocab)
    dropout, two_dropouts = _dropout_models()

    def group(step: Step | None = None, clip: float | None = None) -> Case:
        return (make_cnn("group"), ce, x, y, step, clip)

    def group32(step: Step) -> Case:  # float32, for the loss scaler
        return (make_cnn("group").float(), ce, x.float(), y, step, None)

    return {
        "correct loop, GroupNorm": group(),
        "BatchNorm": (make_cnn("batch"), ce, x, y, None, None),
        "dropout, fresh masks (correct)": (dropout, ce, x, y, None, None),
        "clipping inside the loop": group(_clip_inside, 0.1),
        "RNG re-seeded per micro-batch": (dropout, ce, x, y, _reseeding, None),
        "scheduler stepped per micro-batch": group(_scheduler_inside()),
        "loss scale changed inside the window": group32(_scaler_update_inside),
        "mean of per-micro-batch token means": (make_lm(vocab), token_cross_entropy, tx, ty, _lm_mean_loss, None),
        "two dropout layers (correct)": (two_dropouts, ce, x, y, None, None),
        "whole iteration, optimizer and LinearLR (correct)": group(_whole_iteration),
        "clip once after unscale_ (correct)": group32(_amp_clip(True)),
        "missing 1/K": group(_missing_k),
        "zero_grad inside the window": group(_zero_grad_inside),
        "clip before unscale_": group32(_amp_clip(False)),
        "scaler.update() after every micro-batch": group32(_update_every_micro),
        "optimizer.step() after every micro-batch": group(_step_every_micro),
        "partial last window divided by K": group(_fixed_k),
        "BatchNorm and a missing 1/K": (make_cnn("batch"), ce, x, y, _missing_k, None),
    }


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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m gradaccum.book.check_demo",
        description="Run gradaccum.check on every planted bug and the correct loops; "
        "fails when a planted bug is missed or a correct loop is flagged.",
    )
    parser.add_argument("-k", type=int, default=4, help="accumulation steps K (default 4)")
    parser.add_argument("--json", action="store_true", help="print the reports as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    """The demo's command line; returns the exit status (0 every verdict as expected, 1 one is not, 2 usage)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.k < 1:
        parser.error(f"-k must be >= 1, got {args.k}")
    results = run_demo(args.k)
    if args.json:
        print(
            json.dumps(
                {
                    "cases": [
                        {
                            "name": r.name,
                            "expected": list(r.expected),
                            "as_expected": r.as_expected,
                            "report": r.report.to_dict(),
                        }
                        for r in results
                    ],
                    "all_as_expected": all(r.as_expected for r in results),
                },
                indent=2,
            )
        )
    else:
        for r in results:
            plant = ", ".join(r.expected) if r.expected else "nothing (a correct loop)"
            verdict = "as expected" if r.as_expected else "NOT AS EXPECTED"
            print(f"== {r.name} (plants: {plant}): {verdict}\n{r.report}\n")
        good = sum(r.as_expected for r in results)
        print(f"demo: {good} of {len(results)} verdicts as expected")
    return 0 if all(r.as_expected for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
