"""The exact full-batch-statistics scheme: every micro-batch normalized with the statistics of the whole
logical batch of K·b samples, with the full batch's gradient and running statistics, to float64 rounding.

The entry point :func:`full_batch_stats_backward` validates, then runs the uncached scheme
(:mod:`gradaccum.fullbatch_sweeps`: a statistics pass, :mod:`gradaccum.fullbatch_stats`, then forward/backward
sweeps) or the cached one (:mod:`gradaccum.fullbatch_cache`, over the torch.fx stages of
:mod:`gradaccum.fullbatch_trace`); both normalize through :mod:`gradaccum.fullbatch_norm`. Chapter 2 of the book.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from gradaccum._validate import require_flag, require_k, require_tensor
from gradaccum.accumulate import LossFn, flat_grad, split_batch
from gradaccum.fullbatch_cache import (
    CacheBytes,
    _Cached,
    _find_rng_starts,
    saved_activation_bytes,
    tensor_bytes,
)
from gradaccum.fullbatch_norm import ORDER_MESSAGE, Moments, _label, normalized_with
from gradaccum.fullbatch_stats import (
    _batch_stat_layers,
    _cuda_devices,
    _Rng,
    batchnorm_layers,
    full_batch_statistics,
    update_running_stats,
)
from gradaccum.fullbatch_sweeps import _uncached_step
from gradaccum.fullbatch_trace import _plan

__all__ = [
    "ORDER_MESSAGE",
    "CacheBytes",
    "Moments",
    "batchnorm_layers",
    "cache_bytes",
    "full_batch_forward_error",
    "full_batch_statistics",
    "full_batch_stats_as_constants_backward",
    "full_batch_stats_backward",
    "full_batch_stats_gradient",
    "normalized_with",
    "saved_activation_bytes",
    "tensor_bytes",
    "update_running_stats",
]


def cache_bytes(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, k: int) -> CacheBytes:
    """Measure :class:`CacheBytes` for one step of ``full_batch_stats_backward(..., exact=True, cache=True)`` on
    a copy of ``model`` (the model, its gradients and the generators are left as they were)."""
    work = copy.deepcopy(model)
    meter: list[int] = []
    with torch.random.fork_rng(devices=_cuda_devices(model, x)):
        _step(work, loss_fn, x, y, k, True, True, meter)
    if not meter:
        raise ValueError("the model has no batch-statistics BatchNorm layer that its forward calls: nothing is cached.")
    return CacheBytes(max(meter), saved_activation_bytes(model, loss_fn, x, y))


def _cache_device(cache: bool | str, x: torch.Tensor) -> torch.device | None:
    """Where the cache keeps its tensors (None: no cache)."""
    if isinstance(cache, bool):
        return x.device if cache else None
    if cache == "cpu":
        return torch.device("cpu")
    raise ValueError(
        f"cache must be False, True (keep the cached tensors on the model's device) or 'cpu' (keep "
        f"them in host memory), got {cache!r}."
    )


def full_batch_stats_backward(
    model: nn.Module,
    loss_fn: LossFn,
    x: torch.Tensor,
    y: torch.Tensor,
    k: int,
    exact: bool = True,
    cache: bool | str | None = None,
) -> float:
    r"""One optimizer step's *full-batch* gradient, computed in K micro-batches: every micro-batch normalized by
    the statistics of all K·b samples, and the gradient through those statistics,
    :math:`\frac1s(a - \bar a - \hat x\,\overline{a\hat x})` per BatchNorm layer, up to rounding.

    ``cache=None`` (the default): the cached scheme (one torch.fx-traced forward and one recomputing backward per
    micro-batch, keeping what :func:`cache_bytes` measures) where torch.fx can trace the model, the uncached one
    (L + 1 forward/backward sweeps for L BatchNorm layers) otherwise; ``True`` (cached tensors on the input's
    device) or ``"cpu"``: the cached scheme or a ValueError saying why not; ``False``: the uncached scheme.
    ``exact`` must stay True: the statistics as constants give another gradient
    (:func:`full_batch_stats_as_constants_backward`).

    Contract: ``model`` in training mode; ``loss_fn`` a mean over the samples that draws no random numbers; dropout
    draws plain accumulation's masks; running statistics are updated once, as by one full-batch forward; gradients
    are added to ``.grad``; returns the batch loss. ValueError, naming the layer, for what the scheme cannot
    reproduce (a BatchNorm called twice, a subclass with its own forward, ``F.batch_norm(..., training=True)``, an
    input changed in place, a forward that changes a buffer; with ``cache=True``, a forward torch.fx cannot trace
    or that has hooks it would skip), with ``.grad`` and buffers put back. Chapter 2 of the book tells why.
    """
    require_flag(exact, "exact", "True: the exact full-batch gradient")
    if not exact:
        raise ValueError(
            "exact=False (the statistics as constants) is not the full-batch gradient: it drops the "
            "terms through the mean and variance. Call full_batch_stats_as_constants_backward(...) if "
            "you want that scheme on purpose."
        )
    _require_inputs(loss_fn, x, y)
    if cache is None:
        return _cached_where_possible(model, loss_fn, x, y, k)
    return _restoring(model, lambda: _step(model, loss_fn, x, y, k, True, cache))


def full_batch_stats_as_constants_backward(
    model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, k: int, cache: bool | str = False
) -> float:
    """NOT the full-batch gradient: every micro-batch normalized by the full batch's statistics held as constants
    (gradient a/s through each BatchNorm layer; the terms through the mean and variance are missing). Chapter 2
    measures what that costs: a gradient at cosine about 0.5 to the full batch's at every K, and training that
    fails. For demonstrations; :func:`full_batch_stats_backward` is the exact scheme. Same contract otherwise."""
    _require_inputs(loss_fn, x, y)
    return _restoring(model, lambda: _step(model, loss_fn, x, y, k, False, cache))


def _require_inputs(loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor) -> None:
    require_tensor(x)
    require_tensor(y, "y")
    _require_sample_mean(loss_fn, y)


def _cached_where_possible(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, k: int) -> float:
    """The cached exact scheme; where it refuses (a model torch.fx cannot trace, hooks it would skip), the uncached
    one from the same random state, so that dropout draws the same masks; its own refusal is the one raised."""
    rng = _Rng(_cuda_devices(model, x))
    state = rng.state()
    try:
        return _restoring(model, lambda: _step(model, loss_fn, x, y, k, True, True))
    except ValueError:
        rng.load(state)
    return _restoring(model, lambda: _step(model, loss_fn, x, y, k, True, False))


def _require_sample_mean(loss_fn: LossFn, y: torch.Tensor) -> None:
    """Refuse the torch losses whose ``reduction="mean"`` is not a mean over the samples: a class-weighted mean
    (divided by the summed weights of the targets) or one with ignored targets (divided by the targets left), whose
    micro-batch means, each divided by K, do not add up to the full batch's. A functional loss is not inspected."""
    if not isinstance(loss_fn, (nn.CrossEntropyLoss, nn.NLLLoss)) or loss_fn.reduction != "mean":
        return
    name = type(loss_fn).__name__
    if loss_fn.weight is not None:
        raise ValueError(
            f"{name}(weight=...) with reduction='mean' divides by the summed weights of each "
            "micro-batch's targets, not by the number of samples: its micro-batch losses divided by K "
            f"do not add up to the full batch's. Pass a sample mean instead, e.g. "
            f"{name}(weight=w, reduction='none') averaged with .mean()."
        )
    if not y.is_floating_point() and bool((y == loss_fn.ignore_index).any()):
        raise ValueError(
            f"y contains {name}'s ignore_index ({loss_fn.ignore_index}): the mean runs over the "
            "targets left in each micro-batch, not over its samples, so the micro-batch losses divided "
            "by K do not add up to the full batch's. This scheme needs a mean over the samples (it "
            "divides each micro-batch's loss by K): drop the ignored targets from x and y, or pass a "
            "loss_fn that averages over samples."
        )


