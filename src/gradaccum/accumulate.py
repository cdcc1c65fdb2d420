r"""Gradient accumulation itself: split a batch, accumulate, compare with the full batch, train.

The equivalence the book starts from: for a loss that is a mean of per-sample terms,

.. math::
    L(\theta; B) = \frac{1}{|B|}\sum_{i\in B} \ell(\theta; x_i, y_i),

and a batch :math:`B` of size :math:`Kb` cut into :math:`K` disjoint micro-batches :math:`B_k` of size
:math:`b`,

.. math::
    \nabla L(\theta; B) = \frac{1}{K}\sum_{k=1}^{K} \nabla L(\theta; B_k)

*provided* each :math:`\ell(\theta; x_i, y_i)` does not depend on which other samples share its batch.
BatchNorm in training mode breaks exactly that proviso (chapter 1).
"""

from __future__ import annotations

import copy
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from . import _tensors
from ._validate import require_count, require_k, require_nonnegative, require_tensor

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
#: Produces one optimizer step's gradient in ``model``'s ``.grad`` from a batch cut into K parts; returns the loss.
BackwardFn = Callable[[nn.Module, LossFn, torch.Tensor, torch.Tensor, int], float]


def split_batch(x: torch.Tensor, y: torch.Tensor, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Cut a batch into ``k`` equal, consecutive micro-batches.

    Policy: the batch size must be divisible by K. Unequal micro-batches change the weights of the samples
    in the averaged loss (chapter 6); pad, drop, or choose another K instead.
    """
    require_k(k)
    x, y = require_tensor(x, "x"), require_tensor(y, "y")
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"x has {x.shape[0]} samples but y has {y.shape[0]}; pass matching inputs and labels.")
    n = x.shape[0]
    if n == 0:
        raise ValueError("the batch is empty: there is nothing to cut into micro-batches.")
    if n % k:
        raise ValueError(
            f"a batch of {n} samples cannot be cut into K = {k} equal micro-batches; "
            f"choose K among the divisors of {n}, or a batch size that is a multiple of {k}."
        )
    return _tensors.micro_batches(x, y, k)


def flat_grad(model: nn.Module) -> torch.Tensor:
    """All parameter gradients of ``model`` concatenated into one vector (zeros where a grad is None)."""
    return _tensors.flat_grads(model.parameters())


def full_batch_gradient(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    r"""Flat gradient :math:`\nabla_\theta L(\theta; B)` of one forward/backward over the whole batch.

    Runs on a copy of ``model`` (same mode, train or eval), so the caller's parameters, gradients and
    BatchNorm running statistics are left untouched.
    """
    return accumulated_gradient(model, loss_fn, x, y, 1)


def accumulated_gradient(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, k: int) -> torch.Tensor:
    r"""Flat gradient :math:`\frac1K\sum_k \nabla_\theta L(\theta; B_k)` accumulated over K micro-batches.

    Each micro-batch loss is divided by K before its backward pass, exactly as a training loop does.
    Runs on a copy of ``model``; the caller's model is not modified.
    """
    if not isinstance(model, nn.Module) or not any(p.requires_grad for p in model.parameters()):
        raise ValueError(
            "model must be an nn.Module with trainable parameters (requires_grad=True): a frozen model "
            "has no gradient to accumulate."
        )
    work = copy.deepcopy(model)
    work.zero_grad(set_to_none=True)
    accumulate_backward(work, loss_fn, x, y, k)
    return flat_grad(work).detach()


def accumulate_backward(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, k: int) -> float:
    """The plain accumulation loop: forward and backward each micro-batch with its loss divided by K.

    Gradients are *added* to the parameters' ``.grad`` (the caller zeroes them once per optimizer step).
    Returns the loss of the whole batch (the sum of the K scaled micro-batch losses).
    """
    total = 0.0
    for xb, yb in split_batch(x, y, k):
        loss = loss_fn(model(xb), yb) / k
        loss.backward()
        total += float(loss.detach())
    return total


@dataclass(frozen=True)
class Agreement:
    """How far a gradient ``g`` is from a reference ``g_ref``.

    ``rel_error`` = ‖g − g_ref‖ / ‖g_ref‖ and ``cosine`` = ⟨g, g_ref⟩ / (‖g‖‖g_ref‖).
    """

    rel_error: float
    cosine: float


def agreement(g_ref: torch.Tensor, g: torch.Tensor) -> Agreement:
    r"""Relative error :math:`\lVert g - g_\text{ref}\rVert / \lVert g_\text{ref}\rVert` and cosine
    :math:`\langle g, g_\text{ref}\rangle / (\lVert g\rVert\,\lVert g_\text{ref}\rVert)` of ``g`` against
    ``g_ref`` (flat vectors of equal length; the cosine of a zero ``g`` is 0). Both are computed in float64 after
    dividing the two vectors by their largest entry, with no small-norm clamp: exact for tiny gradients too."""
    for name, t in (("g_ref", g_ref), ("g", g)):
        if not isinstance(t, torch.Tensor) or t.dim() != 1:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"{name} must be a flat (1-D) tensor, got {shape}; flatten it first (flat_grad(model) "
                "for a model's gradient, or t.flatten())."
            )
        if t.is_complex() or t.dtype == torch.bool:
            raise ValueError(
                f"{name} is a {t.dtype} tensor: a gradient of real parameters is real; compare "
                "float tensors (for complex parameters, torch.view_as_real(g).flatten())."
            )
        if not t.is_floating_point():
            raise ValueError(
                f"{name} is a {t.dtype} tensor: gradients are floating-point; pass the gradients "
                "themselves (flat_grad(model)), not counts or indices."
            )
        if t.is_meta:
            raise ValueError(
                f"{name} is on the meta device and holds no values; compare gradients computed on a real device."
            )
        if not bool(torch.isfinite(t).all()):
            raise ValueError(
                f"{name} holds NaN or inf entries: a relative error or cosine of it means nothing; "
                "find where the gradient overflowed first."
            )
    if g_ref.shape != g.shape:
        raise ValueError(f"gradients have different shapes {tuple(g_ref.shape)} and {tuple(g.shape)}.")
    a, b = g_ref.detach().double(), g.detach().double()
    g_nonzero = bool(b.abs().max() > 0) if b.numel() else False
    scale = float(torch.maximum(a.abs().max(), b.abs().max())) if a.numel() else 0.0
    if a.numel() == 0 or not bool(a.abs().max() > 0):
        raise ValueError("the reference gradient is zero; relative error is undefined.")
    a, b = a / scale, b / scale
    ref_norm = torch.linalg.vector_norm(a)
    if not ref_norm > 0:  # g_ref underflowed against g's scale: they differ in size by over float64's range
        raise ValueError(
            "g is more than about 1e300 times larger than g_ref: a relative error that large is not a "
            "float64 number; they are not comparable."
        )
    rel = float(torch.linalg.vector_norm(b - a) / ref_norm)
    if g_nonzero:  # the cosine of each vector scaled by its own largest entry: no underflow of the smaller one
        a, b = g_ref.detach().double(), g.detach().double()
        ua, ub = a / a.abs().max(), b / b.abs().max()
        cos = float((ua @ ub) / (torch.linalg.vector_norm(ua) * torch.linalg.vector_norm(ub)))
    else:
        cos = 0.0
    return Agreement(rel, min(1.0, max(-1.0, cos)))


# ---------------------------------------------------------------------------------------------- training


#: Learning-rate schedules :func:`train` offers.
SCHEDULES: tuple[str, ...] = ("constant", "cosine")
#: The optimizers :func:`train` can take.
OPTIMIZERS: tuple[str, ...] = ("SGD", "AdamW")


@dataclass
class TrainResult:
    """What :func:`train` measured. Accuracies are fractions in [0, 1]."""

    k: int
    micro_batch: int
    optimizer_steps: int
    val_acc: float
    val_acc_train_mode: float
    train_loss: list[float] = field(default_factory=list)

    @property
    def train_eval_gap(self) -> float:
        """Validation accuracy with micro-batch statistics (train mode) minus with running statistics."""
        return self.val_acc_train_mode - self.val_acc


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int | None = None) -> float:
    """Share of correct argmax predictions, evaluated in chunks of ``batch_size`` (all at once if None).

    The model's mode is used as it is. In train mode BatchNorm normalizes each chunk with its own
    statistics and updates its running statistics, so pass a copy if those must be kept.
    """
    n = x.shape[0]
    if n == 0:
        raise ValueError("no samples to score: x is empty.")
    size = n if batch_size is None else require_count(batch_size, "batch_size")
    if size > n:
        raise ValueError(
            f"batch_size {size} exceeds the {n} samples: no complete chunk to score; pass at most {n} "
            "(or None for all at once)."
        )
    usable = n - n % size  # an incomplete last chunk is left out, as in training
    correct = sum(int((model(x[i : i + size]).argmax(1) == y[i : i + size]).sum()) for i in range(0, usable, size))
    return correct / usable


def train(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    x_val: torch.Tensor,
    y_val: torch.Tensor,
    *,
    batch_size: int,
    k: int,
    epochs: int,
    lr: float = 0.05,
    momentum: float = 0.9,
    seed: int = 0,
    backward_fn: BackwardFn | None = None,
    schedule: str = "constant",
    optimizer: str = "SGD",
) -> TrainResult:
    r"""Train ``model`` in place with SGD (with ``momentum``), one optimizer step per batch of ``batch_size``
    samples; ``optimizer="AdamW"`` takes ``torch.optim.AdamW`` at ``lr`` with torch's defaults instead (β = (0.9,
    0.999), weight decay 0.01; ``momentum`` is then unused).

    Each batch is cut into K micro-batches of :math:`b = \text{batch\_size}/K`; every micro-batch loss
    (cross-entropy, mean over its samples) is divided by K before ``backward``, and the optimizer steps once
    per batch. The order of samples depends only on ``seed``, so runs that differ only in K see the same
    batches in the same order. The last incomplete batch of an epoch is dropped.

    ``schedule`` is the learning-rate schedule, counted in optimizer steps: ``"constant"`` keeps ``lr``;
    ``"cosine"`` decays it as :math:`\eta_t = \tfrac{\eta}{2}\big(1 + \cos(\pi t / T)\big)` over the
    :math:`T` optimizer steps of the run (``torch.optim.lr_scheduler.CosineAnnealingLR``, stepped once per
    optimizer step, never per micro-batch).

    ``backward_fn`` replaces the plain accumulation loop (:func:`accumulate_backward`) by another way of
    producing the step's gradient from the batch and K (chapter 2's full-batch statistics, for example).

    Validation accuracy is reported twice: in eval mode (running statistics, what a deployed model does) and
    in train mode on micro-batches of size b (what the network computed while it was trained).
    """
    _check_train(
        x,
        batch_size=batch_size,
        k=k,
        epochs=epochs,
        lr=lr,
        momentum=momentum,
        seed=seed,
        schedule=schedule,
        optimizer=optimizer,
    )
    n, b = x.shape[0], batch_size // k
    backward = backward_fn or accumulate_backward
    loss_fn = nn.CrossEntropyLoss()
    opt, sched = _optimizer(model, optimizer, lr, momentum, schedule, epochs * (n // batch_size))
    steps, losses = _run_epochs(model, x, y, backward, loss_fn, opt, sched, batch_size, k, epochs, seed)
    train_mode_acc = accuracy(copy.deepcopy(model).train(), x_val, y_val, batch_size=b)
    model.eval()
    return TrainResult(k, b, steps, accuracy(model, x_val, y_val), train_mode_acc, losses)


def _run_epochs(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    backward: BackwardFn,
    loss_fn: LossFn,
    opt: torch.optim.Optimizer,
    sched: torch.optim.lr_scheduler.LRScheduler | None,
    batch_size: int,
    k: int,
    epochs: int,
    seed: int,
) -> tuple[int, list[float]]:
    """:func:`train`'s loop, the model in train mode: each epoch a permutation drawn from ``seed``'s generator, one
    optimizer (and scheduler) step per complete batch, the gradient from ``backward``. Returns the optimizer steps
    taken and each step's loss."""
    gen = torch.Generator().manual_seed(seed)
    n, steps, losses = x.shape[0], 0, []
    model.train()
    for _ in range(epochs):
        order = torch.randperm(n, generator=gen).to(x.device)
        for start in range(0, n - batch_size + 1, batch_size):
            idx = order[start : start + batch_size]
            opt.zero_grad(set_to_none=True)
            losses.append(backward(model, loss_fn, x[idx], y[idx], k))
            opt.step()
            if sched is not None:
                sched.step()
            steps += 1
    return steps, losses


