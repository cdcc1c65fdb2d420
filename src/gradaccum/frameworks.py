r"""Run the frameworks people train with — Hugging Face Accelerate, PyTorch Lightning, the Transformers ``Trainer`` —
and two hand-written loops in the style of well-known training scripts, on the same micro-batches, and measure what
one accumulated step computes.

Every runner takes the same inputs — a model, a loss ``loss_fn(output, target)`` (the mean over one micro-batch), a
list of micro-batches and the number of micro-batches per optimizer step ``K`` — builds the optimizer and an LR
scheduler from ``model.parameters()`` inside, lets the framework drive them, and returns a :class:`Run`:

* the gradient each optimizer step received (recorded by :class:`RecordingSGD` *after* a closure has run, so a
  framework that does its last backward inside ``optimizer.step(closure)`` — Lightning — is measured correctly);
* how many optimizer steps and LR-scheduler steps were taken (:class:`CountingLR` counts the calls that reach the
  scheduler, not the ones a wrapper swallows), BatchNorm running-statistics updates, DDP all-reduces (a
  communication hook) and what was logged as the loss.

A correct accumulated step of K equal micro-batches is :math:`\theta \leftarrow \theta - \eta \frac1K\sum_k
\nabla L_k = \theta - \eta \nabla L_{\text{full}}` for a per-sample mean loss, and for a token loss the window's
summed token loss over the window's tokens, :math:`\sum_k S_k / \sum_k n_k` (chapter 6). The runners use SGD with
learning rate ``LR`` and no momentum, so each step's recorded gradient is all the step used.

The same runners are ``step`` functions for :func:`gradaccum.checker.check` (:func:`accelerate_step`,
:func:`lightning_step`), so a reader can check an Accelerate loop or a Lightning module directly.

The frameworks are imported only when a runner needs them: the rest of the package needs torch alone.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import inspect
import io
import logging
import math
import os
import tempfile
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, SequentialSampler, TensorDataset

from gradaccum._validate import require_k, require_nonnegative
from gradaccum.checker.instrument import flat
from gradaccum.distributed import CommCounter, counting_hook, register_counter
from gradaccum.windows import IGNORE

__all__ = ["FRAMEWORKS", "IGNORE", "LABELS", "LR", "PINNED", "PRECISIONS", "CountingLR", "HFWrapper", "Options",
           "RankResult", "RecordingSGD", "Run", "accelerate_step", "bn_updates", "flat_grads", "framework_step",
           "full_gradient", "lightning_module_step", "lightning_step", "rank_task", "relative_error", "run", "split",
           "tiny_causal_lm", "trainer_on_causal_lm", "versions"]

#: The frameworks measured, in the order of the chapter's table.
FRAMEWORKS = ("accelerate", "lightning", "trainer", "nanogpt", "timm")
#: How the chapter names them.
LABELS = {"accelerate": "Accelerate", "lightning": "Lightning", "trainer": "Transformers Trainer",
          "nanogpt": "nanoGPT-style loop", "timm": "timm-style loop"}
#: The distributions whose behaviour the chapter asserts (the versions pinned in requirements.txt).
PINNED = {"accelerate": "1.15.0", "pytorch-lightning": "2.6.6", "transformers": "5.23.0"}
#: Learning rate of the runners' SGD (no momentum, no weight decay).
LR = 0.1
PRECISIONS = ("fp32", "bf16", "fp16")

MicroBatches = Sequence[tuple[torch.Tensor, torch.Tensor]]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def versions() -> dict[str, str]:
    """The installed version of each framework (``"missing"`` when it is not installed)."""
    out = {}
    for dist_name in PINNED:
        try:
            out[dist_name] = importlib.metadata.version(dist_name)
        except importlib.metadata.PackageNotFoundError:
            out[dist_name] = "missing"
    return out


# ------------------------------------------------------------------------------------------------ the probes


def flat_grads(params: Sequence[nn.Parameter]) -> torch.Tensor:
    """All gradients as one float64 vector (zeros where a parameter has none): the checker's own reading."""
    return flat(list(params))


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
        self.params.append(torch.cat([p.detach().reshape(-1).double() for g in self.param_groups
                                      for p in g["params"]]))
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
        raise ValueError(f"the runners need micro-batches of one size, got sizes {sorted(sizes)}; split the data "
                         "into equal micro-batches (the last partial *window* may hold fewer of them).")
    return TensorDataset(torch.cat([x for x, _ in micro]), torch.cat([y for _, y in micro]))


