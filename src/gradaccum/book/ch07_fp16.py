r"""Chapter 7's fine print on Accelerate's fp16 path: the clip called on every micro-batch, and a step the
``GradScaler`` skips, run on the CPU.

On the CPU, ``Accelerator(mixed_precision="fp16")`` creates no ``GradScaler`` and no autocast (accelerate 1.15,
``accelerator.py``, ``Accelerator.__init__``: the fp16 branch requires ``self.device.type != "cpu"``). On a GPU
that branch sets ``native_amp = True`` and ``scaler = GradScaler(...)``. :func:`accelerate_fp16` gives a CPU
``Accelerator`` those two attributes before ``prepare()``, as its constructor does on a GPU; everything after that
is Accelerate's own code: ``prepare`` wraps the forward in fp16 autocast and the optimizer in an
``AcceleratedOptimizer`` holding the scaler, ``backward`` scales the loss, ``clip_grad_norm_`` calls
``unscale_gradients`` (``scaler.unscale_``), the prepared optimizer's ``step`` runs ``scaler.step`` and
``scaler.update`` and sets ``step_was_skipped``, and the prepared scheduler does not step when it is set.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gradaccum._validate import require_count, require_k
from gradaccum.book.ch07_windows import digits_mlp
from gradaccum.framework_probes import CountingLR, RecordingSGD, _import, _own_accelerate_state, _quiet

#: The input factor that makes a micro-batch overflow in fp16 (its first layer's outputs pass 65504).
OVERFLOW = 1e6


@dataclass
class UnguardedClip:
    """``accelerator.clip_grad_norm_`` called after every backward (no ``if accelerator.sync_gradients:``)."""

    clips: int  # clip calls that returned
    micro_batches: int  # micro-batches the loop was given
    error: str | None = None  # what the failing call raised
    failed_at: int | None = None  # at which micro-batch (1 = the first)


@dataclass
class SkippedWindows:
    """The guide's loop (clip guarded) over several windows, one of which overflows in fp16."""

    windows: int
    skipped: list[bool] = field(default_factory=list)  # optimizer.step_was_skipped after each window
    scales: list[float] = field(default_factory=list)  # the scaler's scale after each window
    optimizer_steps: int = 0  # steps that reached the optimizer
    scheduler_steps: int = 0  # steps that reached the wrapped scheduler


def _accelerator(k: int, scaler: bool) -> Any:
    """``Accelerator(gradient_accumulation_steps=k, mixed_precision="fp16")`` on the CPU; with ``scaler``, given the
    ``GradScaler`` and autocast its constructor sets up for fp16 on a GPU."""
    from accelerate import Accelerator

    acc = Accelerator(gradient_accumulation_steps=k, cpu=True, mixed_precision="fp16")
    if scaler:
        acc.native_amp = True
        acc.scaler = torch.amp.GradScaler("cpu")
    return acc


def _prepared(acc: Any, x: torch.Tensor, y: torch.Tensor, b: int, seed: int) -> tuple:
    model = digits_mlp(seed=seed)
    opt = RecordingSGD(model.parameters(), lr=0.1)
    sched = CountingLR(opt, warmup=8)
    loader = DataLoader(TensorDataset(x, y), batch_size=b, shuffle=False)
    return opt, sched, *acc.prepare(model, opt, loader, sched)


def unguarded_clip(
    x: torch.Tensor, y: torch.Tensor, k: int = 4, b: int = 8, scaler: bool = True, seed: int = 0
) -> UnguardedClip:
    """One window of ``k`` micro-batches of ``b`` digits through the guide's loop with the clip called after every
    backward; with ``scaler`` the fp16 ``GradScaler`` of a GPU, without it what Accelerate runs on the CPU (and in
    fp32 or bf16 anywhere): no scaler."""
    require_k(k)
    require_count(b, "b (the micro-batch size)")
    _import("accelerate")
    with _own_accelerate_state(), _quiet():
        acc = _accelerator(k, scaler)
        _, _, pmodel, popt, ploader, psched = _prepared(acc, x[: k * b], y[: k * b], b, seed)
        result = UnguardedClip(0, k)
        ce = nn.CrossEntropyLoss()
        for i, (xb, yb) in enumerate(ploader):
            with acc.accumulate(pmodel):
                acc.backward(ce(pmodel(xb), yb))
                try:
                    acc.clip_grad_norm_(pmodel.parameters(), 1.0)  # no `if acc.sync_gradients:`
                except RuntimeError as err:
                    result.error, result.failed_at = str(err), i + 1
                    break
                result.clips += 1
                popt.step()
                psched.step()
                popt.zero_grad()
    return result


def skipped_windows(
    x: torch.Tensor,
    y: torch.Tensor,
    k: int = 4,
    b: int = 8,
    windows: int = 3,
    overflow_window: int = 1,
    seed: int = 0,
) -> SkippedWindows:
    """``windows`` windows of the guide's loop (clip under ``sync_gradients``) with a GPU's fp16 ``GradScaler``;
    the first micro-batch of window ``overflow_window`` (0-based) has its inputs multiplied by :data:`OVERFLOW`."""
    require_k(k)
    require_count(b, "b (the micro-batch size)")
    require_count(windows, "windows")
    if not 0 <= overflow_window < windows:
        raise ValueError(f"overflow_window must be a window index in [0, {windows}), got {overflow_window!r}.")
    _import("accelerate")
    n = windows * k * b
    if n > len(x):
        raise ValueError(f"{windows} windows of {k} micro-batches of {b} need {n} samples; only {len(x)} given.")
    xs = x[:n].clone()
    first = overflow_window * k * b
    xs[first : first + b] *= OVERFLOW
    with _own_accelerate_state(), _quiet():
        acc = _accelerator(k, True)
        opt, sched, pmodel, popt, ploader, psched = _prepared(acc, xs, y[:n], b, seed)
        result = SkippedWindows(windows)
        ce = nn.CrossEntropyLoss()
        for xb, yb in ploader:
            with acc.accumulate(pmodel):
                acc.backward(ce(pmodel(xb), yb))
                if acc.sync_gradients:
                    acc.clip_grad_norm_(pmodel.parameters(), 1.0)
                popt.step()
                psched.step()
                popt.zero_grad()
                if acc.sync_gradients:
                    result.skipped.append(bool(popt.step_was_skipped))
                    result.scales.append(float(acc.scaler.get_scale()))
        result.optimizer_steps, result.scheduler_steps = len(opt.grads), sched.calls
    return result
