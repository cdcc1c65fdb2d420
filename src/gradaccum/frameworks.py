r"""Run the frameworks people train with — Hugging Face Accelerate, PyTorch Lightning, the Transformers ``Trainer`` —
and two hand-written loops in the style of well-known training scripts, on the same micro-batches, and check a
loop a framework runs.

:func:`run` takes a model, a loss ``loss_fn(output, target)`` (the mean over one micro-batch), a list of
micro-batches and the number of micro-batches per optimizer step ``K``, and returns a :class:`Run`: the gradient
each optimizer step received, the optimizer, scheduler and BatchNorm updates, the DDP all-reduces and what was
logged as the loss (:mod:`gradaccum.framework_probes` records them, :mod:`gradaccum.framework_runners` drives the
frameworks).

A correct accumulated step of K equal micro-batches is :math:`\theta \leftarrow \theta - \eta \frac1K\sum_k
\nabla L_k = \theta - \eta \nabla L_{\text{full}}` for a per-sample mean loss, and for a token loss the window's
summed token loss over the window's tokens, :math:`\sum_k S_k / \sum_k n_k` (chapter 6).

The ``step`` adapters for :func:`gradaccum.checker.check` (:func:`framework_step`, :func:`accelerate_step`,
:func:`lightning_step`, :func:`lightning_module_step`) let a reader check an Accelerate loop or a Lightning module
directly. The frameworks are imported only when a runner needs them: the rest of the package needs torch alone.
"""

from __future__ import annotations

import inspect
import math
import tempfile
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from gradaccum import _tensors
from gradaccum._validate import require_nonnegative
from gradaccum.framework_probes import (
    FRAMEWORKS,
    LABELS,
    LR,
    PRECISIONS,
    CountingLR,
    LossFn,
    MicroBatches,
    Options,
    RecordingSGD,
    Run,
    _import,
    _quiet,
    _stack,
    _world,
    bn_updates,
    flat_grads,
)
from gradaccum.framework_runners import _RUNNERS, HFWrapper, _lightning_trainer
from gradaccum.windows import IGNORE

__all__ = [
    "FRAMEWORKS",
    "IGNORE",
    "LABELS",
    "LR",
    "PRECISIONS",
    "CountingLR",
    "HFWrapper",
    "Options",
    "RecordingSGD",
    "Run",
    "accelerate_step",
    "bn_updates",
    "flat_grads",
    "framework_step",
    "lightning_module_step",
    "lightning_step",
    "run",
    "split",
]


def _validate(model: Any, micro: Any, k: Any, framework: str, precision: str) -> None:
    if framework not in FRAMEWORKS:
        raise ValueError(f"unknown framework {framework!r}; choose one of {', '.join(FRAMEWORKS)}.")
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"K (micro-batches per optimizer step) must be an int >= 1, got {k!r}.")
    if not micro:
        raise ValueError("need at least one micro-batch.")
    if not all(
        isinstance(m, (tuple, list)) and len(m) == 2 and all(isinstance(t, torch.Tensor) for t in m) for m in micro
    ):
        raise ValueError(
            "micro-batches must be (inputs, targets) pairs of tensors; frameworks.split(x, y, n) makes n equal ones."
        )
    for i, (mx, my) in enumerate(micro):
        if mx.dim() == 0 or my.dim() == 0 or len(mx) != len(my) or len(mx) == 0:
            raise ValueError(
                f"micro-batch {i} holds {mx.shape} inputs and {my.shape} targets: each needs as many "
                "targets as inputs, at least one, along dimension 0."
            )
    _stack(micro)  # equal sizes (the data loaders need them)
    _check_precision(framework, precision)


def _check_precision(framework: str, precision: Any) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}.")
    if precision == "fp16" and framework in ("nanogpt", "timm"):
        raise ValueError(f"the {framework}-style loop takes fp32 or bf16 here: fp16 needs a GradScaler on a GPU.")


