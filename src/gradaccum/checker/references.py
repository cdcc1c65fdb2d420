r"""The references a window is compared with: the full batch's gradient and each micro-batch's alone
(:math:`h_j`), computed on a copy of the model with its randomness replayed per sample (the full batch runs first
and decides how each random op splits into samples), and how the full batch weighs the micro-batches (the loss
probe of :mod:`.probe`, read at the reference's outputs). :mod:`.run` runs the reader's step; this module, the
passes it is measured against."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from .batch import Batch, batch_size, call, logits_of, loss_of, micro_batches
from .instrument import OutsideDraws, SampleRNG, flat
from .probe import LossSource, _loss_probe, _Probe, own_loss_probe
from .run import _ForwardScope, _trainable


@dataclass
class _Refs:
    """The references: micro-batch gradients (``basis``, one row each) and the full batch's (``full``), or the
    error a micro-batch raised (``micro``: which, 1-based); the replay plans every later pass follows."""

    basis: torch.Tensor
    full: torch.Tensor
    out: torch.Tensor  # the full batch's outputs that loss_fn takes (the logits of a model output), detached
    error: BaseException | None
    micro: int
    plans: dict
    unreplayed: list[str] = field(default_factory=list)
    recomputed: list[str] = field(default_factory=list)
    # loss_fn=None: the model's loss's gradient with respect to the output it is computed from (probe.LossSource),
    # full batch then each micro-batch at the full batch's rows (None where it is not found)
    out_grads: list[torch.Tensor | None] = field(default_factory=list)
    loss_dtype: torch.dtype = torch.float64


def _loss_pass(
    work: nn.Module, loss_fn: Callable | None, x: Batch, y: torch.Tensor | None, source: LossSource | None = None
) -> tuple[torch.Tensor, torch.Tensor | None, torch.dtype]:
    """One forward and backward pass of the loss on ``x``: the outputs ``loss_fn`` takes (detached; empty when the
    model returns none), the loss's gradient with respect to the ``source`` output when one is watched (None when
    not found), and the loss's dtype."""
    out = call(work, x)
    watched = source.stop() if source is not None else None
    logits = logits_of(out)
    loss = loss_of(loss_fn, out, y)
    loss.backward()
    grad = watched.grad if watched is not None else None
    return (logits.detach() if logits is not None else torch.empty(0)), grad, loss.dtype


def _references(
    model: nn.Module, loss_fn: Callable | None, x: Batch, y: torch.Tensor | None, k: int, seed: int
) -> _Refs:
    r"""The full-batch gradient and the micro-batch gradients :math:`h_j`, randomness replayed per sample (the
    full batch runs first: it decides how each random op splits into samples, and where the model's forward
    enters each submodule, for every later pass); for the model's own loss, the probe's gradients too."""
    work = copy.deepcopy(model)
    params = _trainable(work)
    buffers = {name: b.detach().clone() for name, b in work.named_buffers()}
    live = dict(work.named_buffers())
    rng = SampleRNG(seed)
    scope = _ForwardScope(work, rng, x)
    # random draws outside the forward passes: backward recomputing a checkpointed forward with dropout
    recomputed = OutsideDraws(lambda: scope.depth > 0)
    b = batch_size(x) // k
    source = LossSource(work, batch_size(x)) if loss_fn is None else None

    def reset(j: int) -> None:
        with torch.no_grad():
            for name, value in buffers.items():
                live[name].copy_(value)
        work.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        scope.expect = j * b

    try:
        recomputed.__enter__()
        reset(0)
        out, grad, dtype, full = _full_pass(work, params, loss_fn, x, y, source)
        basis, grads = [], [grad]
        for j, (xb, yb) in enumerate(micro_batches(x, y, k)):
            reset(j)
            try:
                _loss_pass(work, loss_fn, xb, yb)
                basis.append(flat(params))
                if source is not None:
                    reset(j)
                    grads.append(source.gradient_at(work, xb, j * b, b))
            except Exception as err:
                return _Refs(torch.empty(0), torch.empty(0), torch.empty(0), err, j + 1, rng.plans)
        return _Refs(
            torch.stack(basis),
            full,
            out,
            None,
            0,
            rng.plans,
            rng.unreplayed,
            recomputed.draws,
            grads if loss_fn is None else [],
            dtype,
        )
    finally:
        recomputed.__exit__(None, None, None)
        scope.close()


def _full_pass(
    work: nn.Module,
    params: list[nn.Parameter],
    loss_fn: Callable | None,
    x: Batch,
    y: torch.Tensor | None,
    source: LossSource | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.dtype, torch.Tensor]:
    """The full batch's :func:`_loss_pass`, and its gradient (flat); a loss whose backward fails, or a gradient
    that is exactly zero, is a usage error (ValueError)."""
    try:
        out, grad, dtype = _loss_pass(work, loss_fn, x, y, source)
    except RuntimeError as err:
        what = "loss_fn(model(x), y)" if loss_fn is not None else "the model's loss (output.loss)"
        raise ValueError(
            f"{what}.backward() raised: {err}; the checker needs a loss that is differentiable "
            "with respect to the model's trainable parameters."
        ) from err
    full = flat(params)
    if not bool(full.ne(0).any()):
        raise ValueError(
            "the full batch's gradient is exactly zero (are all its targets ignore_index or padding? "
            "does the loss depend on the trainable parameters?): there is nothing to compare a "
            "window with; pass a batch with counted targets."
        )
    return out, grad, dtype, full


def _probe(
    loss_fn: Callable | None, refs: _Refs, y: torch.Tensor | None, k: int, b: int, rows: int | None = None
) -> _Probe:
    """How the full batch weighs the micro-batches (the first ``rows`` of the reference's outputs): ``loss_fn``
    read at the reference's outputs, or the model's own loss read from its passes."""
    if loss_fn is None:
        return own_loss_probe(refs.out_grads, refs.basis, refs.full, k, b, refs.loss_dtype)
    assert y is not None  # a loss_fn takes targets (checked before)
    return _loss_probe(loss_fn, refs.out if rows is None else refs.out.narrow(0, 0, rows), y, k, b)
