r"""The check inside the Transformers ``Trainer``: a ``TrainerCallback`` that checks the run's own accumulation when
training begins.

``Trainer(..., callbacks=[TrainerCheck()])``: at ``on_train_begin`` the callback takes the run's first batch (a
dict of columns), cuts it into ``args.gradient_accumulation_steps`` = K micro-batches
(:mod:`gradaccum.integrations.common`), and runs :func:`gradaccum.check` with a step that does what the Trainer's
inner loop does for one window: its own ``get_batch_samples`` (the window's ``num_items_in_batch``), its own
``training_step`` (so ``compute_loss``, a ``compute_loss_func``, the model's loss kwargs and the division by the
window's micro-batches are the run's) on each micro-batch, then the clip at ``args.max_grad_norm``, the optimizer
step, the scheduler step and ``zero_grad``, with copies of the run's optimizer and scheduler.

The checker takes tensors (``model(x)`` one tensor, ``loss_fn(output, y)``); the Trainer's batches are dicts and its
models return ``ModelOutput``. :class:`_Rows` adapts one to the other in one place (to be replaced when the checker
takes dict batches). The full-batch reference is ``loss_fn(logits, labels)`` when given, else the run's
``compute_loss_func`` (called with the batch's own item count) or the model's ``loss_function``.
``on_bug="stop"`` sets ``control.should_training_stop``; the Trainer reads it after its first micro-batch's
backward pass, so with K > 1 no optimizer step is taken.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import Trainer, TrainerCallback
from transformers.utils import ModelOutput

from gradaccum.checker import Report, check

from .common import act, concat, first_batches, options, rebuild


@dataclass
class _Output(ModelOutput):
    """Logits as a model output, for a ``compute_loss_func`` called on the checker's outputs."""

    logits: torch.Tensor | None = None


