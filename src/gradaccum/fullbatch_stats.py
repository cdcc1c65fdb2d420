"""The statistics pass of the full-batch-statistics scheme: which BatchNorm layers normalize with batch statistics,
their input moments over all K micro-batches (layer by layer, in call order), the generator states that replay
dropout's masks, and the one running-statistics update of a full-batch forward. Chapter 2 of the book.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.overrides import TorchFunctionMode

from gradaccum._validate import require_tensor
from gradaccum.fullbatch_norm import ORDER_MESSAGE, Moments, _label, _Patch, _patched, _StopForward, _twice_message


def _uses_batch_stats(layer: _BatchNorm) -> bool:
    """Whether ``layer`` normalizes with batch statistics, as ``nn.BatchNorm.forward`` decides: always in
    training mode, and in eval mode only when it keeps no running statistics (``track_running_stats=False``).
    An eval-mode layer with running statistics is the constant affine map
    :math:`y = \\gamma\\,(x-\\bar\\mu)/\\sqrt{\\bar\\sigma^2+\\epsilon} + \\beta`: the scheme leaves it alone."""
    return layer.training or (layer.running_mean is None and layer.running_var is None)


def _check_supported(name: str, layer: _BatchNorm) -> None:
    """Refuse batch-statistics layers whose forward is not ``nn.BatchNorm``'s: the scheme replaces that forward."""
    if type(layer).forward is _BatchNorm.forward:
        return
    if isinstance(layer, nn.SyncBatchNorm):
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return  # outside torch.distributed, SyncBatchNorm computes exactly what nn.BatchNorm does
        raise ValueError(
            f"BatchNorm layer {_label(name)} is a SyncBatchNorm under torch.distributed: it normalizes with the "
            "statistics of all processes, and this scheme computes them on this process only. Convert it to "
            "nn.BatchNorm (per-process statistics) or accumulate as usual."
        )
    raise ValueError(
        f"BatchNorm layer {_label(name)} is a {type(layer).__name__} with its own forward, which this scheme cannot "
        "reproduce (it reimplements nn.BatchNorm1d/2d/3d only). Replace it with nn.BatchNorm, freeze it with "
        ".eval() so that it uses its running statistics, or accumulate as usual."
    )


def _batch_stat_layers(model: nn.Module) -> dict[_BatchNorm, str]:
    """Name of every BatchNorm layer of ``model`` that normalizes with batch statistics (checked supported)."""
    named = {m: n for n, m in model.named_modules() if isinstance(m, _BatchNorm)}
    if not named:
        raise ValueError("the model has no BatchNorm layer: full-batch statistics change nothing. Accumulate as usual.")
    layers = {m: n for m, n in named.items() if _uses_batch_stats(m)}
    for m, n in layers.items():
        _check_supported(n, m)
    return layers


def batchnorm_layers(model: nn.Module, x: torch.Tensor) -> list[tuple[str, _BatchNorm]]:
    """The model's BatchNorm layers in the order the forward pass calls them (found by running ``x`` in eval
    mode, without gradients; every module's mode and the random-number generators are left as they were)."""
    require_tensor(x)
    named = {m: n for n, m in model.named_modules() if isinstance(m, _BatchNorm)}
    if not named:
        raise ValueError("the model has no BatchNorm layer: full-batch statistics change nothing. Accumulate as usual.")
    order: list[tuple[str, _BatchNorm]] = []
    hooks = [m.register_forward_pre_hook(lambda mod, inp: order.append((named[mod], mod))) for m in named]
    modes = {m: m.training for m in model.modules()}
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=_cuda_devices(model, x)):
            model.eval()(x)
    finally:
        for h in hooks:
            h.remove()
        for m, mode in modes.items():
            m.training = mode
    seen = [n for n, _ in order]
    for n in seen:
        if seen.count(n) > 1:
            raise ValueError(_twice_message(n))
    return order


