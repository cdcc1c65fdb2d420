"""Chapter 8, "when K changes": how SGD and Adam runs with the same samples per step compare as K and the
micro-batch trade places, with the learning-rate and momentum rules that keep them together. Re-exported by
:mod:`gradaccum.book.ch08_beyond_batchnorm`, which also draws the study's figures.

The study's worker processes (:func:`gradaccum.book.parallel.run_jobs`) import this module to run
:func:`scaling_run`, so it imports torch, the core and the digits CNN only: no figures.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from gradaccum._validate import require_k
from gradaccum.book.models import make_cnn
from gradaccum.book.parallel import run_jobs

#: The optimizers of the scaling study, with their base learning rate at batches of 16.
BASE_LR = {"SGD": 0.02, "Adam": 0.006}


@dataclass(frozen=True)
class Recipe:
    r"""One run of the scaling study: micro-batches of 16 accumulated over ``k`` (batch 16·k), the learning rate
    multiplied by ``lr_factor``, a linear warmup over ``warmup`` optimizer steps, and for Adam the
    square-root rule's :math:`\beta` and :math:`\epsilon` when ``adam_sde`` (Malladi et al. 2022: with the batch
    grown κ times, :math:`1-\beta_i \mapsto \kappa(1-\beta_i)`, :math:`\epsilon \mapsto \epsilon/\sqrt\kappa`)."""

    label: str
    k: int
    lr_factor: float
    warmup: int = 0
    adam_sde: bool = False


#: The scaling study's runs per optimizer (micro-batches of 16; K = 4 grows the effective batch to 64).
SCALING_RUNS: dict[str, tuple[Recipe, ...]] = {
    "SGD": (
        Recipe("batch 16", 1, 1.0),
        Recipe("batch 64, same rate", 4, 1.0),
        Recipe("batch 64, rate × 4, warmup", 4, 4.0, 20),
    ),
    "Adam": (
        Recipe("batch 16", 1, 1.0),
        Recipe("batch 64, same rate", 4, 1.0),
        Recipe("batch 64, rate × 2 (√4), β, ε scaled", 4, 2.0, 0, True),
        Recipe("batch 64, rate × 4", 4, 4.0),
    ),
}


def optimizer_for(name: str, params, lr: float, kappa: float = 1.0, adam_sde: bool = False) -> torch.optim.Optimizer:
    r"""SGD with momentum 0.9, or Adam (β = 0.9, 0.999, ε = 1e-8; with ``adam_sde`` the square-root rule's
    :math:`1-\beta_i \mapsto \kappa(1-\beta_i)`, :math:`\epsilon \mapsto \epsilon/\sqrt\kappa`)."""
    if name == "SGD":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if name == "Adam":
        if adam_sde and not kappa * 0.1 < 1:
            raise ValueError(
                f"the square-root rule needs 1 - β1 = κ·0.1 < 1, i.e. a batch grown less than 10 times "
                f"(κ = {kappa:g}); grow it less, or start from a larger β1."
            )
        if adam_sde:
            return torch.optim.Adam(
                params, lr=lr, betas=(1 - kappa * 0.1, 1 - kappa * 0.001), eps=1e-8 / math.sqrt(kappa)
            )
        return torch.optim.Adam(params, lr=lr)
    raise ValueError(f"optimizer must be 'SGD' or 'Adam', got {name!r}.")


def train_classifier(
    x: torch.Tensor,
    y: torch.Tensor,
    batch: int,
    k: int,
    lr: float,
    seed: int,
    schedule: str,
    epochs: int = 6,
    warmup: int = 0,
    optimizer: str = "SGD",
    norm: str = "group",
    adam_sde: bool = False,
) -> nn.Module:
    """The digits CNN (:func:`gradaccum.book.models.make_cnn`, GroupNorm by default: nothing couples the
    samples) trained on batches of ``batch`` images accumulated over ``k`` micro-batches (each micro-batch's mean
    loss divided by K); a linear warmup over ``warmup`` optimizer steps, then a constant rate or a cosine decay to
    0, counted in optimizer steps. The data order and the initial weights depend only on ``seed``."""
    require_k(k)
    if batch % k:
        raise ValueError(f"K = {k} does not divide the batch of {batch}.")
    if schedule not in ("constant", "cosine"):
        raise ValueError(f"schedule must be 'constant' or 'cosine', got {schedule!r}.")
    model, ce = make_cnn(norm, seed=seed), nn.CrossEntropyLoss()  # type: ignore[arg-type]
    opt = optimizer_for(optimizer, model.parameters(), lr, kappa=batch / 16, adam_sde=adam_sde)
    g = torch.Generator().manual_seed(seed)
    per_epoch = len(x) // batch
    total, step = epochs * per_epoch, 0
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=g)
        for i in range(per_epoch):
            idx = order[i * batch : (i + 1) * batch]
            factor = min(1.0, (step + 1) / warmup) if warmup else 1.0
            if schedule == "cosine":
                factor *= (1 + math.cos(math.pi * step / total)) / 2
            for group in opt.param_groups:
                group["lr"] = lr * factor
            opt.zero_grad()
            for xb, yb in zip(x[idx].chunk(k), y[idx].chunk(k)):
                (ce(model(xb), yb) / k).backward()
            opt.step()
            step += 1
    return model


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Accuracy of ``model`` (in eval mode) on the images ``x``."""
    model.eval()
    with torch.no_grad():
        return float((model(x).argmax(1) == y).double().mean())


