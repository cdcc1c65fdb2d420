r"""The check inside PyTorch Lightning: a ``Callback`` that checks the run's own accumulation before its first batch.

``Trainer(accumulate_grad_batches=K, callbacks=[LightningCheck(loss_fn)])``: when training starts, the callback
takes the run's first batch, cuts it into K micro-batches (:mod:`gradaccum.integrations.common`), and runs
:func:`gradaccum.check` on it with :func:`gradaccum.frameworks.lightning_module_step`: a copy of the module is fit
by a Trainer configured as the run's (``accumulate_grad_batches``, ``gradient_clip_val`` and its algorithm,
``precision``, the device), so the module's own ``training_step``, ``configure_optimizers`` and hooks run. The
partial-window check runs only when the run's epochs leave a partial window (``num_training_batches`` not a
multiple of K). ``on_bug="stop"`` sets ``trainer.should_stop`` (Lightning then runs no batch, unless
``min_epochs`` or ``min_steps`` hold it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import pytorch_lightning as pl
import torch

from gradaccum.checker import Report, check
from gradaccum.frameworks import lightning_module_step

from .common import act, concat, first_batches, options


def _pair(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if (
        isinstance(batch, (tuple, list))
        and len(batch) == 2
        and all(isinstance(t, torch.Tensor) and t.dim() > 0 for t in batch)
    ):
        return batch[0], batch[1]
    raise ValueError(
        f"LightningCheck reads (inputs, targets) batches of two tensors, got {type(batch).__name__}; "
        "check a module whose training_step takes x, y = batch."
    )


def _inner_trainer(trainer: Any, module: Any) -> dict[str, Any]:
    """The run's settings the checked window is fit with (the rest are the checker's: one epoch, no logger)."""
    device = module.device
    algorithm = trainer.gradient_clip_algorithm
    return {
        "gradient_clip_val": trainer.gradient_clip_val,
        "gradient_clip_algorithm": getattr(algorithm, "value", algorithm),
        "precision": trainer.precision,
        "strategy": "auto",
        "accelerator": "gpu" if device.type == "cuda" else "cpu",
        "devices": [device.index or 0] if device.type == "cuda" else 1,
    }


class LightningCheck(pl.Callback):
    """Check the run's gradient accumulation when training starts, on its own first batch.

    ``loss_fn(module(x), y)``: the loss ``training_step`` computes for a batch ``(x, y)`` (the mean over it), which
    the checker takes as the full-batch reference; ``training_step`` must call the module itself (``self(x)``).
    ``on_bug``: ``"raise"`` (:class:`~gradaccum.integrations.common.AccumulationBug`), ``"stop"``
    (``trainer.should_stop``) or ``"warn"``. ``allow``: finding codes you accept. ``micro_batch_size``: samples
    per checked micro-batch (default: the first batch's size // K; at least 2 for BatchNorm). ``tolerance``: as in
    :func:`gradaccum.check` (raise it for mixed precision). After the check, ``report`` holds its report.
    """

    def __init__(
        self,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        *,
        on_bug: str = "raise",
        allow: Sequence[str] = (),
        micro_batch_size: int | None = None,
        tolerance: float | None = None,
    ):
        if not callable(loss_fn):
            raise ValueError(
                "LightningCheck needs loss_fn(module(x), y): the loss training_step computes for a "
                "batch, e.g. torch.nn.functional.cross_entropy."
            )
        self.loss_fn = loss_fn
        self.on_bug, self.allow = options(on_bug, allow, micro_batch_size, tolerance)
        self.micro_batch_size, self.tolerance = micro_batch_size, tolerance
        self.report: Report | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        k = int(trainer.accumulate_grad_batches)
        loader = trainer.train_dataloader
        if not isinstance(loader, torch.utils.data.DataLoader):
            raise ValueError(f"LightningCheck reads one training DataLoader, got {type(loader).__name__}.")
        batches, n = first_batches(loader, lambda b: len(_pair(b)[0]), k, self.micro_batch_size)
        pairs = [_pair(trainer.strategy.batch_to_device(b)) for b in batches]
        x, y = concat([[p[0] for p in pairs], [p[1] for p in pairs]], n)
        total = trainer.num_training_batches
        self.report = check(
            pl_module,
            self.loss_fn,
            x,
            y,
            k,
            step=lightning_module_step(k=k, **_inner_trainer(trainer, pl_module)),
            partial=not (math.isfinite(total) and int(total) % k == 0),
            allow=self.allow,
            tolerance=self.tolerance,
        )
        act(self.report, self.on_bug, lambda: setattr(trainer, "should_stop", True), "LightningCheck")
