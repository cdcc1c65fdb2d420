r"""The check inside a Hugging Face Accelerate loop: a decorator over the function that trains one batch.

::

    @check_accelerate(loss_fn)
    def train_step(accelerator, model, optimizer, scheduler, batch):
        with accelerator.accumulate(model):
            ...

The first call (or, when a batch holds fewer than K samples, the call that completes K of them) runs
:func:`gradaccum.check` on the run's first window before it trains: the window's K micro-batches go through *your*
function, called with a fresh ``Accelerator`` configured as yours (its accumulation plugin, mixed precision and
device), a copy of your model, and copies of your optimizers and schedulers (:func:`.common.rebuild`), over a
prepared ``DataLoader`` of the window (so the end of the data syncs as an epoch's end does). Arguments are recognized
by what they are: the ``Accelerator``, the model (an ``nn.Module``), the optimizers and schedulers, and the batch
(``(inputs, targets)``); any other argument is passed as it is. The partial-window check runs only when the
loader being iterated leaves a partial window (or when no prepared loader is being iterated).
``on_bug="stop"`` sets ``accelerator.set_trigger()`` (break on ``accelerator.check_trigger()``) and the decorated
function trains no more batches.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import GradientAccumulationPlugin
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gradaccum.checker import Report, check
from gradaccum.framework_probes import _own_accelerate_state

from .common import act, concat, options, rebuild, rows_needed

_SCHEDULERS = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


def _is_scheduler(v: Any) -> bool:
    return isinstance(v, _SCHEDULERS) or type(v).__name__ == "AcceleratedScheduler"


def _is_batch(v: Any) -> bool:
    return (
        isinstance(v, (tuple, list))
        and len(v) == 2
        and all(isinstance(t, torch.Tensor) and t.dim() > 0 for t in v)
        and len(v[0]) == len(v[1])
    )


@dataclass
class _Call:
    """One call of the decorated function, its arguments sorted by role."""

    bound: inspect.BoundArguments
    accelerator: str
    model: str
    batch: str
    optimizers: list[str] = field(default_factory=list)
    schedulers: list[str] = field(default_factory=list)

    def value(self, name: str) -> Any:
        return self.bound.arguments[name]


def _one(found: list[str], what: str) -> str:
    if len(found) != 1:
        raise ValueError(
            f"check_accelerate: the decorated function must take exactly one {what} as an argument, "
            f"got {len(found)} ({', '.join(found) or 'none'}); pass it as an argument of its own, so "
            "the check can hand its copy to your function."
        )
    return found[0]


def _sort(fn: Callable, args: tuple, kwargs: dict) -> _Call:
    """The call's arguments by role; a ValueError where a role is missing, doubled or hidden in a container."""
    bound = inspect.signature(fn).bind(*args, **kwargs)
    values = bound.arguments
    hidden = [
        n
        for n, v in values.items()
        if isinstance(v, (tuple, list, dict))
        and not _is_batch(v)
        and any(
            isinstance(i, torch.optim.Optimizer) or _is_scheduler(i) for i in (v.values() if isinstance(v, dict) else v)
        )
    ]
    if hidden:
        raise ValueError(
            f"check_accelerate: {', '.join(hidden)} hold(s) optimizers or schedulers; pass each as an "
            "argument of its own, so the check steps copies of them and not yours."
        )
    return _Call(
        bound,
        _one([n for n, v in values.items() if isinstance(v, Accelerator)], "Accelerator"),
        _one([n for n, v in values.items() if isinstance(v, nn.Module)], "model (an nn.Module)"),
        _one([n for n, v in values.items() if _is_batch(v)], "batch of (inputs, targets) tensors"),
        [n for n, v in values.items() if isinstance(v, torch.optim.Optimizer)],
        [n for n, v in values.items() if _is_scheduler(v)],
    )