def _validate(model: Any, micro: Any, k: Any, framework: str, precision: str) -> None:
    if framework not in FRAMEWORKS:
        raise ValueError(f"unknown framework {framework!r}; choose one of {', '.join(FRAMEWORKS)}.")
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"K (micro-batches per optimizer step) must be an int >= 1, got {k!r}.")
    if not micro:
        raise ValueError("need at least one micro-batch.")
    if not all(isinstance(m, (tuple, list)) and len(m) == 2 and all(isinstance(t, torch.Tensor) for t in m)
               for m in micro):
        raise ValueError("micro-batches must be (inputs, targets) pairs of tensors; frameworks.split(x, y, n) makes "
                         "n equal ones.")
    for i, (mx, my) in enumerate(micro):
        if mx.dim() == 0 or my.dim() == 0 or len(mx) != len(my) or len(mx) == 0:
            raise ValueError(f"micro-batch {i} holds {mx.shape} inputs and {my.shape} targets: each needs as many "
                             "targets as inputs, at least one, along dimension 0.")
    _stack(micro)  # equal sizes (the data loaders need them)
    _check_precision(framework, precision)


def _check_precision(framework: str, precision: Any) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}.")
    if precision == "fp16" and framework in ("nanogpt", "timm"):
        raise ValueError(f"the {framework}-style loop takes fp32 or bf16 here: fp16 needs a GradScaler on a GPU.")


def _check_options(framework: str, clip: Any, warmup: Any, cosine: Any, epochs: Any, loss_kwargs: Any,
                   lr: Any) -> None:
    """:func:`run`'s options, checked before anything runs."""
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip > 0
                             or not math.isfinite(clip)):
        raise ValueError(f"clip must be a positive number (a gradient-norm threshold) or None, got {clip!r}.")
    for name, value in (("warmup", warmup), ("cosine", cosine), ("epochs", epochs)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "epochs" else 0):
            raise ValueError(f"{name} must be an int >= {1 if name == 'epochs' else 0}, got {value!r}.")
    if loss_kwargs is not None and (framework != "trainer" or not isinstance(loss_kwargs, bool)):
        raise ValueError(f"loss_kwargs is the Transformers Trainer's model setting (True or False), got "
                         f"{loss_kwargs!r} for {framework!r}: leave it None.")
    require_nonnegative(lr, "lr (the learning rate; 0 keeps the weights)")


def _import(framework: str) -> None:
    modules = {"accelerate": "accelerate", "lightning": "pytorch_lightning", "trainer": "transformers"}
    if framework in modules:
        importlib.import_module(modules[framework])


_NOISY = ("lightning", "pytorch_lightning", "lightning_fabric", "transformers", "accelerate")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The frameworks' informational messages (device hints, tips, per-step logs) and warnings stay off the page;
    errors still raise."""
    loggers = [logging.getLogger(n) for n in list(logging.root.manager.loggerDict) if n.split(".")[0] in _NOISY]
    loggers += [logging.getLogger(n) for n in _NOISY]
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


def run(framework: str, model: nn.Module, loss_fn: LossFn, micro: MicroBatches, k: int, *,
        clip: float | None = None, precision: str = "fp32", sum_loss: LossFn | None = None,
        lr: float = LR, warmup: int = 0, cosine: int = 0, epochs: int = 1, loss_kwargs: bool | None = None) -> Run:
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
        raise ValueError("the nanoGPT-style loop here writes only a linear warmup into the optimizer (no scheduler "
                         "object): cosine is not supported; leave cosine=0, or use another framework.")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("the model has no trainable parameter (every one has requires_grad=False): there is no "
                         "gradient to accumulate.")
    if framework == "nanogpt" and epochs * len(micro) < k:
        raise ValueError(f"the nanoGPT-style loop runs epochs · micro-batches // K iterations: {epochs} · "
                         f"{len(micro)} // {k} is none; pass at least K micro-batches (or more epochs).")
    options = Options(clip, precision, sum_loss, lr, warmup, cosine, epochs, loss_kwargs)
    runner = _RUNNERS[framework]
    _import(framework)  # before _quiet(): the loggers it silences are created on import
    before = bn_updates(model)
    with _quiet():
        out = runner(model, loss_fn, list(micro), k, options)
    out.bn_updates = bn_updates(model) - before
    out.world_size = _world()[1]
    return out


# --------------------------------------------------------------------------------------------- Accelerate


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


def accelerate_split_batches() -> dict[str, bool]:
    """What ``Accelerator.split_batches`` reads after each of two ways of asking for split batches: the keyword
    ``Accelerator(split_batches=True)`` (accelerate 1.x keeps it in the signature but never reads it) and
    ``Accelerator(dataloader_config=DataLoaderConfiguration(split_batches=True))``. On fresh Accelerate states;
    the caller's is put back."""
    _import("accelerate")
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    read = {}
    for spelling, kwargs in (("Accelerator(split_batches=True)", {"split_batches": True}),
                             ("DataLoaderConfiguration(split_batches=True)",
                              {"dataloader_config": DataLoaderConfiguration(split_batches=True)})):
        with _own_accelerate_state(), _quiet():
            read[spelling] = bool(Accelerator(cpu=True, **kwargs).split_batches)
    return read


def _run_accelerate(model: nn.Module, loss_fn: LossFn, micro: list, k: int, o: Options) -> Run:
    with _own_accelerate_state():
        return _accelerate_loop(model, loss_fn, micro, k, o)


