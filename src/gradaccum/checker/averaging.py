"""Model averages written by hand (an EMA or SWA of the parameters), seen by the operators a step runs: the
:class:`ParameterCopies` mode the call recorder enters while the step runs (``AveragedModel.update_parameters`` is
recorded by its call, in :mod:`.recorder`).

An average written by hand moves a copy of the parameters towards them in place, e.g. ``ema.lerp_(p, 1 - d)``,
``ema.mul_(d).add_(p, alpha=1 - d)``, ``torch._foreach_lerp_(ema, params, 1 - d)`` or ``ema.copy_(p)``: an in-place
operator whose first argument is neither a parameter nor a gradient and whose other arguments include a tensor
that shares a parameter's storage (the parameter, ``p.data``, ``p.detach()`` or a ``state_dict()`` value). Writes
into the parameters themselves (an update by hand), into ``.grad`` (weight decay added by hand, clipping, zeroing)
and the optimizer's own state (inside ``step()``) are not such updates. An average computed out of place
(``ema.copy_(d * ema + (1 - d) * p)``: the copy reads a new tensor, not the parameter) is not seen.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in an operator's argument: the tensor, or those in a list or tuple (the foreach operators)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            if isinstance(v, torch.Tensor):
                yield v


def _storage(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor without storage (sparse, a subclass)
        return -1


class ParameterCopies(TorchDispatchMode):
    """Calls ``seen()`` for every in-place operator that reads a parameter into a tensor that is neither a
    parameter nor a gradient (see the module's docstring), except while ``skip()`` is true (the optimizer's step,
    backward, the model's forward, the checker's own code)."""

    def __init__(self, params: list[nn.Parameter], skip: Callable[[], bool], seen: Callable[[], None]):
        super().__init__()
        self.params = params
        self.skip = skip
        self.seen = seen
        self.storages = {_storage(p) for p in params} - {0, -1}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if (
            args
            and func.overloadpacket.__name__.endswith("_")
            and not self.skip()
            and self._reads_parameter(args, kwargs)
        ):
            self.seen()
        return out

    def _reads_parameter(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        sources = [t for a in (*args[1:], *kwargs.values()) for t in _tensors(a)]
        if not any(_storage(t) in self.storages for t in sources):
            return False
        grads = {_storage(p.grad) for p in self.params if p.grad is not None}
        return not any(_storage(t) in self.storages or _storage(t) in grads for t in _tensors(args[0]))
