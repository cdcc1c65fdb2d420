r"""The five runners: Hugging Face Accelerate, PyTorch Lightning, the Transformers ``Trainer`` and two hand-written
loops in the style of well-known training scripts, each driving one framework over the same micro-batches.

Every runner ``_run_<framework>(model, loss_fn, micro, k, options)`` builds the optimizer (:class:`RecordingSGD`)
and an LR scheduler (:class:`CountingLR`) from ``model.parameters()`` inside, lets the framework drive them, and
returns a :class:`Run`. :func:`gradaccum.frameworks.run` validates the arguments and calls them. The frameworks are
imported only when a runner runs: the rest of the package needs torch alone.
"""

from __future__ import annotations

import contextlib
import math
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, SequentialSampler

from gradaccum.distributed import CommCounter, counting_hook
from gradaccum.framework_probes import (
    CountingLR,
    LossFn,
    Options,
    RecordingSGD,
    Run,
    _finish,
    _hook,
    _own_accelerate_state,
    _stack,
    _world,
    _young_gc_only,
)
from gradaccum.windows import IGNORE

# --------------------------------------------------------------------------------------------- Accelerate


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

    acc = Accelerator(
        gradient_accumulation_steps=k,
        cpu=True,
        mixed_precision={"fp32": "no", "bf16": "bf16", "fp16": "fp16"}[precision],
    )
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


def _accelerate_token_epoch(
    acc: Any, pmodel: Any, popt: Any, psched: Any, ploader: Any, k: int, sum_loss: LossFn, clip: float | None
) -> None:
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


def _lightning_trainer(
    k: int, clip: float | None, precision: str, comm: CommCounter | None, overrides: dict[str, Any]
) -> Any:
    import pytorch_lightning as pl

    _, world = _world()
    strategy: Any = "auto"
    callbacks = []
    if world > 1:
        from pytorch_lightning.strategies import DDPStrategy

        # DDPStrategy(ddp_comm_hook=...) registers hooks on CUDA only: register ours when training starts
        strategy = DDPStrategy(process_group_backend="gloo")
        callbacks.append(_CommCallback(comm))
    options = dict(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        callbacks=callbacks,
        max_epochs=1,
        accumulate_grad_batches=k,
        gradient_clip_val=clip,
        precision={"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}[precision],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )
    options.update(overrides)
    return pl.Trainer(**options)


def _run_lightning(model: nn.Module, loss_fn: LossFn, micro: list, k: int, o: Options) -> Run:
    """``Trainer(accumulate_grad_batches=K, gradient_clip_val=clip, precision=...)`` fitting a module whose
    ``training_step`` returns the micro-batch's mean loss and whose scheduler has ``interval="step"``."""
    clip, precision, sum_loss, lr, warmup = o.clip, o.precision, o.sum_loss, o.lr, o.warmup
    if sum_loss is not None:
        raise ValueError(
            "Lightning has no token-level recipe: it divides every micro-batch's loss by "
            "accumulate_grad_batches. Count the window's tokens yourself (see chapter 6)."
        )
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

    def __init__(
        self, model: nn.Module, loss_fn: LossFn, sum_loss: LossFn | None = None, accepts_loss_kwargs: bool | None = None
    ):
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
    with _own_accelerate_state(), tempfile.TemporaryDirectory() as out_dir, _young_gc_only():
        args = TrainingArguments(
            output_dir=out_dir,
            per_device_train_batch_size=b,
            gradient_accumulation_steps=k,
            num_train_epochs=o.epochs,
            max_grad_norm=clip if clip is not None else 0.0,
            bf16=precision == "bf16",
            fp16=precision == "fp16",
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            logging_strategy="steps",
            logging_steps=1,
            disable_tqdm=True,
            dataloader_drop_last=False,
            ddp_backend="gloo" if _world()[1] > 1 else None,
            learning_rate=lr,
            seed=0,
        )
        # The Trainer seeds the random generators when it is built (set_seed(args.seed)); a training script builds
        # it once, before training: the runner puts the random state back, as if it had been built long before.
        state = torch.get_rng_state()
        columns = _Columns(x=data.tensors[0], labels=data.tensors[1])
        trainer = trainer_cls(
            model=wrapped, args=args, train_dataset=columns, optimizers=(opt, sched), callbacks=[hooked]
        )
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
    once, the scheduler stepped once per update. At each update it logs what timm's log line shows first: the
    last micro-batch's mean loss (the loss it backpropagated, divided by the window's micro-batches, multiplied
    back)."""
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
                        loss = sum_loss(out, yb) * _world()[1] / _tokens_across_ranks(micro[start : start + k])
                loss.backward()
            if need_update:
                if clip is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                opt.step()
                opt.zero_grad()
                sched.step()
                result.logged.append(float(loss.detach()) * accum)
    return _finish(result, opt, sched, comm)


_RUNNERS: dict[str, Callable[..., Run]] = {
    "accelerate": _run_accelerate,
    "lightning": _run_lightning,
    "trainer": _run_trainer,
    "nanogpt": _run_nanogpt,
    "timm": _run_timm,
}