def _cuda_devices(model: nn.Module, x: torch.Tensor) -> list[int]:
    """Indices of the CUDA devices holding the model or the input (whose generators dropout draws from)."""
    tensors = [*model.parameters(), *model.buffers(), x]
    return sorted(
        {
            t.device.index if t.device.index is not None else torch.cuda.current_device()
            for t in tensors
            if t.device.type == "cuda"
        }
    )


class _Rng:
    """Random-number-generator states replayed per micro-batch, so that every sweep draws the same dropout masks.

    The first statistics sweep runs micro-batch 0's whole forward. If it drew no random numbers, the model is
    deterministic: every micro-batch replays the entry state (which is then a no-op). Otherwise that sweep runs
    every micro-batch's whole forward and records ``starts[i]``, the state micro-batch i starts from: the entry
    state for i = 0, the state micro-batch i−1's forward ended in for i > 0 — the states plain accumulation would
    use, so the masks are plain accumulation's. The CPU generator and those of the CUDA devices in use are
    replayed.
    """

    def __init__(self, devices: list[int]):
        self.devices = devices
        self.starts = [self._get()]
        self.random: bool | None = None  # whether a forward draws random numbers; None: not known (no replay)

    def _get(self) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        return torch.get_rng_state(), tuple(torch.cuda.get_rng_state(d) for d in self.devices)

    def at(self, i: int) -> None:
        """Set the generators to the start state of micro-batch ``i``."""
        if self.random is not None:
            self.load(self.starts[min(i, len(self.starts) - 1)])

    def state(self) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        return self._get()

    def load(self, state: tuple[torch.Tensor, tuple[torch.Tensor, ...]]) -> None:
        torch.set_rng_state(state[0])
        for d, cuda in zip(self.devices, state[1]):
            torch.cuda.set_rng_state(cuda, d)

    def ended(self, i: int) -> None:
        """Micro-batch ``i``'s whole forward has run: record the state micro-batch i+1 starts from."""
        state = self._get()
        if i == 0:
            first = self.starts[0]
            self.random = not (torch.equal(state[0], first[0]) and all(map(torch.equal, state[1], first[1])))
        if self.random:
            self.starts.append(state)