def _check_options(framework: str, clip: Any, warmup: Any, cosine: Any, epochs: Any, loss_kwargs: Any, lr: Any) -> None:
    """:func:`run`'s options, checked before anything runs."""
    if clip is not None and (
        isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip > 0 or not math.isfinite(clip)
    ):
        raise ValueError(f"clip must be a positive number (a gradient-norm threshold) or None, got {clip!r}.")
    for name, value in (("warmup", warmup), ("cosine", cosine), ("epochs", epochs)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "epochs" else 0):
            raise ValueError(f"{name} must be an int >= {1 if name == 'epochs' else 0}, got {value!r}.")
    if loss_kwargs is not None and (framework != "trainer" or not isinstance(loss_kwargs, bool)):
        raise ValueError(
            f"loss_kwargs is the Transformers Trainer's model setting (True or False), got "
            f"{loss_kwargs!r} for {framework!r}: leave it None."
        )
    require_nonnegative(lr, "lr (the learning rate; 0 keeps the weights)")


def run(
    framework: str,
    model: nn.Module,
    loss_fn: LossFn,
    micro: MicroBatches,
    k: int,
    *,
    clip: float | None = None,
    precision: str = "fp32",
    sum_loss: LossFn | None = None,
    lr: float = LR,
    warmup: int = 0,
    cosine: int = 0,
    epochs: int = 1,
    loss_kwargs: bool | None = None,
) -> Run:
    """Train ``model`` in place for ``epochs`` epochs over ``micro`` (each rank's list when a process group is
    initialized), in order, with ``framework`` accumulating ``k`` micro-batches per optimizer step.

    ``clip``: clip the gradient norm to this value the way the framework's docs do it. ``precision``: ``"fp32"``,
    ``"bf16"`` or ``"fp16"``, passed to the framework's own setting (what it does with fp16 on the CPU is one of
    the measurements; the hand-written loops take fp32 and bf16). ``sum_loss``: a *summed* token loss; given, the runner
    uses the framework's token-level recipe (the window's tokens, counted across ranks) instead of ``loss_fn``, or
    raises ``ValueError`` where the framework has none. ``warmup``, ``cosine``: the scheduler's
    (:class:`CountingLR`) linear warmup and cosine decay, in its own steps. The nanoGPT-style loop has no epochs:
    it runs ``epochs · len(micro) // k`` iterations over the micro-batches in a cycle. ``loss_kwargs`` (the
    Trainer only): the model's ``accepts_loss_kwargs`` (:class:`HFWrapper`); ``True`` without ``sum_loss`` is a
    model that takes the token count and returns its mean loss anyway.
    """
    _validate(model, micro, k, framework, precision)
    _check_options(framework, clip, warmup, cosine, epochs, loss_kwargs, lr)
    if framework == "nanogpt" and cosine:
        raise ValueError(
            "the nanoGPT-style loop here writes only a linear warmup into the optimizer (no scheduler "
            "object): cosine is not supported; leave cosine=0, or use another framework."
        )
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(
            "the model has no trainable parameter (every one has requires_grad=False): there is no "
            "gradient to accumulate."
        )
    if framework == "nanogpt" and epochs * len(micro) < k:
        raise ValueError(
            f"the nanoGPT-style loop runs epochs · micro-batches // K iterations: {epochs} · "
            f"{len(micro)} // {k} is none; pass at least K micro-batches (or more epochs)."
        )
    options = Options(clip, precision, sum_loss, lr, warmup, cosine, epochs, loss_kwargs)
    runner = _RUNNERS[framework]
    _import(framework)  # before _quiet(): the loggers it silences are created on import
    before = bn_updates(model)
    with _quiet():
        out = runner(model, loss_fn, list(micro), k, options)
    out.bn_updates = bn_updates(model) - before
    out.world_size = _world()[1]
    return out


# ------------------------------------------------------------------------------ steps for gradaccum.check


def split(x: torch.Tensor, y: torch.Tensor, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``k`` equal micro-batches of ``(x, y)`` (``ValueError`` if ``k`` does not divide the batch)."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}.")
    if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)) or x.dim() == 0 or y.dim() == 0:
        raise ValueError(
            f"x and y must be tensors with the samples along dimension 0, got {type(x).__name__} and "
            f"{type(y).__name__}; convert arrays with torch.as_tensor(...)."
        )
    if len(x) != len(y):
        raise ValueError(f"x has {len(x)} samples but y has {len(y)}; pass matching inputs and targets.")
    if len(x) == 0:
        raise ValueError("the batch is empty: there is nothing to split into micro-batches.")
    if len(x) % k:
        raise ValueError(f"k = {k} does not divide the batch of {len(x)}; pick a batch that k divides.")
    return _tensors.micro_batches(x, y, k)