def _window_step(fn: Callable, call: _Call) -> Callable[..., None]:
    """A ``step(model, loss_fn, x, y, k)`` that runs ``fn`` on the window's micro-batches, with a fresh
    Accelerator configured as the run's and copies of its model, optimizers and schedulers."""
    real: Accelerator = call.value(call.accelerator)
    plugin = {"num_steps": real.gradient_accumulation_steps, **real.gradient_state.plugin_kwargs}
    settings = {"mixed_precision": real.mixed_precision, "cpu": real.device.type == "cpu"}
    model = call.value(call.model)
    kind = type(call.value(call.batch))

    def step(work: nn.Module, loss_fn: Any, x: torch.Tensor, y: torch.Tensor, k: int) -> None:
        with _own_accelerate_state():
            acc = Accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin(**plugin), **settings)
            opts, scheds = rebuild(
                model, work, [call.value(n) for n in call.optimizers], [call.value(n) for n in call.schedulers]
            )
            prepared = acc.prepare(
                work, *opts, *scheds, DataLoader(TensorDataset(x, y), batch_size=len(x) // k, shuffle=False)
            )
            swap = dict(zip([call.model, *call.optimizers, *call.schedulers], prepared[:-1]))
            swap[call.accelerator] = acc
            for xb, yb in prepared[-1]:
                arguments = {**call.bound.arguments, **swap, call.batch: kind((xb, yb))}
                bound = inspect.BoundArguments(call.bound.signature, arguments)
                fn(*bound.args, **bound.kwargs)

    return step


def _partial(accelerator: Accelerator) -> bool:
    """Whether the run's epochs leave a partial window: the prepared loader being iterated holds a number of
    batches K does not divide (True when there is none to read)."""
    loader = accelerator.gradient_state.active_dataloader
    try:
        return len(loader) % accelerator.gradient_accumulation_steps != 0
    except TypeError:
        return True


def _check_window(
    fn: Callable,
    call: Any,
    real: Any,
    pending: list[tuple[torch.Tensor, torch.Tensor]],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    allow: Sequence[str],
    micro_batch_size: int | None,
    tolerance: float | None,
) -> Report | None:
    """Collect this call's batch; once the window has the rows it needs, check it and return the report (``None``
    while rows are still missing)."""
    k = real.gradient_accumulation_steps
    pending.append(call.value(call.batch))
    need = rows_needed(len(pending[0][0]), k, micro_batch_size)[1]
    if sum(len(b[0]) for b in pending) < need:
        return None
    x, y = concat([[b[0] for b in pending], [b[1] for b in pending]], need)
    pending.clear()
    return check(
        call.value(call.model),
        loss_fn,
        x,
        y,
        k,
        step=_window_step(fn, call),
        partial=_partial(real),
        allow=allow,
        tolerance=tolerance,
    )


def check_accelerate(
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    on_bug: str = "raise",
    allow: Sequence[str] = (),
    micro_batch_size: int | None = None,
    tolerance: float | None = None,
) -> Callable[[Callable], Callable]:
    """Decorate the function that trains one batch in an Accelerate loop: its first window is checked before it
    trains (see the module's docstring); ``wrapper.report`` then holds the report.

    ``loss_fn(model(x), y)``: the loss the function computes for a batch (the mean over it), the checker's
    full-batch reference. ``on_bug``, ``allow``, ``micro_batch_size``, ``tolerance``: as for
    :class:`~gradaccum.integrations.LightningCheck`."""
    if not callable(loss_fn):
        raise ValueError("check_accelerate needs loss_fn(model(x), y): the loss your function computes for a batch.")
    on_bug, allow = options(on_bug, allow, micro_batch_size, tolerance)

    def decorate(fn: Callable) -> Callable:
        pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        stopped: list[bool] = []

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if stopped:
                return None
            if wrapper.report is None:  # type: ignore[attr-defined]
                call = _sort(fn, args, kwargs)
                real = call.value(call.accelerator)
                report = _check_window(fn, call, real, pending, loss_fn, allow, micro_batch_size, tolerance)
                if report is None:
                    return fn(*args, **kwargs)  # fewer than K samples so far: no optimizer step yet either
                wrapper.report = report  # type: ignore[attr-defined]

                def stop() -> None:
                    real.set_trigger()
                    stopped.append(True)

                act(report, on_bug, stop, "check_accelerate")
                if stopped:
                    return None
            return fn(*args, **kwargs)

        wrapper.report = None  # type: ignore[attr-defined]
        return wrapper

    return decorate