def _check_train(
    x: torch.Tensor,
    *,
    batch_size: int,
    k: int,
    epochs: int,
    lr: float,
    momentum: float,
    seed: int,
    schedule: str,
    optimizer: str,
) -> None:
    """:func:`train`'s arguments, refused with a ValueError that says what to pass."""
    require_k(k)
    require_count(batch_size, "batch_size")
    require_count(epochs, "epochs (whole passes over the data)")
    require_count(seed, "seed", 0)
    require_nonnegative(lr, "lr (the learning rate)")
    if isinstance(momentum, bool) or not isinstance(momentum, numbers.Real) or not 0.0 <= momentum < 1.0:
        raise ValueError(
            f"momentum (SGD's) must be a number in [0, 1), got {momentum!r}; 0.9 is the usual value, 0 is plain SGD."
        )
    if batch_size % k:
        raise ValueError(f"batch_size ({batch_size}) must be a positive multiple of K ({k}).")
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {SCHEDULES}.")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose one of {OPTIMIZERS}.")
    if batch_size > x.shape[0]:
        raise ValueError(f"batch_size ({batch_size}) exceeds the {x.shape[0]} training samples.")


def _optimizer(
    model: nn.Module, optimizer: str, lr: float, momentum: float, schedule: str, total_steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler | None]:
    """:func:`train`'s optimizer and its learning-rate schedule (None: constant)."""
    opt: torch.optim.Optimizer = (
        torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
        if optimizer == "SGD"
        else torch.optim.AdamW(model.parameters(), lr=lr)
    )
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, total_steps) if schedule == "cosine" else None
    return opt, sched