def _check_step_k(k: Any) -> None:
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise ValueError(
            f"k (the accumulation steps the framework is configured with) must be an int >= 1 or None "
            f"(the window's K), got {k!r}."
        )


def framework_step(framework: str, k: int | None = None, **options: Any) -> Callable[..., None]:
    """A ``step(model, loss_fn, x, y, k)`` for :func:`gradaccum.checker.check` that runs one window through
    ``framework`` (:func:`run`'s options: ``clip``, ``precision``, ``sum_loss``).

    ``k``: the accumulation steps the framework is configured with. Pass the K you train with: the checker's
    partial window (K − 1 micro-batches) then reaches the framework as the end of an epoch, and its weighting is
    tested. ``None`` configures the framework with each window's own size, so the partial window is a complete
    one to it and ``partial_window`` cannot be found. Options are checked when the step is made."""
    if framework not in FRAMEWORKS:
        raise ValueError(f"unknown framework {framework!r}; choose one of {', '.join(FRAMEWORKS)}.")
    _check_step_k(k)
    unknown = sorted(set(options) - set(Options.__dataclass_fields__))
    if unknown:
        raise ValueError(
            f"unknown option(s) {', '.join(unknown)}; run() takes {', '.join(Options.__dataclass_fields__)}."
        )
    given = {**vars(Options()), **options}  # checked now: a bad option is not the checked loop's bug
    _check_precision(framework, given["precision"])
    _check_options(
        framework, given["clip"], given["warmup"], given["cosine"], given["epochs"], given["loss_kwargs"], given["lr"]
    )

    def step(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, window: int) -> None:
        run(framework, model, loss_fn, split(x, y, window), k or window, **options)

    step.__name__ = f"{framework}_step"
    return step


def accelerate_step(k: int | None = None, **options: Any) -> Callable[..., None]:
    """Check an Accelerate loop: ``check(model, loss_fn, x, y, K, step=accelerate_step(k=K))`` runs Accelerate's
    documented accumulation loop (``Accelerator(gradient_accumulation_steps=K)``, ``accumulate()``) on the window."""
    return framework_step("accelerate", k, **options)


def lightning_step(k: int | None = None, **options: Any) -> Callable[..., None]:
    """Check a model trained by Lightning's ``Trainer(accumulate_grad_batches=K)`` (see :func:`lightning_module_step`
    for a LightningModule of your own)."""
    return framework_step("lightning", k, **options)


def lightning_module_step(k: int | None = None, **trainer_options: Any) -> Callable[..., None]:
    """Check *your* LightningModule: ``check(module, loss_fn, x, y, K, step=lightning_module_step(k=K))`` (``k``:
    as in :func:`framework_step`).

    The step fits (a copy of) ``module`` for one epoch over the window's K micro-batches with
    ``Trainer(accumulate_grad_batches=K, **trainer_options)``; the module's own ``training_step`` and
    ``configure_optimizers`` run. ``loss_fn(module(x), y)`` must be the loss ``training_step`` computes for one
    batch: the checker uses it for the full-batch reference, and ``training_step`` must call the module itself
    (``self(x)``), whose forward the checker watches for dropout. ``trainer_options`` go to ``Trainer`` (e.g.
    ``precision="bf16-mixed"``, ``gradient_clip_val=1.0``). A module with manual optimization accumulates by
    itself: pass ``accumulate_grad_batches=1``."""
    _check_step_k(k)
    import pytorch_lightning as pl

    unknown = sorted(set(trainer_options) - set(inspect.signature(pl.Trainer.__init__).parameters))
    if unknown:
        raise ValueError(
            f"pytorch_lightning.Trainer takes no {', '.join(unknown)}: pass Trainer's own keyword "
            "arguments (e.g. precision='bf16-mixed', gradient_clip_val=1.0)."
        )

    def step(module: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, window: int) -> None:

        if not isinstance(module, pl.LightningModule):
            raise ValueError(
                f"lightning_module_step needs a LightningModule, got {type(module).__name__}; use "
                "lightning_step() for a plain nn.Module."
            )
        micro = split(x, y, window)
        _import("lightning")
        with _quiet(), tempfile.TemporaryDirectory() as root:
            trainer = _lightning_trainer(k or window, None, "fp32", None, {"default_root_dir": root, **trainer_options})
            trainer.fit(module, DataLoader(_stack(micro), batch_size=len(micro[0][0]), shuffle=False))

    return step