def _restoring(model: nn.Module, run: Callable[[], float]) -> float:
    """Run one step; on a refusal put every ``.grad`` and buffer back as they were (no partial window's gradient
    is left behind), and refuse a model whose forward changes a buffer of its own (a power iteration's vectors, a
    counter, an InstanceNorm's running statistics): the scheme runs the forward several times per micro-batch, so
    its later passes would see a different network from its first."""
    grads = [(p, None if p.grad is None else p.grad.clone()) for p in model.parameters()]
    buffers = [(name, b, b.clone()) for name, b in model.named_buffers()]
    own = {id(b) for layer in _batch_stat_layers(model) for b in layer.buffers()}

    def restore() -> None:
        with torch.no_grad():
            for p, g in grads:
                p.grad = g
            for _, b, saved in buffers:
                b.copy_(saved)

    try:
        total = run()
    except BaseException:
        restore()
        raise
    changed = [name for name, b, saved in buffers if id(b) not in own and not torch.equal(b, saved)]
    if changed:
        restore()
        raise ValueError(
            f"the forward changes the model's buffer(s) {changed[:3]} (a power iteration such as "
            "spectral_norm's, a counter, an InstanceNorm's running statistics): the scheme runs the "
            "forward several times per micro-batch, so later passes would see a different network; "
            "put those modules in eval mode for this step, or accumulate plainly."
        )
    return total


