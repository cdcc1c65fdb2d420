"""Check *your* training step: does accumulating K micro-batches compute what one full batch would?

``check(model, loss_fn, x, y, k, step=None)`` runs one full-batch backward pass and one accumulated window from
the same state — your own loop if you pass ``step`` — and reports every discrepancy with its likely cause:
BatchNorm (or other batch-coupled layers), dropout randomness, per-micro-batch mean loss with variable token
counts, clipping inside the window, the loss scaler's window, optimizer or scheduler steps inside the window,
and RNG seeds reset per micro-batch. It works on copies and restores the RNG state: your model, optimizer and
random streams are left exactly as they were.

``step(model, loss_fn, x, y, k)`` should do what your training loop does between ``optimizer.zero_grad()`` and
``optimizer.step()`` for one window of K micro-batches, leaving the gradient in ``.grad``. Command line::

    python -m gradaccum.check --demo                 # every planted bug, and a clean loop
    python -m gradaccum.check my_module:make -k 4    # make() returns (model, loss_fn, x, y) or (..., step)
"""

from __future__ import annotations

import argparse
import copy
import importlib
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .accumulate import accumulate_backward, agreement, check_k, flat_grad, split_batch

Step = Callable[[nn.Module, Callable, torch.Tensor, torch.Tensor, int], Any]


@dataclass(frozen=True)
class Finding:
    """One discrepancy: what causes it, the evidence, what to do, and the chapter that explains it."""

    cause: str
    evidence: str
    fix: str
    chapter: int
    expected: bool = False  # a difference that is correct behaviour (dropout) rather than a bug

    def __str__(self) -> str:
        tag = "note" if self.expected else "BUG?"
        return f"[{tag}] {self.cause} (chapter {self.chapter})\n       evidence: {self.evidence}\n       fix: {self.fix}"


