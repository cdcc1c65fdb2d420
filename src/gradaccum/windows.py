r"""Chapter 6: the other silent bugs — token-level loss normalization, dropout seeds, step counting,
the last partial window, and logging the loss of a window. Step counting (schedulers and Adam stepped per
micro-batch) is in :mod:`gradaccum.step_counts`, re-exported here.

**Token-level normalization.** A language-model loss is a mean over *tokens*. Micro-batch k holds
:math:`n_k` tokens with summed loss :math:`x_k`; the loss of the window is :math:`\sum_k x_k/\sum_k n_k`. Averaging
per-micro-batch means gives :math:`\frac1K\sum_k x_k/n_k`, which weighs a token of a short micro-batch more than a
token of a long one. The fix: sum the loss and divide by the number of tokens in the whole window
(Hugging Face's ``num_items_in_batch``), and across ranks by the all-reduced count, times the number of ranks
(DDP averages the ranks' gradients). The same gradient needs no count before the window: backpropagate each
micro-batch's *summed* loss as it arrives, then multiply the gradients once by p/N (:func:`scale_grads`), before
clipping.

**Dropout.** Each micro-batch draws its own masks, which are different draws from the ones a single full-batch
pass would draw; every mask entry is still Bernoulli(1 − p) and independent, so the accumulated gradient has the
full-batch gradient's *distribution* (the same expectation over masks), not its value. Re-seeding the generator
per micro-batch index repeats masks from window to window: that is the bug.

**A last partial window** of :math:`k' < K` (full) micro-batches divided by K has gradient
:math:`\frac{k'}{K}\bar g` (:math:`\bar g` the mean gradient of its samples). Plain SGD's step shrinks by the same
factor. Adam's step is its running mean of gradients (first moment, :math:`\beta_1 = 0.9`) divided by the root of
its running mean of squared gradients (second moment, :math:`\beta_2 = 0.999`). Its first step is invariant to the
gradient's scale. Later the partial gradient is one term of each: about a fifth of the first moment after 5
windows, a tenth later on, so most of the step comes from earlier, full-size gradients and it changes little,
either way: it can even come out a little longer (SGD with momentum has the same memory). Early on, the newest
squared gradient is also about 1/t of the second moment, so the smaller gradient lowers the denominator too and
cancels more of the shrink; after many windows it no longer does, and the step shrinks more (how much depends on
the model and on how long Adam has run). Without the first moment's memory (``"adam_beta1_0"``:
:math:`\beta_1 = 0`) the step shrinks to about half after 5 windows.
"""

from __future__ import annotations

import copy
import math
import numbers
from dataclasses import dataclass
from typing import Literal, cast

import torch
import torch.nn.functional as F
from torch import nn

from gradaccum._validate import (
    require_count,
    require_flag,
    require_k,
    require_micro_batch,
    require_partial,
    require_positive,
)
from gradaccum.accumulate import flat_grad, split_batch

# step counting (schedulers, Adam) lives in gradaccum.step_counts; chapter 6 reads it from here too
from gradaccum.step_counts import adam_step_count as adam_step_count
from gradaccum.step_counts import lr_trajectory as lr_trajectory
from gradaccum.step_counts import onecycle_steps_before_error as onecycle_steps_before_error
from gradaccum.step_counts import scheduler_order_warnings as scheduler_order_warnings

#: Target of padding positions, skipped by ``cross_entropy(ignore_index=IGNORE)``: -100, PyTorch's default
#: ``ignore_index`` and Hugging Face's padding label. This module's functions count and skip exactly these targets;
#: relabel other padding targets (0, say) to it first.
IGNORE = -100