def _logits(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    found = getattr(out, "logits", None)
    if found is None and isinstance(out, Mapping):
        found = out.get("logits")
    if found is None and isinstance(out, (tuple, list)) and out:
        found = out[0]
    if not isinstance(found, torch.Tensor):
        raise ValueError(
            f"TrainerCheck: the model returned {type(out).__name__} without logits; pass "
            "TrainerCheck(loss_fn=...) for a model whose output the checker cannot read."
        )
    return found


class _Rows(nn.Module):
    """The Trainer's model behind the checker's tensor interface. ``x`` holds the window's row numbers (one per
    sample, as floats): ``forward(x)`` looks the rows up in the window's ``columns`` and returns the model's logits (the
    checker's references); called as the Trainer calls a model, ``forward(rows=..., labels=..., **loss_kwargs)``,
    it returns the model's whole output (the checked step)."""

    def __init__(self, model: nn.Module, columns: dict[str, torch.Tensor], label: str):
        super().__init__()
        self.model, self.columns, self.label = model, columns, label

    def _get_name(self) -> str:  # the Trainer picks its label smoothing by the model's class name
        return self.model._get_name()

    def forward(self, x: torch.Tensor | None = None, *, rows: torch.Tensor | None = None, **given: Any) -> Any:
        index = (x if rows is None else rows).reshape(-1).long()  # type: ignore[union-attr]
        inputs = {name: column[index] for name, column in self.columns.items() if name != self.label}
        out = self.model(**inputs, **given)
        return out if rows is not None else _logits(out)


def _reference(trainer: Any, model: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The full-batch loss of logits and labels the run computes: its ``compute_loss_func`` (given the batch's own
    item count, as the Trainer counts it) or the model's ``loss_function``."""
    if trainer.label_smoother is not None:
        raise ValueError(
            "TrainerCheck: with label_smoothing_factor set, pass TrainerCheck(loss_fn=...), the "
            "smoothed loss of (logits, labels) for one batch."
        )
    if trainer.compute_loss_func is not None:

        def run_loss(out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            count = trainer.get_batch_samples(iter([{"labels": labels}]), 1, labels.device)[1]
            return trainer.compute_loss_func(_Output(logits=out), labels, num_items_in_batch=count)

        return run_loss
    config = getattr(model, "config", None)
    if getattr(type(model), "loss_function", None) is None or config is None:
        raise ValueError(
            f"TrainerCheck: {type(model).__name__} has no loss_function the check can call on its "
            "logits; pass TrainerCheck(loss_fn=...), the mean loss of (logits, labels) for one batch."
        )

    def model_loss(out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        try:
            return model.loss_function(logits=out, labels=labels, vocab_size=config.vocab_size)  # type: ignore
        except TypeError as err:
            raise ValueError(
                f"the model's loss_function takes other arguments ({err}); pass "
                "TrainerCheck(loss_fn=...), the mean loss of (logits, labels) for one batch."
            ) from None

    return model_loss


def _window_step(trainer: Any, model: nn.Module) -> Callable[..., None]:
    """A ``step(model, loss_fn, x, y, k)``: the Trainer's inner loop for one window, on the checker's copy."""

    def step(work: _Rows, loss_fn: Any, x: torch.Tensor, y: torch.Tensor, k: int) -> None:
        batches = [{"rows": rows, work.label: labels} for rows, labels in zip(x.chunk(k), y.chunk(k))]
        samples, items = trainer.get_batch_samples(iter(batches), k, trainer.args.device)
        (opt,), (sched,) = rebuild(model, work.model, [trainer.optimizer], [trainer.lr_scheduler])
        saved = getattr(trainer, "current_gradient_accumulation_steps", None)
        trainer.current_gradient_accumulation_steps = len(samples)
        try:
            for inputs in samples:
                trainer.training_step(work, inputs, items)
        finally:
            trainer.current_gradient_accumulation_steps = saved
        if trainer.args.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(work.parameters(), trainer.args.max_grad_norm)
        opt.step()
        if not isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
            sched.step()
        work.zero_grad()

    return step


def _calling_trainer(callback: TrainerCallback) -> Any:
    """The Trainer whose callbacks hold ``callback``, found among the frames calling it."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            owner = frame.f_locals.get("self")
            if isinstance(owner, Trainer) and any(c is callback for c in owner.callback_handler.callbacks):
                return owner
            frame = frame.f_back
    finally:
        del frame
    raise ValueError("TrainerCheck found no Trainer calling it; pass TrainerCheck(trainer=your_trainer).")


def _columns(batch: Any) -> dict[str, torch.Tensor]:
    if not isinstance(batch, Mapping) or not all(isinstance(v, torch.Tensor) and v.dim() for v in batch.values()):
        raise ValueError(f"TrainerCheck reads batches that are dicts of tensors, got {type(batch).__name__}.")
    return dict(batch)


def _partial(loader: Any, k: int) -> bool:
    """Whether the run's epochs leave a partial window (True when the loader has no length)."""
    try:
        return len(loader) % k != 0
    except TypeError:
        return True


class TrainerCheck(TrainerCallback):
    """Check the run's gradient accumulation when the Trainer begins training, on its own first batch.

    ``loss_fn(logits, labels)``: the full-batch reference, the mean loss of one batch (default: the run's
    ``compute_loss_func`` or the model's ``loss_function``). ``on_bug``: ``"raise"``, ``"stop"``
    (``control.should_training_stop``) or ``"warn"``. ``allow``, ``micro_batch_size``, ``tolerance``: as for
    :class:`~gradaccum.integrations.LightningCheck`. ``trainer``: the Trainer (default: the one calling the
    callback). After the check, ``report`` holds its report."""

    def __init__(
        self,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        *,
        on_bug: str = "raise",
        allow: Sequence[str] = (),
        micro_batch_size: int | None = None,
        tolerance: float | None = None,
        trainer: Any = None,
    ):
        if loss_fn is not None and not callable(loss_fn):
            raise ValueError("loss_fn must be callable as loss_fn(logits, labels), or None for the run's own loss.")
        self.loss_fn, self.trainer = loss_fn, trainer
        self.on_bug, self.allow = options(on_bug, allow, micro_batch_size, tolerance)
        self.micro_batch_size, self.tolerance = micro_batch_size, tolerance
        self.report: Report | None = None

    def on_train_begin(
        self, args: Any, state: Any, control: Any, model: Any = None, train_dataloader: Any = None, **kwargs: Any
    ) -> None:
        trainer = self.trainer or _calling_trainer(self)
        k = int(args.gradient_accumulation_steps)
        loader = getattr(train_dataloader, "base_dataloader", train_dataloader)  # not Accelerate's: no state moves
        batches, n = first_batches(loader, lambda b: len(next(iter(_columns(b).values()))), k, self.micro_batch_size)
        names = list(_columns(batches[0]))
        columns = dict(zip(names, (c.to(args.device) for c in concat([[b[m] for b in batches] for m in names], n))))
        labels = [m for m in trainer.label_names or ["labels"] if m in columns]
        if len(labels) != 1:
            raise ValueError(f"TrainerCheck needs one label column among {names}, found {labels or 'none'}.")
        x = torch.arange(n, dtype=torch.float32, device=args.device).unsqueeze(1)  # exact below 2**24
        self.report = check(
            _Rows(model, columns, labels[0]),
            self.loss_fn or _reference(trainer, model),
            x,
            columns[labels[0]],
            k,
            step=_window_step(trainer, model),
            partial=_partial(train_dataloader, k),
            allow=self.allow,
            tolerance=self.tolerance,
        )
        act(self.report, self.on_bug, lambda: setattr(control, "should_training_stop", True), "TrainerCheck")