@dataclass
class Report:
    """The result of :func:`check`."""

    k: int
    rel_error: float
    cosine: float
    tolerance: float
    findings: list[Finding] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when the accumulated step equals the full-batch step and nothing suspicious happened."""
        return self.rel_error <= self.tolerance and not [f for f in self.findings if not f.expected]

    def __str__(self) -> str:
        error = (f"below the tolerance {self.tolerance:.0e}" if self.rel_error <= self.tolerance
                 else f"{self.rel_error:.2e}, cosine {self.cosine:.4f} (tolerance {self.tolerance:.0e})")
        head = f"gradaccum.check, K = {self.k}: accumulated vs full-batch gradient: relative error {error}"
        lines = [head] + ["  warning raised by your step: " + w for w in self.warnings]
        if self.ok and not self.findings:
            return "\n".join(lines + ["  OK: accumulation computes the full-batch gradient."])
        return "\n".join(lines + ["  " + str(f) for f in self.findings])

    __repr__ = __str__


# ------------------------------------------------------------------------------------ instrumentation


@contextmanager
def _recorded(events: list[str]) -> Iterator[None]:
    """Record, in order, what a training step does: backward passes, clips, scaler calls, optimizer and
    scheduler steps, and seed resets."""
    originals = {
        "backward": torch.Tensor.backward,
        "clip_norm": torch.nn.utils.clip_grad_norm_,
        "clip_value": torch.nn.utils.clip_grad_value_,
        "update": torch.amp.GradScaler.update,
        "unscale": torch.amp.GradScaler.unscale_,
        "sched": torch.optim.lr_scheduler.LRScheduler.step,
        "seed": torch.manual_seed,
    }

    def wrap(name: str, fn: Callable) -> Callable:
        def inner(*args: Any, **kwargs: Any) -> Any:
            events.append(name)
            return fn(*args, **kwargs)

        return inner

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    hook = register_optimizer_step_pre_hook(lambda opt, args, kwargs: events.append("optimizer.step"))
    with mock.patch.object(torch.Tensor, "backward", wrap("backward", originals["backward"])), \
            mock.patch.object(torch.nn.utils, "clip_grad_norm_", wrap("clip", originals["clip_norm"])), \
            mock.patch.object(torch.nn.utils, "clip_grad_value_", wrap("clip", originals["clip_value"])), \
            mock.patch.object(torch.amp.GradScaler, "update", wrap("scaler.update", originals["update"])), \
            mock.patch.object(torch.amp.GradScaler, "unscale_", wrap("scaler.unscale_", originals["unscale"])), \
            mock.patch.object(torch.optim.lr_scheduler.LRScheduler, "step", wrap("scheduler.step", originals["sched"])), \
            mock.patch.object(torch, "manual_seed", wrap("manual_seed", originals["seed"])):
        try:
            yield
        finally:
            hook.remove()


def _modes(model: nn.Module, kinds: tuple[type, ...]) -> nn.Module:
    """A copy of ``model`` in which the modules of the given kinds are in eval mode."""
    work = copy.deepcopy(model)
    for m in work.modules():
        if isinstance(m, kinds):
            m.eval()
    return work


def _grad(model: nn.Module, loss_fn: Callable, x: torch.Tensor, y: torch.Tensor, k: int, step: Step | None,
          seed: int, events: list[str] | None = None, caught: list[str] | None = None) -> torch.Tensor:
    import warnings

    work = copy.deepcopy(model)
    work.zero_grad(set_to_none=True)
    torch.random.manual_seed(seed)  # the same random stream for every variant (dropout)
    with warnings.catch_warnings(record=True) as raised:
        warnings.simplefilter("always")
        if events is None:
            (step or accumulate_backward)(work, loss_fn, x, y, k)
        else:
            with _recorded(events):
                (step or accumulate_backward)(work, loss_fn, x, y, k)
    if caught is not None:
        caught.extend(dict.fromkeys(str(w.message).split(". ")[0] for w in raised))
    return flat_grad(work).detach()


def _token_weighted(model: nn.Module, loss_fn: nn.Module, x: torch.Tensor, y: torch.Tensor, k: int) -> torch.Tensor:
    work = copy.deepcopy(model)
    work.zero_grad(set_to_none=True)
    total = int((y != loss_fn.ignore_index).sum())
    summed = copy.copy(loss_fn)
    summed.reduction = "sum"
    for xb, yb in split_batch(x, y, k):
        out = work(xb)
        (summed(out.reshape(-1, out.shape[-1]) if out.dim() > 2 else out, yb.reshape(-1) if out.dim() > 2 else yb) / total).backward()
    return flat_grad(work).detach()


# ------------------------------------------------------------------------------------------------- check


def check(model: nn.Module, loss_fn: Callable, x: torch.Tensor, y: torch.Tensor, k: int, step: Step | None = None,
          clip: float | None = None, tolerance: float | None = None, seed: int = 0) -> Report:
    """Compare one accumulated window (``step``, or plain accumulation) with one full-batch pass; name causes.

    ``clip``: the threshold your loop clips to, if any (the full-batch reference is then clipped once, and the
    placement your loop uses is identified). ``tolerance``: relative error that counts as equal (default 1e-9 for
    float64 parameters, 1e-4 otherwise).
    """
    check_k(k)
    split_batch(x, y, k)  # batch divisible by K, matching lengths
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters to compare gradients of.")
    tol = tolerance if tolerance is not None else (1e-9 if params[0].dtype == torch.float64 else 1e-4)
    devices = [p.device.index or 0 for p in params if p.device.type == "cuda"]
    with torch.random.fork_rng(devices=sorted(set(devices))):
        _check_outputs(model, loss_fn, x, y, k)
        events: list[str] = []
        caught: list[str] = []
        user = _grad(model, loss_fn, x, y, k, step, seed, events, caught)
        full = _grad(model, loss_fn, x, y, 1, None, seed)
        if clip is not None:
            from .clipping import check_threshold, clip_vector

            full = clip_vector(full, check_threshold(clip))
        a = agreement(full, user) if full.norm() > 0 else agreement(full + 1, user + 1)
        report = Report(k, a.rel_error, a.cosine, tol, events=events, warnings=caught)
        report.findings += _event_findings(events, k)
        if a.rel_error > tol or not torch.isfinite(user).all():
            report.findings += _model_findings(model, loss_fn, x, y, k, step, clip, seed, tol, full, user,
                                               explained=bool(report.findings))
    return report


def _check_outputs(model: nn.Module, loss_fn: Callable, x: torch.Tensor, y: torch.Tensor, k: int) -> None:
    (xb, yb), *_ = split_batch(x, y, k)
    with torch.no_grad():
        out = copy.deepcopy(model)(xb)
        if not isinstance(out, torch.Tensor):
            raise ValueError(f"the model must return a tensor that loss_fn can take, got {type(out).__name__}; "
                             "wrap it so that model(x) returns the logits.")
        loss = loss_fn(out, yb)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError("loss_fn(model(x), y) must return a scalar tensor (a mean or sum over the batch).")


def _event_findings(events: list[str], k: int) -> list[Finding]:
    found = []
    backs = [i for i, e in enumerate(events) if e == "backward"]
    last = backs[-1] if backs else -1
    before_last = lambda name: [i for i, e in enumerate(events) if e == name and i < last]  # noqa: E731
    if before_last("optimizer.step"):
        found.append(Finding("optimizer.step() inside the accumulation window",
                             f"{events.count('optimizer.step')} optimizer steps in one window of {k} micro-batches",
                             "step the optimizer once, after the last micro-batch", 6))
    if events.count("scheduler.step"):
        found.append(Finding("scheduler.step() inside the accumulation window",
                             f"{events.count('scheduler.step')} scheduler steps in one window: warmup and decay run "
                             f"up to {k}× too fast", "step the scheduler once per optimizer step", 6))
    if events.count("clip") > 1 or before_last("clip"):
        found.append(Finding("gradient clipping inside the accumulation window",
                             f"{events.count('clip')} clip calls, {len(before_last('clip'))} before the last backward",
                             "clip once, after the last micro-batch (after scaler.unscale_)", 3))
    if before_last("scaler.update") or events.count("scaler.update") > 1:
        found.append(Finding("the loss scale changes inside the window",
                             f"scaler.update() called {events.count('scaler.update')}×, "
                             f"{len(before_last('scaler.update'))} before the last backward",
                             "call scaler.update() once per window, after scaler.step()", 4))
    if events.count("scaler.unscale_") > 1 or before_last("scaler.unscale_"):
        found.append(Finding("scaler.unscale_() inside the window",
                             f"unscale_ called {events.count('scaler.unscale_')}×, "
                             f"{len(before_last('scaler.unscale_'))} before the last backward",
                             "unscale_ once, after the last backward, before clipping", 4))
    if events.count("manual_seed"):
        found.append(Finding("the RNG is re-seeded inside the window",
                             f"torch.manual_seed called {events.count('manual_seed')}× in one window: dropout masks "
                             "repeat from window to window", "seed once, at the start of training", 6))
    return found


def _model_findings(model: nn.Module, loss_fn: Callable, x: torch.Tensor, y: torch.Tensor, k: int, step: Step | None,
                    clip: float | None, seed: int, tol: float, full: torch.Tensor, user: torch.Tensor,
                    explained: bool = False) -> list[Finding]:
    found = []
    grad = lambda m, kk, s=step: _grad(m, loss_fn, x, y, kk, s, seed)  # noqa: E731
    rel = lambda a, b: agreement(a, b).rel_error if a.norm() > 0 else float((a - b).norm())  # noqa: E731
    if not torch.isfinite(user).all():
        found.append(Finding("non-finite gradients after the window", "inf or NaN in the accumulated gradient",
                             "check the loss scale and skip the step on overflow (GradScaler does)", 4))
    coupled = [n for n, m in model.named_modules() if isinstance(m, _BatchNorm) and m.training]
    dropouts = [n for n, m in model.named_modules() if isinstance(m, nn.modules.dropout._DropoutNd) and m.training]
    if coupled:
        quiet = _modes(model, (_BatchNorm, nn.modules.dropout._DropoutNd))
        err = rel(grad(quiet, 1, None), grad(quiet, k))
        if err <= tol:
            found.append(Finding("BatchNorm normalizes each micro-batch with its own statistics",
                                 f"{len(coupled)} BatchNorm layer(s) in training mode ({', '.join(coupled[:3])}); with "
                                 "them in eval mode the accumulated gradient matches",
                                 "GroupNorm/LayerNorm, or larger micro-batches, PreciseBN (chapter 2)", 1))
    if dropouts:
        quiet = _modes(model, (nn.modules.dropout._DropoutNd,))
        if not coupled and rel(grad(quiet, 1, None), grad(quiet, k)) <= tol:
            found.append(Finding("dropout draws different masks in one pass and in K passes",
                                 f"{len(dropouts)} active dropout layer(s); with dropout off the gradients match",
                                 "nothing, if masks are fresh each micro-batch; compare with dropout off", 6,
                                 expected=True))
    if isinstance(loss_fn, (nn.CrossEntropyLoss, nn.NLLLoss)) and loss_fn.reduction == "mean":
        counts = [int((yb != loss_fn.ignore_index).sum()) for _, yb in split_batch(x, y, k)]
        if len(set(counts)) > 1 and rel(full, _token_weighted(model, loss_fn, x, y, k)) <= max(tol, 1e-7):
            found.append(Finding("per-micro-batch mean loss with different token counts",
                                 f"tokens per micro-batch {counts}: averaging their means weighs them unequally; "
                                 "sum / tokens of the window matches the full batch",
                                 "reduction='sum' and divide by the tokens of the whole window (num_items_in_batch)", 6))
    if clip is not None and step is not None:
        from .clipping import PLACEMENTS, combine, micro_gradients

        base = _modes(model, (_BatchNorm, nn.modules.dropout._DropoutNd))
        micro = micro_gradients(copy.deepcopy(base), loss_fn, x, y, k)
        mine = grad(base, k)
        for placement in PLACEMENTS:
            if placement != "once" and rel(combine(micro, clip, placement), mine) <= max(tol, 1e-6):  # type: ignore[arg-type]
                found.append(Finding(f"your loop clips as placement '{placement}'",
                                     "its gradient equals clipping.combine(..., placement) to rounding",
                                     "clip once, after the last micro-batch", 3))
    if step is not None and not found and not explained and rel(grad(model, k, None), user) > tol:
        found.append(Finding("your step computes something other than plain accumulation",
                             "plain accumulation of the same model gives a different gradient",
                             "compare your loop line by line with gradaccum.accumulate.accumulate_backward", 6))
    if not found and not explained:
        found.append(Finding("unexplained difference", f"relative error {rel(full, user):.2e}",
                             "look for other batch-coupled layers or state that changes between micro-batches", 6))
    return found


# ------------------------------------------------------------------------------------------- the demos


def demo_cases() -> dict[str, tuple[nn.Module, Callable, torch.Tensor, torch.Tensor, Step | None, float | None]]:
    """A correct loop and one model or loop per planted bug: name → (model, loss_fn, x, y, step, clip)."""
    from .data import load_digits_split
    from .models import make_cnn
    from .silent import encode_batch, load_corpus, make_lm, make_vocab, spread_lines

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

    lines = load_corpus()
    vocab = make_vocab(lines)
    tx, ty = encode_batch(spread_lines(lines, 16, 50, 39, seed=1, sort=True), vocab)
    dropout_model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 10)).double()
    return {
        "correct loop, GroupNorm": (make_cnn("group"), ce, x, y, None, None),
        "BatchNorm": (make_cnn("batch"), ce, x, y, None, None),
        "dropout, fresh masks (correct)": (dropout_model, ce, x, y, None, None),
        "clipping inside the loop": (make_cnn("group"), ce, x, y, clip_inside, 0.1),
        "RNG re-seeded per micro-batch": (dropout_model, ce, x, y, reseeding, None),
        "scheduler stepped per micro-batch": (make_cnn("group"), ce, x, y, scheduler_inside, None),
        "loss scale changed inside the window": (make_cnn("group").float(), ce, x.float(), y, scaler_update_inside, None),
        "mean of per-micro-batch token means": (make_lm(vocab), nn.CrossEntropyLoss(ignore_index=-100), tx, ty, _lm_mean_loss, None),
    }


def _lm_mean_loss(model, loss_fn, xs, ys, k):
    for xb, yb in split_batch(xs, ys, k):
        out = model(xb)
        (loss_fn(out.reshape(-1, out.shape[-1]), yb.reshape(-1)) / k).backward()


class _FlatLoss(nn.CrossEntropyLoss):
    """CrossEntropyLoss that accepts (N, T, V) logits and (N, T) targets (used by the token demo)."""

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return super().forward(input.reshape(-1, input.shape[-1]), target.reshape(-1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gradaccum.check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", nargs="?", help="module:function returning (model, loss_fn, x, y[, step])")
    parser.add_argument("-k", type=int, default=4, help="accumulation steps K (default 4)")
    parser.add_argument("--demo", action="store_true", help="run every planted bug and a clean loop")
    args = parser.parse_args(argv)
    if args.demo:
        bad = 0
        for name, (model, loss_fn, x, y, step, clip) in demo_cases().items():
            if name.startswith("mean of per-micro-batch"):
                loss_fn = _FlatLoss(ignore_index=-100)
            report = check(model, loss_fn, x, y, args.k, step=step, clip=clip)
            print(f"== {name}\n{report}\n")
            bad += not report.ok
        return 0
    if not args.target or ":" not in args.target:
        parser.error("give module:function (or --demo)")
    module, func = args.target.split(":", 1)
    sys.path.insert(0, ".")
    made = getattr(importlib.import_module(module), func)()
    model, loss_fn, x, y, *rest = made
    report = check(model, loss_fn, x, y, args.k, step=rest[0] if rest else None)
    print(report)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
