r"""What the framework runners (:mod:`gradaccum.framework_runners`) record, and the plumbing they share.

* :class:`RecordingSGD` records the gradient each optimizer step receives *after* a closure has run (a framework
  that does its last backward inside ``optimizer.step(closure)`` — Lightning — is measured correctly), the learning
  rate it used and the parameters after it; :class:`CountingLR` counts the ``step()`` calls that reach the
  scheduler (not the ones a wrapper swallows); :class:`Run` holds what one run did.
* Every runner uses SGD with learning rate ``LR`` and no momentum, so each step's recorded gradient is all it used.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import io
import logging
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

from gradaccum import _tensors
from gradaccum.distributed import CommCounter, register_counter

#: The frameworks measured, in the order of the chapter's table.
FRAMEWORKS = ("accelerate", "lightning", "trainer", "nanogpt", "timm")
#: How the chapter names them.
LABELS = {
    "accelerate": "Accelerate",
    "lightning": "Lightning",
    "trainer": "Transformers Trainer",
    "nanogpt": "nanoGPT-style loop",
    "timm": "timm-style loop",
}
#: Learning rate of the runners' SGD (no momentum, no weight decay).
LR = 0.1
PRECISIONS = ("fp32", "bf16", "fp16")

MicroBatches = Sequence[tuple[torch.Tensor, torch.Tensor]]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def flat_grads(params: Sequence[nn.Parameter]) -> torch.Tensor:
    """All gradients as one float64 vector on the CPU (zeros where a parameter has none): the checker's own
    reading."""
    return _tensors.flat_grads(params, float64=True)


class RecordingSGD(torch.optim.SGD):
    """Plain SGD that records the gradient each step receives (after the closure, if one is given)."""

    def __init__(self, params: Any, lr: float = LR):
        super().__init__(params, lr=lr)
        self.grads: list[torch.Tensor] = []
        self.lrs: list[float] = []  # the learning rate each step used
        self.params: list[torch.Tensor] = []  # the parameters after each step (float64, flattened)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.grads.append(flat_grads([p for g in self.param_groups for p in g["params"]]))
        self.lrs.append(float(self.param_groups[0]["lr"]))
        super().step()
        self.params.append(torch.cat([p.detach().reshape(-1).double() for g in self.param_groups for p in g["params"]]))
        return loss


class CountingLR(torch.optim.lr_scheduler.LambdaLR):
    """A learning-rate schedule that counts the ``step()`` calls reaching it (not the one its constructor makes).

    The factor after ``s`` steps: ``min(1, (s + 1) / warmup)`` (1 when ``warmup`` is 0), times
    ``(1 + cos(π · min(s, cosine) / cosine)) / 2`` when ``cosine`` > 0 (a cosine decay to 0 over ``cosine`` steps)."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup: int = 0, cosine: int = 0):
        self.calls = -1

        def factor(s: int) -> float:
            f = min(1.0, (s + 1) / warmup) if warmup else 1.0
            return f * (1 + math.cos(math.pi * min(s, cosine) / cosine)) / 2 if cosine else f

        super().__init__(optimizer, factor)
        self.calls = 0

    def step(self, epoch: Any = None) -> None:
        self.calls += 1
        super().step()


def bn_updates(model: nn.Module) -> int:
    """Running-statistics updates so far of the model's first BatchNorm layer (0 when it has none)."""
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.num_batches_tracked is not None:
            return int(m.num_batches_tracked)
    return 0


@dataclass
class Run:
    """What one framework run did. ``grads[i]`` is the gradient optimizer step ``i`` received."""

    framework: str
    k: int
    micro_batches: int
    grads: list[torch.Tensor] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    params: list[torch.Tensor] = field(default_factory=list)  # after each optimizer step
    optimizer_steps: int = 0
    scheduler_steps: int = 0
    bn_updates: int = 0
    allreduces: int = 0
    logged: list[float] = field(default_factory=list)
    world_size: int = 1


@dataclass(frozen=True)
class Options:
    """How :func:`run` trains: see its docstring."""

    clip: float | None = None
    precision: str = "fp32"
    sum_loss: LossFn | None = None
    lr: float = LR
    warmup: int = 0
    cosine: int = 0
    epochs: int = 1
    loss_kwargs: bool | None = None


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _stack(micro: MicroBatches) -> TensorDataset:
    sizes = {len(x) for x, _ in micro}
    if len(sizes) != 1:
        raise ValueError(
            f"the runners need micro-batches of one size, got sizes {sorted(sizes)}; split the data "
            "into equal micro-batches (the last partial *window* may hold fewer of them)."
        )
    return TensorDataset(torch.cat([x for x, _ in micro]), torch.cat([y for _, y in micro]))


def _import(framework: str) -> None:
    modules = {"accelerate": "accelerate", "lightning": "pytorch_lightning", "trainer": "transformers"}
    if framework in modules:
        importlib.import_module(modules[framework])


_NOISY = ("lightning", "pytorch_lightning", "lightning_fabric", "transformers", "accelerate")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The frameworks' informational messages (device hints, tips, per-step logs) and warnings stay off the page;
    errors still raise."""
    # a logger without a level of its own takes its nearest ancestor's, and each ancestor below a framework's top
    # logger that has a level is set here too: setting only those is enough (and setLevel clears the cache of
    # every logger, so calling it for each of the frameworks' hundreds of loggers cost 0.05 s a run)
    loggers = [logging.getLogger(n) for n in _NOISY]
    loggers += [
        lg
        for n, lg in list(logging.root.manager.loggerDict.items())
        if n.split(".")[0] in _NOISY
        and isinstance(lg, logging.Logger)
        and lg.level != logging.NOTSET
        and lg not in loggers
    ]
    levels = [(lg, lg.level) for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in levels:
            lg.setLevel(level)


@contextlib.contextmanager
def _young_gc_only() -> Iterator[None]:
    """While the block runs, garbage collection leaves out the objects made before it (``gc.freeze``). The
    Trainer's ``train()`` starts with ``accelerator.free_memory()``, a full ``gc.collect()``: in a process that
    holds transformers that walks every object (about 0.3 s a run on a 2-core CPU, nine tenths of a small run);
    frozen, it walks only the run's own. No gradient depends on when garbage is collected. A caller that froze
    objects itself keeps its setting."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@contextlib.contextmanager
def _own_accelerate_state() -> Iterator[None]:
    """Accelerate keeps one process-wide state (``PartialState``, ``AcceleratorState``, ``GradientState``): a run
    starts from a fresh one and puts the caller's back afterwards, so an ``Accelerator`` of the reader's own keeps
    working."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    saved = [(cls, dict(cls._shared_state)) for cls in (PartialState, AcceleratorState, GradientState)]
    _reset_accelerate()
    try:
        yield
    finally:
        for cls, state in saved:
            cls._shared_state.clear()
            cls._shared_state.update(state)


def _finish(result: Run, opt: RecordingSGD, sched: CountingLR | None, comm: CommCounter | None) -> Run:
    """Fill in what the optimizer, the scheduler and the communication hook recorded."""
    result.grads, result.lrs, result.params, result.optimizer_steps = opt.grads, opt.lrs, opt.params, len(opt.grads)
    result.scheduler_steps = sched.calls if sched is not None else 0
    result.allreduces = comm.calls if comm else 0
    return result


def _hook(model: nn.Module) -> CommCounter | None:
    """Count the all-reduces of a DDP-wrapped model (None for a model that is not)."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return register_counter(model)
    return None
