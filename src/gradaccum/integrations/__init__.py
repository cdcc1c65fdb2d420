"""The check where people train: :func:`gradaccum.check` run at the start of a real training run, on the run's own
first window (its data, model, loss, optimizer, scheduler and accumulation settings), in the framework that runs it.

* :class:`LightningCheck` — a PyTorch Lightning ``Callback``:
  ``Trainer(accumulate_grad_batches=K, callbacks=[LightningCheck(loss_fn)])``.
* :class:`TrainerCheck` — a Transformers ``TrainerCallback``: ``Trainer(..., callbacks=[TrainerCheck()])``.
* :func:`check_accelerate` — a decorator over the function that trains one batch under ``accelerator.accumulate``.

Each cuts one training micro-batch into K micro-batches, so the checked window fits where one training
micro-batch fits, logs the report (logger ``gradaccum.integrations``) and, on a bug, raises
:class:`AccumulationBug`, stops the run the framework's way, or warns (``on_bug="raise" | "stop" | "warn"``).
A framework is imported only when its integration is first used: ``import gradaccum.integrations`` needs torch
alone.
"""

from __future__ import annotations

import importlib
from typing import Any

from .common import ON_BUG, AccumulationBug, AccumulationWarning

#: Where each integration lives (imported on first use: each imports its framework).
_LAZY = {"LightningCheck": "lightning", "TrainerCheck": "trainer", "check_accelerate": "accelerate"}

__all__ = ["ON_BUG", "AccumulationBug", "AccumulationWarning", "LightningCheck", "TrainerCheck", "check_accelerate"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