def _accelerate_loop(model: nn.Module, loss_fn: LossFn, micro: list, k: int, o: Options) -> Run:
    """The loop of Accelerate's gradient-accumulation guide: ``accumulate(model)``, ``backward``, clip under
    ``sync_gradients``, ``optimizer.step()``, ``scheduler.step()``, ``zero_grad()`` on every micro-batch.
    With ``sum_loss``: the guide's token recipe — no ``accumulate()``; fetch a window's batches, count their
    tokens and gather the counts across processes, backward the summed loss times ``K · num_processes`` over the
    count (under ``no_sync`` but for the last), then clip, step, zero once per window."""
    clip, precision, sum_loss, lr, warmup = o.clip, o.precision, o.sum_loss, o.lr, o.warmup
    from accelerate import Accelerator

    acc = Accelerator(gradient_accumulation_steps=k, cpu=True,
                      mixed_precision={"fp32": "no", "bf16": "bf16", "fp16": "fp16"}[precision])
    opt = RecordingSGD(model.parameters(), lr)
    sched = CountingLR(opt, warmup, o.cosine)
    b = len(micro[0][0])
    loader = DataLoader(_stack(micro), batch_size=b, shuffle=False)
    pmodel, popt, ploader, psched = acc.prepare(model, opt, loader, sched)
    comm = _hook(pmodel)
    result = Run("accelerate", k, len(micro))

    def micro_step(xb: torch.Tensor, yb: torch.Tensor) -> None:
        with acc.accumulate(pmodel):
            acc.backward(loss_fn(pmodel(xb), yb))
            if clip is not None and acc.sync_gradients:
                acc.clip_grad_norm_(pmodel.parameters(), clip)
            popt.step()
            psched.step()
            popt.zero_grad()

    for _ in range(o.epochs):
        if sum_loss is None:  # the guide's loop, over the prepared data loader
            for xb, yb in ploader:
                micro_step(xb, yb)
        else:
            _accelerate_token_epoch(acc, pmodel, popt, psched, ploader, k, sum_loss, clip)
    return _finish(result, opt, sched, comm)


def _accelerate_token_epoch(acc: Any, pmodel: Any, popt: Any, psched: Any, ploader: Any, k: int,
                            sum_loss: LossFn, clip: float | None) -> None:
    """One epoch of the guide's token recipe: no accumulate(); fetch a window, count its tokens, no_sync but the
    last micro-batch, then clip, step and zero once."""
    batches = iter(ploader)
    for _ in range(math.ceil(len(ploader) / k)):
        window = [batch for _, batch in zip(range(k), batches)]
        count = sum((yb != IGNORE).sum() for _, yb in window)
        tokens = acc.gather(count.reshape(1)).sum()
        for i, (xb, yb) in enumerate(window):
            sync = i == len(window) - 1 or acc.num_processes == 1
            with contextlib.nullcontext() if sync else pmodel.no_sync():
                loss = sum_loss(pmodel(xb), yb) * (k * acc.num_processes) / tokens
                acc.backward(loss)
        if clip is not None:
            acc.clip_grad_norm_(pmodel.parameters(), clip)
        popt.step()
        psched.step()
        popt.zero_grad()


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


# ---------------------------------------------------------------------------------------------- Lightning