class _NoFunctionalBatchNorm(TorchFunctionMode):
    """Refuse a batch normalization with batch statistics that is not a BatchNorm module (``F.batch_norm(...,
    training=True)`` in a forward): the scheme replaces BatchNorm modules only, so it would stay per micro-batch."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if func in (F.batch_norm, torch.batch_norm, torch.native_batch_norm):
            training = kwargs.get("training", args[5] if len(args) > 5 else False)
            if training:
                raise ValueError(
                    "the forward calls a batch normalization with batch statistics that is not a "
                    "BatchNorm module (F.batch_norm(..., training=True)); the scheme replaces BatchNorm "
                    "modules only, so it would normalize per micro-batch. Use an nn.BatchNorm module."
                )
        return func(*args, **kwargs)


def _discover(model: nn.Module, micro_batches: Sequence[torch.Tensor], patch: _Patch, rng: _Rng) -> list[_BatchNorm]:
    """Sweep 1 of the statistics pass: the call order, the first layer's moments and the generator states (see
    :class:`_Rng`); a micro-batch after the first stops at the first layer unless the model draws random numbers."""
    order: list[_BatchNorm] | None = None
    patch.discover = True
    for i, xb in enumerate(micro_batches):
        mode = _NoFunctionalBatchNorm() if i == 0 else contextlib.nullcontext()
        rng.at(i)
        patch.new_forward()
        patch.stop_after_first = i > 0 and not rng.random
        try:
            with mode:
                model(xb)
        except _StopForward:
            pass
        else:
            if patch.stop_after_first:  # it should have stopped at the first layer: never reached it
                raise ValueError(ORDER_MESSAGE)
            rng.ended(i)
        if order is None:
            order = patch.order
        elif patch.order != order[: len(patch.order)] or (not patch.stop_after_first and patch.order != order):
            raise ValueError(ORDER_MESSAGE)
    patch.discover = False
    assert order is not None
    return order


def _gather_inputs(
    model: nn.Module, micro_batches: Sequence[torch.Tensor], patch: _Patch, rng: _Rng, layer: _BatchNorm
) -> None:
    """One sweep stopped at ``layer``, gathering the moments of its inputs over all micro-batches."""
    patch.target, patch.total = layer, None
    for i, xb in enumerate(micro_batches):
        rng.at(i)
        patch.new_forward()
        try:
            model(xb)
        except _StopForward:
            pass
        else:  # this micro-batch's forward never reached the layer
            raise ValueError(ORDER_MESSAGE)


def _statistics_pass(
    model: nn.Module, micro_batches: Sequence[torch.Tensor], names: dict[_BatchNorm, str], rng: _Rng
) -> dict[_BatchNorm, Moments]:
    """Full-batch input moments of every batch-statistics layer, in call order (see :func:`full_batch_statistics`)."""
    stats: dict[_BatchNorm, Moments] = {}
    if not names:
        return stats
    patch = _Patch(names, stats)
    with torch.no_grad(), _patched(patch, list(names)):
        order = _discover(model, micro_batches, patch, rng)
        for layer in order:
            if layer is not order[0]:
                _gather_inputs(model, micro_batches, patch, rng, layer)
            moments = patch.total
            if moments is None:  # pragma: no cover - the layer was reached in sweep 1
                raise RuntimeError("a BatchNorm layer was not reached")
            if moments.count < 2:
                raise ValueError(
                    f"BatchNorm layer {_label(names[layer])} sees {moments.count} value per channel in "
                    "the whole batch; batch statistics need at least 2 (nn.BatchNorm refuses this too)."
                )
            stats[layer] = moments
            patch.target, patch.total = None, None
    return stats


def full_batch_statistics(model: nn.Module, micro_batches: Sequence[torch.Tensor]) -> dict[_BatchNorm, Moments]:
    """Statistics pass: for every BatchNorm layer that normalizes with batch statistics, the moments of its input
    over *all* micro-batches, with every earlier such layer already normalizing with its full-batch statistics.

    Layer ℓ's input depends on how layers 1..ℓ−1 normalize, so the layers are handled in call order, one
    sweep over the micro-batches each, stopped at layer ℓ; the first sweep also runs micro-batch 0's whole forward,
    which finds the call order. Eval-mode layers with running statistics are constant affine maps and are left out. No
    gradients are kept and no running statistic changes. Random layers (dropout) draw the same masks in every
    sweep: micro-batch i starts each sweep from the generator state micro-batch i−1's forward ended in, which is
    where plain accumulation would start it (finding those states costs one whole forward per micro-batch in the
    first sweep, only for a model that draws random numbers); the generators are left where K plain forwards
    leave them.
    """
    if len(micro_batches) == 0:
        raise ValueError("micro_batches is empty; pass the K micro-batches of one logical batch.")
    rng = _Rng(_cuda_devices(model, micro_batches[0]))
    stats = _statistics_pass(model, micro_batches, _batch_stat_layers(model), rng)
    rng.at(len(micro_batches))
    return stats


def update_running_stats(stats: dict[_BatchNorm, Moments]) -> None:
    """One running-statistics update per layer from the full batch's mean and unbiased variance, as one
    ``nn.BatchNorm`` forward over the whole batch does: only in training mode with ``track_running_stats``;
    ``num_batches_tracked`` += 1; factor = ``momentum``, or 1/``num_batches_tracked`` when ``momentum=None``
    (cumulative average)."""
    with torch.no_grad():
        for layer, m in stats.items():
            if not (layer.training and layer.track_running_stats):
                continue
            factor = 0.0 if layer.momentum is None else layer.momentum
            if layer.num_batches_tracked is not None:
                layer.num_batches_tracked.add_(1)
                if layer.momentum is None:
                    factor = 1.0 / float(layer.num_batches_tracked)
            if layer.running_mean is not None:
                layer.running_mean.mul_(1 - factor).add_(m.mean, alpha=factor)
            if layer.running_var is not None:
                unbiased = m.var * m.count / (m.count - 1)
                layer.running_var.mul_(1 - factor).add_(unbiased, alpha=factor)