def _step(
    model: nn.Module,
    loss_fn: LossFn,
    x: torch.Tensor,
    y: torch.Tensor,
    k: int,
    exact: bool,
    cache: bool | str,
    meter: list[int] | None = None,
) -> float:
    require_k(k)
    device = _cache_device(cache, x)
    if not model.training:
        raise ValueError("full-batch statistics are a training-mode scheme; call model.train() first.")
    micro = split_batch(x, y, k)
    names = _batch_stat_layers(model)
    rng = _Rng(_cuda_devices(model, x))
    plan = _plan(model, names) if device is not None and names else None
    if device is not None and plan is not None and plan.cuts:  # else: no BatchNorm to cut, plain accumulation
        _find_rng_starts(model, [xb for xb, _ in micro], names, rng)
        run = _Cached(plan, micro, device, rng, exact, meter)
        run.forward()
        total = run.backward(loss_fn, k)
        update_running_stats(run.stats)
        rng.at(len(micro))
        return total
    return _uncached_step(model, loss_fn, micro, k, exact, names, rng)


def full_batch_stats_gradient(
    model: nn.Module,
    loss_fn: LossFn,
    x: torch.Tensor,
    y: torch.Tensor,
    k: int,
    exact: bool = True,
    cache: bool | str = False,
) -> torch.Tensor:
    """Flat gradient of :func:`full_batch_stats_backward` (``exact=False``:
    :func:`full_batch_stats_as_constants_backward`), computed on a copy (the model is not modified)."""
    require_flag(exact, "exact", "True: the exact scheme; False: the statistics as constants")
    work = copy.deepcopy(model)
    work.zero_grad(set_to_none=True)
    backward = full_batch_stats_backward if exact else full_batch_stats_as_constants_backward
    backward(work, loss_fn, x, y, k, cache=cache)
    return flat_grad(work).detach()


@torch.no_grad()
def full_batch_forward_error(model: nn.Module, x: torch.Tensor, k: int) -> float:
    """Largest |difference| between the full-batch train-mode forward and the two-pass scheme's micro-batch
    forwards, on a copy of ``model`` with every module's mode kept (0 up to rounding for every K).

    Refused for a model with active dropout modules: one forward over the whole batch and K over its parts draw
    different masks, so the two forwards would differ by the masks, not by the normalization.
    """
    require_k(k)
    if x.shape[0] % k:
        raise ValueError(f"a batch of {x.shape[0]} cannot be cut into K = {k} equal micro-batches.")
    if not model.training:
        raise ValueError("full-batch statistics are a training-mode scheme; call model.train() first.")
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.training and m.p > 0:
            raise ValueError(
                f"dropout layer {_label(name)} draws different masks for the whole batch and for its "
                "K parts, so the forwards cannot be compared; put it in eval mode (.eval()) for this "
                "check."
            )
    work = copy.deepcopy(model)
    reference = copy.deepcopy(work)(x)
    parts = list(x.split(x.shape[0] // k))
    stats = full_batch_statistics(work, parts)
    with normalized_with(stats):
        out = torch.cat([work(p) for p in parts])
    return float((out - reference).abs().max())