def token_loss(logits: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy over the non-padding tokens (targets other than :data:`IGNORE`), mean or sum. ``logits`` are
    (..., vocabulary) with the targets' shape in front. Targets must be int64 class indices in [0, vocabulary) or
    :data:`IGNORE` (-100); anything else, a mean over no token, or another layout is refused with a ValueError —
    except where the vocabulary is as long as the sequence: then (N, vocabulary, T) has the same shape as
    (N, T, vocabulary) and cannot be told apart, so keep the vocabulary last."""
    if not isinstance(y, torch.Tensor) or y.dtype != torch.int64:
        raise ValueError(
            f"targets must be an int64 tensor of class indices (pass y.long()), got "
            f"{y.dtype if isinstance(y, torch.Tensor) else type(y).__name__}."
        )
    if not isinstance(logits, torch.Tensor) or logits.shape[:-1] != y.shape:
        got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(
            f"logits must be (..., vocabulary) with the targets' shape {tuple(y.shape)} in front, got "
            f"{got}; logits laid out (N, vocabulary, T) for F.cross_entropy: pass "
            "logits.transpose(1, 2)."
        )
    if reduction not in ("mean", "sum"):
        raise ValueError(
            f"reduction must be 'mean' or 'sum', got {reduction!r}; for per-token losses call "
            "F.cross_entropy(..., reduction='none') yourself."
        )
    counted = y[y != IGNORE]
    if reduction == "mean" and counted.numel() == 0:
        raise ValueError(
            f"every target is padding ({IGNORE}): a mean over zero tokens is NaN; leave the batch out, "
            "or use reduction='sum' (0) and divide by the window's token count."
        )
    vocab = logits.shape[-1]
    if counted.numel() and (int(counted.min()) < 0 or int(counted.max()) >= vocab):
        bad = int(counted.min()) if int(counted.min()) < 0 else int(counted.max())
        raise ValueError(
            f"target {bad} is outside the vocabulary [0, {vocab}); padding must be written as "
            f"{IGNORE} (windows.IGNORE), the index cross_entropy skips."
        )
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=IGNORE, reduction=reduction
    )


def count_tokens(y: torch.Tensor) -> int:
    """The number of non-padding targets (not :data:`IGNORE`) in integer targets."""
    if not isinstance(y, torch.Tensor) or y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
        raise ValueError(
            f"count_tokens needs integer class targets (int64, padding {IGNORE}), got "
            f"{y.dtype if isinstance(y, torch.Tensor) else type(y).__name__}."
        )
    return int((y != IGNORE).sum())


def _require_count(total_tokens: object, own: int) -> int:
    """A window's token count given by the caller: a positive integer (Python, NumPy, or a one-element integer
    tensor such as an all-reduced count), at least the ``own`` tokens of the window it is used for."""
    if (
        isinstance(total_tokens, torch.Tensor)
        and total_tokens.numel() == 1
        and not total_tokens.is_floating_point()
        and total_tokens.dtype != torch.bool
    ):
        total_tokens = int(total_tokens.item())
    if isinstance(total_tokens, bool) or not isinstance(total_tokens, numbers.Integral) or total_tokens < 1:
        raise ValueError(
            f"total_tokens must be a positive integer count of tokens, got {total_tokens!r}; pass the "
            "number of non-padding targets of the whole window (all-reduced across ranks under DDP)."
        )
    if total_tokens < own:
        raise ValueError(
            f"total_tokens = {total_tokens} is less than the {own} tokens of this window alone: pass the "
            "count of the whole window (all ranks' tokens under DDP), not of one micro-batch."
        )
    return int(total_tokens)


Normalization = Literal["mean_of_means", "window_tokens"]


def window_backward(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    k: int,
    normalization: Normalization = "window_tokens",
    total_tokens: int | None = None,
) -> float:
    """One window's backward passes for a token-level loss; gradients are added to ``.grad``.

    ``mean_of_means``: each micro-batch's mean token loss divided by K (what a generic accumulation loop does).
    ``window_tokens``: each micro-batch's *summed* token loss divided by the tokens of the whole window —
    ``total_tokens`` if given (e.g. the count all-reduced across ranks; under DDP the gradient must then also be
    multiplied by the number of ranks, which DDP's average divides out: :func:`ranks_gradient`), else counted
    here. Returns the window's loss as the chosen normalization defines it: with ``total_tokens``, this window's
    share of it (under DDP, this rank's; the ranks' shares add up to the loss).
    """
    micro = split_batch(x, y, k)
    if normalization == "window_tokens":
        own = sum(count_tokens(yb) for _, yb in micro)
        total = own if total_tokens is None else _require_count(total_tokens, own)
        if total < 1:
            raise ValueError("the window holds no tokens to average over.")
    elif normalization != "mean_of_means":
        raise ValueError(f"unknown normalization {normalization!r}; use 'mean_of_means' or 'window_tokens'.")
    elif total_tokens is not None:
        raise ValueError(
            "total_tokens is used only with normalization='window_tokens' (the mean of means divides "
            "each micro-batch by its own count); drop it, or normalize by the window's tokens."
        )
    value = 0.0
    for xb, yb in micro:
        if normalization == "mean_of_means":
            if count_tokens(yb) == 0:
                raise ValueError("a micro-batch holds only padding: its mean loss is undefined (NaN).")
            loss = token_loss(model(xb), yb) / k
        else:
            loss = token_loss(model(xb), yb, "sum") / total
        if not bool(torch.isfinite(loss)):
            raise ValueError(
                f"a micro-batch's loss is {float(loss)}: the model's output or weights hold inf or NaN "
                "(nothing to normalize)."
            )
        loss.backward()
        value += float(loss.detach())
    return value


def window_gradient(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, k: int, normalization: Normalization
) -> torch.Tensor:
    work = copy.deepcopy(model)
    work.zero_grad(set_to_none=True)
    window_backward(work, x, y, k, normalization)
    return flat_grad(work).detach()


def token_mean_gradient(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The reference: the gradient of the mean over all tokens of the batch, in one pass."""
    return window_gradient(model, x, y, 1, "window_tokens")


def ranks_gradient(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, p: int, k: int, global_count: bool
) -> torch.Tensor:
    """What DDP would apply with p ranks (equal shares of the batch), K micro-batches each, token-sum loss.

    Each rank divides by its own token count (``global_count=False``) or by the all-reduced count of all ranks,
    times p because DDP *averages* gradients over ranks (``global_count=True``). Simulated in one process.
    """
    require_count(p, "p (the number of ranks)")
    if not isinstance(global_count, bool):
        raise ValueError(
            f"global_count must be True (divide by all ranks' tokens) or False (each rank by its own), "
            f"got {global_count!r}."
        )
    if x.shape[0] % p:
        raise ValueError(
            f"a batch of {x.shape[0]} sequences cannot be shared equally by p = {p} ranks; give a "
            "multiple of p sequences."
        )
    shares = split_batch(x, y, p)
    total = sum(count_tokens(ys) for _, ys in shares)  # what an all-reduce of the counts gives every rank
    grads = []
    for xs, ys in shares:
        work = copy.deepcopy(model)
        work.zero_grad(set_to_none=True)
        if global_count:
            window_backward(work, xs, ys, k, "window_tokens", total_tokens=total)
            grads.append(flat_grad(work).detach() * p)  # × p undoes DDP's average over ranks
        else:
            window_backward(work, xs, ys, k, "window_tokens")  # divides by this rank's own count
            grads.append(flat_grad(work).detach())
    return torch.stack(grads).mean(0)  # DDP's average over ranks


def scale_grads(model: nn.Module, total_tokens: int | torch.Tensor, ranks: int = 1) -> float:
    r"""Multiply every ``.grad`` of ``model`` by :math:`p/N` (``ranks`` / ``total_tokens``), in place, and return
    the factor: the exact token normalization that needs no count before the window.

    Each micro-batch's *summed* token loss is backpropagated as it arrives (no division), so ``.grad`` holds
    :math:`\sum_i \nabla\ell_i` over the window's tokens, averaged over the ``ranks`` replicas by DDP. Once the
    window's count :math:`N` is known (all ranks' tokens, all-reduced), one multiplication by :math:`p/N` gives the
    gradient of the token mean. Call it after the window's last backward and before clipping (the threshold is
    for the mean's gradient); with a ``GradScaler``, after ``unscale_``.
    """
    p = require_count(ranks, "ranks (the number of ranks whose gradients DDP averages)")
    n = _require_count(total_tokens, 1)
    factor = p / n
    with torch.no_grad():
        for param in model.parameters():
            if param.grad is not None:
                param.grad.mul_(factor)
    return factor


def dropout_masks(
    steps: int, k: int, shape: tuple[int, ...], p: float = 0.5, reset_seed: bool = False, seed: int = 0
) -> torch.Tensor:
    """The dropout masks a loop draws: (steps, K, *shape). With ``reset_seed`` the loop calls
    ``torch.manual_seed(seed + micro_index)`` before each micro-batch, the bug this chapter shows."""
    require_k(k)
    require_count(steps, "steps", minimum=0)
    require_count(seed, "seed", minimum=0)
    require_flag(reset_seed, "reset_seed", "re-seed before every micro-batch")
    if not isinstance(shape, tuple) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in shape
    ):
        raise ValueError(f"shape must be a tuple of positive ints, one mask's shape such as (512,), got {shape!r}.")
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p < 1:
        raise ValueError(f"dropout probability must lie in (0, 1), got {p}.")
    layer = nn.Dropout(p).train()
    masks = torch.empty(steps, k, *shape)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for s in range(steps):
            for i in range(k):
                if reset_seed:
                    torch.manual_seed(seed + i)
                masks[s, i] = (layer(torch.ones(shape)) != 0).float()
    return masks