def _lightning_module(model: nn.Module, loss_fn: LossFn, lr: float, warmup: int = 0, cosine: int = 0) -> Any:
    import pytorch_lightning as pl

    class Wrapped(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.opt: RecordingSGD | None = None
            self.sched: CountingLR | None = None
            self.logged: list[float] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.model(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return loss_fn(self.model(x), y)

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            # what Lightning hands to callbacks and loggers as this batch's loss
            self.logged.append(float(outputs["loss"]))

        def configure_optimizers(self) -> Any:
            self.opt = RecordingSGD(self.model.parameters(), lr)
            self.sched = CountingLR(self.opt, warmup, cosine)
            return {"optimizer": self.opt, "lr_scheduler": {"scheduler": self.sched, "interval": "step"}}

    return Wrapped()


def _CommCallback(comm: CommCounter | None) -> Any:
    import pytorch_lightning as pl

    class Hook(pl.Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            model = trainer.strategy.model
            if comm is not None and isinstance(model, nn.parallel.DistributedDataParallel):
                comm.process_group = model.process_group  # the model's own group
                model.register_comm_hook(comm, counting_hook)

    return Hook()


def _lightning_trainer(k: int, clip: float | None, precision: str, comm: CommCounter | None,
                       overrides: dict[str, Any]) -> Any:
    import pytorch_lightning as pl

    _, world = _world()
    strategy: Any = "auto"
    callbacks = []
    if world > 1:
        from pytorch_lightning.strategies import DDPStrategy

        # DDPStrategy(ddp_comm_hook=...) registers hooks on CUDA only: register ours when training starts
        strategy = DDPStrategy(process_group_backend="gloo")
        callbacks.append(_CommCallback(comm))
    options = dict(accelerator="cpu", devices=world, strategy=strategy, callbacks=callbacks, max_epochs=1,
                   accumulate_grad_batches=k,
                   gradient_clip_val=clip,
                   precision={"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}[precision],
                   logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   num_sanity_val_steps=0, use_distributed_sampler=False)
    options.update(overrides)
    return pl.Trainer(**options)


def _run_lightning(model: nn.Module, loss_fn: LossFn, micro: list, k: int, o: Options) -> Run:
    """``Trainer(accumulate_grad_batches=K, gradient_clip_val=clip, precision=...)`` fitting a module whose
    ``training_step`` returns the micro-batch's mean loss and whose scheduler has ``interval="step"``."""
    clip, precision, sum_loss, lr, warmup = o.clip, o.precision, o.sum_loss, o.lr, o.warmup
    if sum_loss is not None:
        raise ValueError("Lightning has no token-level recipe: it divides every micro-batch's loss by "
                         "accumulate_grad_batches. Count the window's tokens yourself (see chapter 6).")
    module = _lightning_module(model, loss_fn, lr, warmup, o.cosine)
    comm = CommCounter() if _world()[1] > 1 else None
    b = len(micro[0][0])
    with tempfile.TemporaryDirectory() as root:
        trainer = _lightning_trainer(k, clip, precision, comm, {"default_root_dir": root, "max_epochs": o.epochs})
        trainer.fit(module, DataLoader(_stack(micro), batch_size=b, shuffle=False))
    opt, sched = module.opt, module.sched
    assert opt is not None and sched is not None
    return _finish(Run("lightning", k, len(micro), logged=module.logged), opt, sched, comm)


# ----------------------------------------------------------------------------------- the Transformers Trainer


class _Columns(Dataset):
    """Samples as the Trainer wants them: one dict per sample, one entry per named column."""

    def __init__(self, **columns: torch.Tensor):
        self.columns = columns

    def __len__(self) -> int:
        return len(next(iter(self.columns.values())))

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {name: column[i] for name, column in self.columns.items()}


class HFWrapper(nn.Module):
    """A model for the Trainer: ``forward(x, labels)`` returns ``{"loss": ...}``.

    Without ``sum_loss`` its forward takes no other keyword, so the Trainer divides the mean loss by the
    accumulation steps; with ``sum_loss`` it accepts ``num_items_in_batch`` (the window's tokens, counted by the
    Trainer) and returns the summed loss divided by it — what Transformers' own language models do.
    ``accepts_loss_kwargs=True`` without ``sum_loss``: a model that is handed the count and returns its mean loss
    anyway (a custom ``forward(..., **kwargs)`` that ignores the count)."""

    def __init__(self, model: nn.Module, loss_fn: LossFn, sum_loss: LossFn | None = None,
                 accepts_loss_kwargs: bool | None = None):
        super().__init__()
        self.model, self.loss_fn, self.sum_loss = model, loss_fn, sum_loss
        self.accepts_loss_kwargs = sum_loss is not None if accepts_loss_kwargs is None else accepts_loss_kwargs

    def forward(self, x: torch.Tensor, labels: torch.Tensor, num_items_in_batch: Any = None) -> dict[str, Any]:
        out = self.model(x)
        if self.sum_loss is not None and num_items_in_batch is not None:
            loss = self.sum_loss(out, labels) / num_items_in_batch
        else:
            loss = self.loss_fn(out, labels)
        return {"loss": loss, "logits": out}


def _hf_trainer_class() -> type:
    from transformers import Trainer, TrainerCallback

    class InOrder(Trainer):
        """The Trainer, reading the data in order (the default shuffles) so runs compare with one reference."""

        def _get_train_sampler(self, *args: Any, **kwargs: Any) -> Any:
            return SequentialSampler(self.train_dataset)  # type: ignore[arg-type]

    class Hooked(TrainerCallback):
        def __init__(self) -> None:
            self.trainer: Any = None
            self.comm: CommCounter | None = None

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.comm = _hook(self.trainer.model_wrapped)

    InOrder.Hooked = Hooked  # type: ignore[attr-defined]
    return InOrder


def _run_trainer(model: nn.Module, loss_fn: LossFn, micro: list, k: int, o: Options) -> Run:
    """``Trainer`` with ``gradient_accumulation_steps=K``, ``max_grad_norm=clip`` (0: off — its default is 1.0),
    ``bf16`` as asked, ``use_cpu=True``; our optimizer and scheduler passed as ``optimizers=``."""
    clip, precision, sum_loss, lr, warmup = o.clip, o.precision, o.sum_loss, o.lr, o.warmup
    from transformers import PrinterCallback, TrainingArguments

    wrapped = HFWrapper(model, loss_fn, sum_loss, o.loss_kwargs)
    opt = RecordingSGD(model.parameters(), lr)
    sched = CountingLR(opt, warmup, o.cosine)
    b = len(micro[0][0])
    data = _stack(micro)
    trainer_cls = _hf_trainer_class()
    hooked = trainer_cls.Hooked()  # type: ignore[attr-defined]
    with _own_accelerate_state(), tempfile.TemporaryDirectory() as out_dir:
        args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=b, gradient_accumulation_steps=k,
                                 num_train_epochs=o.epochs, max_grad_norm=clip if clip is not None else 0.0,
                                 bf16=precision == "bf16", fp16=precision == "fp16", use_cpu=True, report_to=[],
                                 save_strategy="no",
                                 logging_strategy="steps", logging_steps=1, disable_tqdm=True,
                                 dataloader_drop_last=False, ddp_backend="gloo" if _world()[1] > 1 else None,
                                 learning_rate=lr, seed=0)
        # The Trainer seeds the random generators when it is built (set_seed(args.seed)); a training script builds
        # it once, before training: the runner puts the random state back, as if it had been built long before.
        state = torch.get_rng_state()
        columns = _Columns(x=data.tensors[0], labels=data.tensors[1])
        trainer = trainer_cls(model=wrapped, args=args, train_dataset=columns, optimizers=(opt, sched),
                              callbacks=[hooked])
        torch.set_rng_state(state)
        hooked.trainer = trainer
        trainer.remove_callback(PrinterCallback)  # it prints every log line when tqdm is off
        trainer.train()
    logged = [float(e["loss"]) for e in trainer.state.log_history if "loss" in e]
    return _finish(Run("trainer", k, len(micro), logged=logged), opt, sched, hooked.comm)


# ------------------------------------------------------------------------------------ two hand-written loops


def _ddp(model: nn.Module) -> tuple[nn.Module, CommCounter | None]:
    if _world()[1] > 1:
        wrapped = nn.parallel.DistributedDataParallel(model)
        return wrapped, _hook(wrapped)
    return model, None


def _autocast(precision: str) -> Any:
    return torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()


def _tokens_across_ranks(window: list) -> torch.Tensor:
    count = sum((yb != IGNORE).sum() for _, yb in window).reshape(1).double()
    if _world()[1] > 1:
        dist.all_reduce(count)
    return count


def _run_nanogpt(model: nn.Module, loss_fn: LossFn, micro: list, k: int, o: Options) -> Run:
    """In the style of nanoGPT's ``train.py``: a fixed number of iterations of K micro-batches (no epochs: the
    micro-batches left over when they run out are never used), ``require_backward_grad_sync`` set before each
    forward, ``loss / K``, ``unscale_`` and clip once, the learning rate written into the optimizer from the
    iteration number (no scheduler object), the last micro-batch's ``loss · K`` logged."""
    clip, precision, sum_loss, lr, warmup = o.clip, o.precision, o.sum_loss, o.lr, o.warmup
    if sum_loss is not None:
        raise ValueError("the nanoGPT-style loop has no token-level recipe: its batches have no padding.")
    net, comm = _ddp(model)
    opt = RecordingSGD(model.parameters(), lr)
    scaler = torch.amp.GradScaler("cpu", enabled=False)  # nanoGPT: enabled only for float16
    result = Run("nanogpt", k, len(micro))
    for it in range(o.epochs * len(micro) // k):
        for group in opt.param_groups:
            group["lr"] = lr * (min(1.0, (it + 1) / warmup) if warmup else 1.0)  # get_lr(it)
        for step in range(k):
            if isinstance(net, nn.parallel.DistributedDataParallel):
                net.require_backward_grad_sync = step == k - 1
            xb, yb = micro[(it * k + step) % len(micro)]
            with _autocast(precision):
                loss = loss_fn(net(xb), yb) / k
            scaler.scale(loss).backward()
        if clip is not None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        result.logged.append(float(loss.detach()) * k)
    return _finish(result, opt, None, comm)


def _run_timm(model: nn.Module, loss_fn: LossFn, micro: list, k: int, o: Options) -> Run:
    """In the style of timm's ``train.py``: backward under ``no_sync()`` except on update steps, the loss divided
    by the number of micro-batches the window really holds (the last window of an epoch may hold fewer), clip
    once, the scheduler stepped once per update; at each update it logs what timm's log line shows first, the
    last micro-batch's loss times the micro-batches divided by (its mean loss)."""
    clip, precision, sum_loss, lr, warmup = o.clip, o.precision, o.sum_loss, o.lr, o.warmup
    net, comm = _ddp(model)
    opt = RecordingSGD(model.parameters(), lr)
    sched = CountingLR(opt, warmup, o.cosine)
    n = len(micro)
    result = Run("timm", k, n)
    for _ in range(o.epochs):  # train_one_epoch
        last_accum, last_idx = n % k, n - 1
        last_full = n - last_accum
        accum = k
        for i, (xb, yb) in enumerate(micro):
            need_update = i == last_idx or (i + 1) % k == 0
            if i >= last_full:
                accum = last_accum
            sync = need_update or not isinstance(net, nn.parallel.DistributedDataParallel)
            # forward and backward inside no_sync(), as timm does: DDP decides at the forward whether to reduce
            with contextlib.nullcontext() if sync else net.no_sync():  # type: ignore[operator]
                with _autocast(precision):
                    out = net(xb)
                    if sum_loss is None:
                        loss = loss_fn(out, yb) / accum
                    else:  # the token recipe: the window's tokens across ranks
                        start = (i // k) * k
                        loss = sum_loss(out, yb) * _world()[1] / _tokens_across_ranks(micro[start:start + k])
                loss.backward()
            if need_update:
                if clip is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                opt.step()
                opt.zero_grad()
                sched.step()
                result.logged.append(float(loss.detach()) * accum)
    return _finish(result, opt, sched, comm)


_RUNNERS: dict[str, Callable[..., Run]] = {"accelerate": _run_accelerate, "lightning": _run_lightning,
                                           "trainer": _run_trainer, "nanogpt": _run_nanogpt, "timm": _run_timm}


# ------------------------------------------------------------------------------ steps for gradaccum.check


def split(x: torch.Tensor, y: torch.Tensor, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``k`` equal micro-batches of ``(x, y)`` (``ValueError`` if ``k`` does not divide the batch)."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}.")
    if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)) or x.dim() == 0 or y.dim() == 0:
        raise ValueError(f"x and y must be tensors with the samples along dimension 0, got {type(x).__name__} and "
                         f"{type(y).__name__}; convert arrays with torch.as_tensor(...).")
    if len(x) != len(y):
        raise ValueError(f"x has {len(x)} samples but y has {len(y)}; pass matching inputs and targets.")
    if len(x) == 0:
        raise ValueError("the batch is empty: there is nothing to split into micro-batches.")
    if len(x) % k:
        raise ValueError(f"k = {k} does not divide the batch of {len(x)}; pick a batch that k divides.")
    return list(zip(x.chunk(k), y.chunk(k)))


def _check_step_k(k: Any) -> None:
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise ValueError(f"k (the accumulation steps the framework is configured with) must be an int >= 1 or None "
                         f"(the window's K), got {k!r}.")


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
        raise ValueError(f"unknown option(s) {', '.join(unknown)}; run() takes "
                         f"{', '.join(Options.__dataclass_fields__)}.")
    given = {**vars(Options()), **options}  # checked now: a bad option is not the checked loop's bug
    _check_precision(framework, given["precision"])
    _check_options(framework, given["clip"], given["warmup"], given["cosine"], given["epochs"], given["loss_kwargs"],
                   given["lr"])

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
        raise ValueError(f"pytorch_lightning.Trainer takes no {', '.join(unknown)}: pass Trainer's own keyword "
                         "arguments (e.g. precision='bf16-mixed', gradient_clip_val=1.0).")

    def step(module: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, window: int) -> None:

        if not isinstance(module, pl.LightningModule):
            raise ValueError(f"lightning_module_step needs a LightningModule, got {type(module).__name__}; use "
                             "lightning_step() for a plain nn.Module.")
        micro = split(x, y, window)
        _import("lightning")
        with _quiet(), tempfile.TemporaryDirectory() as root:
            trainer = _lightning_trainer(k or window, None, "fp32", None,
                                         {"default_root_dir": root, **trainer_options})
            trainer.fit(module, DataLoader(_stack(micro), batch_size=len(micro[0][0]), shuffle=False))

    return step


# ------------------------------------------------------------------------------------------- measurements


def _gradient_pair(a: Any, b: Any, names: tuple[str, str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Two finite flat gradients of one length, in float64 (``ValueError`` naming what is wrong)."""
    for name, t in zip(names, (a, b)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() != 1:
            raise ValueError(f"{name} must be a flat floating-point gradient (1-D, e.g. flat_grads(...)), got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}.")
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name} contains inf or NaN: no error or factor is defined for it.")
    if a.shape != b.shape:
        raise ValueError(f"{names[0]} has {a.numel()} entries and {names[1]} {b.numel()}: the two gradients must "
                         "cover the same parameters.")
    if not bool(b.abs().max() > 0):
        raise ValueError(f"the reference gradient {names[1]} is zero: nothing relates a step to it.")
    return a.double(), b.double()


def step_factor(grad: torch.Tensor, reference: torch.Tensor) -> float:
    """The factor ``c`` with ``grad ≈ c · reference`` (least squares): 1 for a correctly weighted step."""
    grad, reference = _gradient_pair(grad, reference, ("grad", "reference"))
    return float(grad @ reference / (reference @ reference))


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in float64."""
    a, b = _gradient_pair(a, b, ("a", "b"))
    return float((a - b).norm() / b.norm())


def full_gradient(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor,
                  sum_loss: LossFn | None = None) -> torch.Tensor:
    """The gradient of one full batch: ``loss_fn`` on all of it, or, for a token loss, its summed token loss over
    its tokens. Works on a copy in train mode; the model is left as it was."""
    import copy

    net = copy.deepcopy(model).train()
    net.zero_grad(set_to_none=True)
    out = net(x)
    loss = sum_loss(out, y) / (y != IGNORE).sum() if sum_loss is not None else loss_fn(out, y)
    loss.backward()
    return flat_grads(list(net.parameters()))


# ------------------------------------------------------------------------------------------ two processes


@dataclass
class RankResult:
    """What one framework did on two (or more) processes for one window per process."""

    framework: str
    optimizer_steps: int
    scheduler_steps: int
    allreduces: int
    token_error: float  # per-micro-batch mean loss against the global token mean
    recipe_error: float | None  # the framework's token recipe (None: it has none)
    lrs: list[float]  # learning rate at each optimizer step under a linear warmup (``warmup`` scheduler steps)
    # the Trainer only: a model that accepts loss kwargs and returns its mean loss, its step as a multiple of
    # the default's (the mean of micro-batch means)
    kwargs_mean_factor: float | None = None


def _distributed_env(rank: int, world_size: int) -> None:
    """What torchrun would set, so that every framework finds the process group it is running in."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0", ROLE_RANK=str(rank),
                      TORCHELASTIC_RUN_ID="gradaccum")


def rank_task(rank: int, world_size: int, x: torch.Tensor, y: torch.Tensor, k: int, seed: int = 0,
              frameworks: Sequence[str] = FRAMEWORKS, warmup: int = 8, windows: int = 10) -> list[RankResult]:
    """Run on every rank of an initialized process group: each framework trains a fresh character LM
    (``TinyLM``, float32) for one window of ``k`` micro-batches per rank on ``(x, y)`` — the whole global batch,
    ``world_size · k`` equal micro-batches; Accelerate and the Trainer shard it themselves, Lightning (without its
    distributed sampler) and the hand-written loops get the same shard, every ``world_size``-th micro-batch — and is
    compared with the gradient of one full batch over all of it."""
    from gradaccum.windows import token_loss

    _distributed_env(rank, world_size)
    vocab = int(max(x.max(), y.max())) + 1
    micro = split(x, y, world_size * k)

    def fresh() -> nn.Module:
        from gradaccum.book.models import TinyLM  # the book's model; no figures are imported with it

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return TinyLM(vocab)

    mean, total = token_loss, lambda o, t: token_loss(o, t, "sum")
    reference = full_gradient(fresh(), mean, x, y, sum_loss=total)
    results = []
    for framework in frameworks:
        # Accelerate and the Trainer shard the data loader by batches (rank r: batches r, r + p, ...); the others
        # get that shard
        own = micro if framework in ("accelerate", "trainer") else micro[rank::world_size]
        plain = run(framework, fresh(), mean, own, k)
        recipe: float | None = None
        try:
            fixed = run(framework, fresh(), mean, own, k, sum_loss=total)
            recipe = relative_error(fixed.grads[0], reference)
        except ValueError:
            pass
        longer = run(framework, fresh(), mean, list(own) * windows, k, warmup=warmup)
        factor = None
        if framework == "trainer":
            kwargs_mean = run(framework, fresh(), mean, own, k, loss_kwargs=True)
            factor = step_factor(kwargs_mean.grads[0], plain.grads[0])
        results.append(RankResult(framework, plain.optimizer_steps, plain.scheduler_steps, plain.allreduces,
                                  relative_error(plain.grads[0], reference), recipe, longer.lrs, factor))
    return results


# ------------------------------------------------------------------ the Trainer with Transformers' own models


def tiny_causal_lm(kind: str, vocab: int, positions: int, seed: int = 0) -> nn.Module:
    """A one-layer Transformers language model built from a config (no download): ``"gpt2"``
    (``GPT2LMHeadModel``) or ``"llama"`` (``LlamaForCausalLM``), or the encoder-decoder ``"t5"``
    (``T5ForConditionalGeneration``: the labels are its targets, its decoder's inputs the labels shifted right),
    float32, dropout off."""
    _import("trainer")
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        T5Config,
        T5ForConditionalGeneration,
    )

    with _quiet(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if kind == "gpt2":
            return GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=positions, n_embd=16, n_layer=1, n_head=2,
                                              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
        if kind == "llama":
            return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32,
                                                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                                max_position_embeddings=positions))
        if kind == "t5":
            config = T5Config(vocab_size=vocab, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1,
                              num_heads=2, dropout_rate=0.0, pad_token_id=0)
            setattr(config, "decoder_start_token_id", 0)  # noqa: B010  (its labels shifted right start with 0)
            return T5ForConditionalGeneration(config)
    raise ValueError(f"kind must be 'gpt2', 'llama' or 't5', got {kind!r}.")


#: The Transformers heads :func:`tiny_classifier` builds: a label per sequence, or per token (``-100`` skipped).
CLASSIFIER_KINDS = {"bert": "sequence", "llama": "sequence", "bert-token": "token", "bert-mlm": "token",
                    "vit": "image", "vit-regression": "image"}


def tiny_classifier(kind: str, vocab: int, positions: int, num_labels: int = 3, seed: int = 0) -> nn.Module:
    """A one-layer Transformers classifier built from a config (no download), float32, dropout off: a label per
    sequence, ``"bert"`` (``BertForSequenceClassification``) or ``"llama"`` (``LlamaForSequenceClassification``, pad
    token 0), or per token, ``"bert-token"`` (``BertForTokenClassification``) or ``"bert-mlm"``
    (``BertForMaskedLM``, the vocabulary as classes), or per image, ``"vit"`` (``ViTForImageClassification`` on
    one-channel images of side ``positions``, patches of half that; ``vocab`` unused) or ``"vit-regression"`` (the
    same with one output, a regression). Every ``forward`` takes ``**kwargs``; the text heads compute a mean loss
    that ignores ``num_items_in_batch`` (transformers issue #47688), as ViT's regression (an MSE mean) does, while
    ViT's single-label loss (``self.loss_function``) divides its summed loss by it."""
    _import("trainer")
    from transformers import (
        BertConfig,
        BertForMaskedLM,
        BertForSequenceClassification,
        BertForTokenClassification,
        LlamaConfig,
        LlamaForSequenceClassification,
        ViTConfig,
        ViTForImageClassification,
    )

    if kind not in CLASSIFIER_KINDS:
        raise ValueError(f"kind must be one of {sorted(CLASSIFIER_KINDS)}, got {kind!r}.")
    with _quiet(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if kind.startswith("bert"):
            bert = BertConfig(vocab_size=vocab, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                              intermediate_size=32, max_position_embeddings=positions, hidden_dropout_prob=0.0,
                              attention_probs_dropout_prob=0.0)
            bert.num_labels = num_labels
            head = {"bert": BertForSequenceClassification, "bert-token": BertForTokenClassification,
                    "bert-mlm": BertForMaskedLM}[kind]
            return head(bert)
        if kind.startswith("vit"):
            vit = ViTConfig(image_size=positions, patch_size=max(1, positions // 2), num_channels=1, hidden_size=16,
                            num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
            vit.num_labels = 1 if kind == "vit-regression" else num_labels
            return ViTForImageClassification(vit)
        if kind == "llama":
            llama = LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=positions,
                                pad_token_id=0)
            llama.num_labels = num_labels
        return LlamaForSequenceClassification(llama)


def trainer_on_causal_lm(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, k: int,
                         compute_loss_func: Callable[..., torch.Tensor] | None = None,
                         loss_is_scaled_for_ga: bool | None = None) -> tuple[Run, torch.Tensor]:
    """One window of ``k`` equal micro-batches of a Transformers model called with ``input_ids`` (under the
    model's ``main_input_name``: ``pixel_values`` for ViT) and ``labels`` (a causal LM, or a classifier from
    :func:`tiny_classifier`) through the Trainer (the model's own loss, with
    ``num_items_in_batch`` where its ``forward`` takes it), learning rate 0. Returns the run and the full batch's
    gradient (the model's own loss on all of it, one backward on a copy in train mode), to compare with
    :func:`relative_error` and :func:`step_factor`. ``compute_loss_func`` goes to the Trainer, and
    ``loss_is_scaled_for_ga`` to the Trainer attribute that decides whether it divides the loss by K (``None``: it
    decides from the model and ``compute_loss_func``)."""
    import copy

    require_k(k)
    if len(input_ids) % k:
        raise ValueError(f"k = {k} does not divide the batch of {len(input_ids)}.")
    from transformers import PrinterCallback, TrainingArguments

    _import("trainer")
    name = getattr(model, "main_input_name", "input_ids")
    with _quiet():
        reference = copy.deepcopy(model).train()
        reference(**{name: input_ids}, labels=labels).loss.backward()
    full = flat_grads(list(reference.parameters()))
    opt = RecordingSGD(model.parameters(), 0.0)
    sched = CountingLR(opt)
    with _quiet(), _own_accelerate_state(), tempfile.TemporaryDirectory() as out_dir:
        args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=len(input_ids) // k,
                                 gradient_accumulation_steps=k, num_train_epochs=1, max_grad_norm=0.0, use_cpu=True,
                                 report_to=[], save_strategy="no", disable_tqdm=True, learning_rate=0.0, seed=0)
        state = torch.get_rng_state()
        columns = _Columns(**{name: input_ids}, labels=labels)
        trainer = _hf_trainer_class()(model=model, args=args, train_dataset=columns, optimizers=(opt, sched),
                                      compute_loss_func=compute_loss_func)
        trainer.loss_is_scaled_for_ga = loss_is_scaled_for_ga
        torch.set_rng_state(state)
        trainer.remove_callback(PrinterCallback)
        trainer.train()
    return _finish(Run("trainer", k, k), opt, sched, None), full