def max_parameter_difference(a: nn.Module, b: nn.Module) -> float:
    with torch.no_grad():
        return max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


def scaling_run(
    x: torch.Tensor,
    y: torch.Tensor,
    x_val: torch.Tensor,
    y_val: torch.Tensor,
    optimizer: str,
    recipe: Recipe,
    seed: int,
    schedule: str,
    epochs: int = 4,
    accumulate: bool = False,
) -> float:
    """Validation accuracy of one recipe's run after ``epochs`` epochs (batches of 16·K; K micro-batches of 16
    when ``accumulate``, else one pass)."""
    return accuracy(
        train_classifier(
            x,
            y,
            16 * recipe.k,
            recipe.k if accumulate else 1,
            BASE_LR[optimizer] * recipe.lr_factor,
            seed,
            schedule,
            epochs,
            recipe.warmup,
            optimizer,
            adam_sde=recipe.adam_sde,
        ),
        x_val,
        y_val,
    )


def scaling_study(
    x: torch.Tensor,
    y: torch.Tensor,
    x_val: torch.Tensor,
    y_val: torch.Tensor,
    seeds: Sequence[int] = (0, 1, 2),
    schedules: Sequence[str] = ("constant", "cosine"),
    epochs: int = 4,
    optimizers: Sequence[str] = ("SGD", "Adam"),
    accumulate: bool = False,
    workers: int = 1,
) -> dict[tuple[str, str, int, str], float]:
    """Validation accuracy of every :data:`SCALING_RUNS` recipe after ``epochs`` epochs, keyed by
    (optimizer, label, seed, schedule). The batch of 16·K is processed as K micro-batches of 16 when
    ``accumulate``, else in one pass: the same run to rounding (GroupNorm couples no samples), K times fewer calls.
    With ``workers > 1`` the runs go to that many spawned processes (:func:`gradaccum.book.parallel.run_jobs`:
    every run seeds itself, the same results to the bit)."""
    for opt in optimizers:
        if opt not in SCALING_RUNS:
            raise ValueError(f"optimizer must be one of {list(SCALING_RUNS)}, got {opt!r}.")
    runs = [
        (opt, r, seed, schedule)
        for opt in optimizers
        for r in SCALING_RUNS[opt]
        for seed in seeds
        for schedule in schedules
    ]
    jobs = [
        dict(
            x=x,
            y=y,
            x_val=x_val,
            y_val=y_val,
            optimizer=opt,
            recipe=r,
            seed=seed,
            schedule=schedule,
            epochs=epochs,
            accumulate=accumulate,
        )
        for opt, r, seed, schedule in runs
    ]
    results = run_jobs(scaling_run, jobs, workers)
    return {(opt, r.label, seed, schedule): acc for (opt, r, seed, schedule), acc in zip(runs, results)}