def mask_agreement(masks: torch.Tensor) -> tuple[float, float]:
    """Share of positions where a micro-batch's mask equals the one of the same micro index one step earlier,
    and the same for two different micro indices in one step (0.5 for independent masks with p = 0.5). ``masks``:
    (steps, K, ...) as :func:`dropout_masks` returns, with at least two steps and two micro-batches."""
    if not isinstance(masks, torch.Tensor):
        raise ValueError(
            f"masks must be a tensor (steps, K, ...) as dropout_masks returns, got {type(masks).__name__}."
        )
    if masks.dim() < 2 or masks.shape[0] < 2 or masks.shape[1] < 2:
        raise ValueError(
            f"masks must be (steps, K, ...) with steps >= 2 and K >= 2 to compare, got shape {tuple(masks.shape)}."
        )
    same_index = (masks[1:] == masks[:-1]).float().mean()
    other_index = (masks[:, 1:] == masks[:, :-1]).float().mean()
    return float(same_index), float(other_index)


def dropout_gradient(model: nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor, k: int, seed: int) -> torch.Tensor:
    """The gradient of one window of K micro-batches (each loss / K; K = 1 is the full batch) with the random
    generator seeded once with ``seed`` before the window, i.e. for one draw of the dropout masks. Runs on a copy;
    the caller's random state is restored."""
    work = copy.deepcopy(model)
    work.zero_grad(set_to_none=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for xb, yb in split_batch(x, y, k):
            (loss_fn(work(xb), yb) / k).backward()
    return flat_grad(work).detach()


PartialPolicy = Literal["divide_by_K", "divide_by_actual", "drop"]


def partial_window_gradient(
    model: nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor, b: int, k: int, policy: PartialPolicy
) -> torch.Tensor | None:
    """Gradient of a last window that holds only ``len(x)/b < K`` micro-batches of b.

    ``divide_by_K`` keeps the 1/K factor of full windows (Lightning's behaviour reported in #19987), so the
    gradient is k'/K of the mean; ``divide_by_actual`` divides by the k' micro-batches present (the mean over
    the samples seen); ``drop`` skips the window (returns None).
    """
    require_k(k)
    require_micro_batch(b, batch_norm=False)
    if x.shape[0] % b:
        raise ValueError(f"the partial window's {x.shape[0]} samples are not whole micro-batches of {b}.")
    present = x.shape[0] // b
    if not 1 <= present < k:
        raise ValueError(f"a partial window holds between 1 and K − 1 = {k - 1} micro-batches, got {present}.")
    if policy == "drop":
        return None
    divisor = {"divide_by_K": k, "divide_by_actual": present}.get(policy)
    if divisor is None:
        raise ValueError(f"unknown policy {policy!r}; use 'divide_by_K', 'divide_by_actual' or 'drop'.")
    work = copy.deepcopy(model)
    work.zero_grad(set_to_none=True)
    for xb, yb in split_batch(x, y, present):
        (loss_fn(work(xb), yb) / divisor).backward()
    return flat_grad(work).detach()


OptimizerName = Literal["sgd", "momentum", "adam", "adam_beta1_0"]


def _make_optimizer(name: str, params, lr: float) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    if name == "adam_beta1_0":  # Adam without the first moment's memory: the newest gradient over sqrt(v)
        return torch.optim.Adam(params, lr=lr, betas=(0.0, 0.999))
    raise ValueError(
        f"unknown optimizer {name!r}; use 'sgd', 'momentum' (SGD with momentum 0.9), 'adam' or "
        "'adam_beta1_0' (Adam with beta1 = 0)."
    )


def partial_step_ratio(
    model: nn.Module,
    loss_fn,
    x: torch.Tensor,
    y: torch.Tensor,
    b: int,
    k: int,
    present: int,
    optimizer: OptimizerName,
    lr: float,
    warm_windows: int = 0,
    seed: int = 0,
) -> float:
    r"""How much smaller the optimizer's *step* is when a last window of ``present`` < K micro-batches is divided
    by K instead of by ``present``: :math:`\lVert\Delta\theta_{/K}\rVert / \lVert\Delta\theta_{/k'}\rVert`.

    First ``warm_windows`` full windows (K micro-batches of b samples drawn at random from x, y) train a copy of
    the model; both variants of the partial window then start from that same model and optimizer state. Plain SGD
    gives exactly k'/K; SGD with momentum and Adam mix the partial gradient into running averages (Adam's first
    step is invariant to the gradient's scale). ``optimizer``: ``"sgd"``, ``"momentum"`` (0.9), ``"adam"`` (the
    defaults) or ``"adam_beta1_0"`` (Adam with :math:`\beta_1 = 0`).
    """
    require_k(k)
    require_partial(present, k)
    require_micro_batch(b, batch_norm=False)
    require_positive(lr, "the learning rate lr")
    require_count(warm_windows, "warm_windows", minimum=0)
    require_count(seed, "seed", minimum=0)
    if b * k > x.shape[0]:
        raise ValueError(f"a full window needs K·b = {k * b} samples, but only {x.shape[0]} were given.")
    work = copy.deepcopy(model)
    opt = _make_optimizer(optimizer, work.parameters(), lr)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(warm_windows):
        idx = torch.randperm(x.shape[0], generator=gen)[: b * k]
        opt.zero_grad(set_to_none=True)
        for xb, yb in split_batch(x[idx], y[idx], k):
            (loss_fn(work(xb), yb) / k).backward()
        opt.step()
    idx = torch.randperm(x.shape[0], generator=gen)[: b * present]
    norms = []
    for divisor in (k, present):
        trial = copy.deepcopy(work)
        trial_opt = _make_optimizer(optimizer, trial.parameters(), lr)
        trial_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        before = [p.detach().clone() for p in trial.parameters()]
        trial_opt.zero_grad(set_to_none=True)
        for xb, yb in split_batch(x[idx], y[idx], present):
            (loss_fn(trial(xb), yb) / divisor).backward()
        trial_opt.step()
        squared = cast(torch.Tensor, sum(((p.detach() - q) ** 2).sum() for p, q in zip(trial.parameters(), before)))
        norms.append(float(torch.sqrt(squared)))
    if not (math.isfinite(norms[0]) and math.isfinite(norms[1]) and norms[1] > 0):
        raise ValueError(
            f"the partial window's step has norm {norms[1]} (divided by k') and {norms[0]} (by K): "
            "a ratio needs a finite, nonzero step; are all its targets ignored, or the inputs NaN?"
        )
    return norms[0] / norms[1]


@dataclass(frozen=True)
class WindowLog:
    """Three ways to log a window's loss: the last micro-batch's (scaled) loss, the mean of micro-batch means,
    and the token-weighted mean (the loss the window actually optimizes with token normalization)."""

    last_micro: float
    mean_of_means: float
    token_mean: float


def window_log(model: nn.Module, x: torch.Tensor, y: torch.Tensor, k: int) -> WindowLog:
    """The three logs of one window of K micro-batches (:class:`WindowLog`). Refuses (``ValueError``), as
    :func:`window_backward` does, a micro-batch that holds only padding: its mean loss is undefined."""
    micro = split_batch(x, y, k)
    if any(count_tokens(yb) == 0 for _, yb in micro):
        raise ValueError(
            "a micro-batch holds only padding: its mean loss (and so the mean of means and the last "
            "micro-batch's loss) is undefined (NaN); put real tokens in every micro-batch."
        )
    with torch.no_grad():
        means = [float(token_loss(model(xb), yb)) for xb, yb in micro]
        sums = [float(token_loss(model(xb), yb, "sum")) for xb, yb in micro]
        tokens = [count_tokens(yb) for _, yb in micro]
    if not all(math.isfinite(v) for v in means + sums):
        raise ValueError("a micro-batch's loss is not finite: the model's output or weights hold inf or NaN.")
    return WindowLog(means[-1] / k, sum(means) / k, sum(sums) / sum(tokens))
