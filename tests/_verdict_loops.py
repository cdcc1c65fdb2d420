"""The loops of the checker's verdict table (tests/test_check_verdicts.py): each builder returns
``(model, loss_fn, x, y, step)`` fresh, so a row runs alone or in any order."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from test_check import _CheckpointedBN  # one copy: test_check.py defines it
from test_check_reader_loops import (  # noqa: F401  (re-exported: the table's rows name them)
    _active_mean,
    _class_weighted,
    _detached_softmax,
    _FeatureMask,
    _loop,
    _lse,
    _per_sample_step,
    _plain_step,
    _rmse,
    _sgd_step,
    _softmax_weighted,
    _squared_mean,
    _token_make,
    _token_mean_step,
    _two_optimizer_step,
    correct,
    make,
    missing_k,
    several,
)
from test_check_zoo import LAMBDA_TOKEN_LOSS, all_cases, char_lm, family, lm_batch, mlp  # noqa: F401
from torch import nn
from torch.nn.utils import clip_grad_norm_
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

from gradaccum.book.models import make_cnn

Built = tuple[nn.Module, Any, torch.Tensor, torch.Tensor, Any]


@functools.cache
def _digits() -> Any:
    from gradaccum.book.data import load_digits_split

    return load_digits_split()


@functools.cache
def _demo() -> dict[str, tuple[Any, ...]]:
    from gradaccum.book import check_demo

    return check_demo.demo_cases()


def demo(name: str) -> Callable[[], Built]:
    """The demo case ``name`` (its clip goes in the row's options)."""
    return lambda: _demo()[name][:5]


@functools.cache
def _zoo() -> dict[tuple[str, str], Any]:
    return {(fam, name): step for fam, name, step, _ in all_cases()}


def zoo(fam: str, name: str) -> Callable[[], Built]:
    """The zoo's loop ``name`` on the model family ``fam``."""
    return lambda: (*family(fam, _digits()), _zoo()[(fam, name)])


def reader_loop(step: Any, make_fn: Callable[[], tuple[Any, ...]] = make) -> Callable[[], Built]:
    """The test float64 MLP (or ``make_fn``'s batch) under ``step``."""
    return lambda: (*make_fn(), step)


def _dropout_mlp(eval_mode: bool = False) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 32), nn.Dropout(0.3), nn.Linear(32, 5)).double()
    return model.eval() if eval_mode else model


class _Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(20, 32).double(), nn.Linear(32, 5).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(self.a(t)), x, use_reentrant=False)
        return self.b(h)


class _CheckpointedDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner = nn.Sequential(nn.Linear(20, 32), nn.Tanh(), nn.Dropout(0.3)).double()
        self.head = nn.Linear(32, 5).double()

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.head(torch.utils.checkpoint.checkpoint(self.inner, t, use_reentrant=False))


class _RDrop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.drop = nn.Linear(20, 32).double(), nn.Linear(32, 5).double(), nn.Dropout(0.3)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        z = self.b(self.drop(torch.tanh(self.a(torch.cat([t, t])))))
        return (z[: len(t)] + z[len(t) :]) / 2


def with_model(model_fn: Callable[[], nn.Module], step: Any = None) -> Callable[[], Built]:
    """The test batch and loss on another model."""

    def build() -> Built:
        _, loss_fn, x, y = make()
        return model_fn(), loss_fn, x, y, step

    return build


def _masked() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 32), _FeatureMask(32), nn.Linear(32, 5)).double()


def strided(model: nn.Module, loss_fn: Any, x: torch.Tensor, y: torch.Tensor, k: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.zero_grad()
    for j in range(k):
        (loss_fn(model(x[j::k]), y[j::k]) / k).backward()
    opt.step()


def two_of_k(model: nn.Module, loss_fn: Any, x: torch.Tensor, y: torch.Tensor, k: int) -> None:
    _sgd_step()(model, loss_fn, x, y, 2)


def one_optimizer_emptied(model: nn.Module, loss_fn: Any, x: torch.Tensor, y: torch.Tensor, k: int) -> None:
    o1 = torch.optim.SGD(model[0].parameters(), lr=0.1)
    o2 = torch.optim.SGD(model[2].parameters(), lr=0.1)
    o1.zero_grad()
    o2.zero_grad()
    for i, (xb, yb) in enumerate(zip(x.chunk(k), y.chunk(k))):
        if i == 2:
            o2.zero_grad()
        (loss_fn(model(xb), yb) / k).backward()
    o1.step()
    o2.step()


def logged_norm(model: nn.Module, loss_fn: Any, x: torch.Tensor, y: torch.Tensor, k: int) -> None:
    _sgd_step(clip_params=lambda m: [m.parameters()])(model, loss_fn, x, y, k)
    clip_grad_norm_(model.parameters(), float("inf"))


def broken(model: nn.Module, loss_fn: Any, x: torch.Tensor, y: torch.Tensor, k: int) -> None:
    for xb, yb in zip(x.chunk(k), y.chunk(k)):
        (loss_fn(model(xb), yb) / k).backward()
        raise KeyError("labels")


def plain(model: nn.Module, loss_fn: Any, x: torch.Tensor, y: torch.Tensor, k: int) -> None:
    for xb, yb in zip(x.chunk(k), y.chunk(k)):
        (loss_fn(model(xb), yb) / k).backward()


def _zero_grad_mlp() -> tuple[Any, ...]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3)).double()
    x, y = torch.randn(16, 8, dtype=torch.float64), torch.randint(0, 3, (16,))
    y[:4] = -100
    return model, nn.CrossEntropyLoss(reduction="sum"), x, y


def summed(step: Any) -> Callable[[], Built]:
    """A float64 MLP whose first micro-batch is all padding, under a summed loss."""
    return lambda: (*_zero_grad_mlp(), step)


def token_lm(step: Any, loss_fn: Any = LAMBDA_TOKEN_LOSS) -> Callable[[], Built]:
    """The tiny character model on sequences of 1–4 and 9–12 tokens."""

    def build() -> Built:
        x, y = lm_batch([1, 2, 3, 4, 9, 10, 11, 12])
        return char_lm(), loss_fn, x, y, step

    return build


def _smoothed(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), t.reshape(-1), ignore_index=0, label_smoothing=0.1)


def token_lm_padding_zero(step: Any) -> Callable[[], Built]:
    def build() -> Built:
        x, y = lm_batch([1, 2, 3, 4, 9, 10, 11, 12])
        y = torch.where(y == -100, torch.full_like(y, 0), y)
        return char_lm(), _smoothed, x, y, step

    return build


def class_weighted() -> Built:
    model, _, x, y = make()
    loss_fn = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 3.0, 0.5, 1.5], dtype=torch.float64))
    return model, loss_fn, x, y, _sgd_step()


def zoo_model(fam: str, step: Any, n: int) -> Callable[[], Built]:
    """The zoo family ``fam``'s model on its first ``n`` samples, under ``step``."""

    def build() -> Built:
        model, loss_fn, x, y = family(fam, _digits())
        return model, loss_fn, x[:n], y[:n], step

    return build


# ---------------------------------------------------------------- loops readers write (test_check_reader_loops.py)


value_subset = _sgd_step(
    clip_params=lambda m: [m[2].parameters()], threshold=0.01, clip_fn=torch.nn.utils.clip_grad_value_
)
value_each = _sgd_step(
    clip_params=lambda m: [m.parameters()], threshold=1e-3, clip_fn=torch.nn.utils.clip_grad_value_, clip_each=True
)
running_each = _sgd_step(clip_params=lambda m: [m.parameters()], threshold=0.05, clip_each=True)


def low_precision(dtype: torch.dtype, step: Any = None) -> Callable[[], Built]:
    """A small MLP in bf16 or fp16 (K = 8)."""

    def build() -> Built:
        torch.manual_seed(0)
        x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
        model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 3)).to(dtype)
        return model, nn.CrossEntropyLoss(), x.to(dtype), y, step

    return build


def at_optimum(dtype: torch.dtype, shift: float = 0.0, step: Any = None) -> Callable[[], Built]:
    """A linear model at (or ``shift`` off) the least-squares optimum: the micro-batch gradients cancel."""

    def build() -> Built:
        torch.manual_seed(0)
        x = torch.randn(32, 5, dtype=dtype)
        y = x @ torch.randn(5, 1, dtype=dtype) + 0.3 * torch.randn(32, 1, dtype=dtype)
        solution = torch.linalg.lstsq(torch.cat([x, torch.ones(32, 1, dtype=dtype)], 1), y).solution
        model = nn.Linear(5, 1).to(dtype)
        with torch.no_grad():
            model.weight.copy_(solution[:5].T)
            model.bias.copy_(solution[5] + shift)
        return model, nn.MSELoss(), x, y, step

    return build


def tanh_mlp(step: Any) -> Callable[[], Built]:
    def build() -> Built:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
        xs, ys = torch.randn(16, 6, dtype=torch.float64), torch.randint(0, 3, (16,))
        return model, nn.CrossEntropyLoss(), xs, ys, step

    return build


def _ignore(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(o, t, ignore_index=-100)


def padded(step: Any, first: int = 5, rows: slice | None = None) -> Callable[[], Built]:
    """The test MLP with padding targets (-100): the first ``first`` rows, or ``rows``."""

    def build() -> Built:
        model, _, x, y = make()
        y = y.clone()
        y[rows if rows is not None else slice(0, first)] = -100
        return model, _ignore, x, y, step

    return build


def token_sum_running_clip(model: nn.Module, loss_fn: Any, x: torch.Tensor, y: torch.Tensor, k: int) -> None:
    n = int((y != -100).sum())
    for xb, yb in zip(x.chunk(k), y.chunk(k)):
        (F.cross_entropy(model(xb), yb, ignore_index=-100, reduction="sum") / n).backward()
        clip_grad_norm_(model.parameters(), 0.05)


def duplicated(step: Any) -> Callable[[], Built]:
    """The test first 8 samples twice (K = 2: two equal micro-batches)."""

    def build() -> Built:
        model, loss_fn, x, y = make()
        return model, loss_fn, torch.cat([x[:8], x[:8]]), torch.cat([y[:8], y[:8]]), step

    return build


def per_micro_clip(model: nn.Module, loss_fn: Any, x: torch.Tensor, y: torch.Tensor, k: int) -> None:
    total = [torch.zeros_like(p) for p in model.parameters()]
    for xb, yb in zip(x.chunk(k), y.chunk(k)):
        model.zero_grad()
        (loss_fn(model(xb), yb) / k).backward()
        clip_grad_norm_(model.parameters(), 0.05)
        for t, p in zip(total, model.parameters()):
            t += p.grad
    for t, p in zip(total, model.parameters()):
        p.grad = t


def padding_no_k_running_clip(model: nn.Module, loss_fn: Any, x: torch.Tensor, y: torch.Tensor, k: int) -> None:
    for xb, yb in zip(x.chunk(k), y.chunk(k)):
        loss = F.cross_entropy(model(xb), yb, ignore_index=-100, reduction="sum") / max(int((yb != -100).sum()), 1)
        loss.backward()
        clip_grad_norm_(model.parameters(), 0.05)


def padded_token_make() -> tuple[Any, ...]:
    model, loss_fn, x, y = _token_make()
    y = y.clone()
    y[8:16] = -100
    return model, loss_fn, x, y


def coupled_loss(loss_fn: Any, seed: int, dtype: torch.dtype) -> Callable[[], Built]:
    """A tanh MLP on 24 samples under a loss whose micro-batch weights follow the outputs (or not)."""

    def build() -> Built:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(24, 20, generator=g, dtype=dtype)
        y = torch.randint(0, 5, (24,), generator=g)
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(20, 16), nn.Tanh(), nn.Linear(16, 5)).to(dtype)
        return model, loss_fn, x, y, None

    return build


COUPLED_LOSSES = {
    "lse": _lse,
    "softmax-weighted": _softmax_weighted,
    "squared mean": _squared_mean,
    "detached softmax": _detached_softmax,
    "rmse": _rmse,
    "cross entropy": F.cross_entropy,
    "class-weighted": _class_weighted,
    "active mean": _active_mean,
}


def _plain_opt(
    model: nn.Module, loss_fn: Any, x: torch.Tensor, y: torch.Tensor, k: int, extra: Any = None, after: Any = None
) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.zero_grad()
    for xb, yb in zip(x.chunk(k), y.chunk(k)):
        (loss_fn(model(xb), yb) / k + (extra() if extra else 0)).backward()
    opt.step()
    if after:
        after(model, x)


def zero_grad_before_step(model: nn.Module, loss_fn: Any, x: torch.Tensor, y: torch.Tensor, k: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plain(model, loss_fn, x, y, k)
    opt.zero_grad()
    opt.step()


def skip_non_finite(model: nn.Module, loss_fn: Any, x: torch.Tensor, y: torch.Tensor, k: int) -> None:
    for xb, yb in zip(x.chunk(k), y.chunk(k)):
        loss = loss_fn(model(xb), yb)
        if torch.isfinite(loss):
            (loss / k).backward()


def all_padding_plain() -> Built:
    model, _, x, y = make()
    y = y.clone()
    y[8:16] = -100
    return model, F.cross_entropy, x, y, skip_non_finite


def float32_token_imbalance() -> Built:
    torch.manual_seed(0)
    vocab = 11
    x, y = torch.randint(0, vocab, (8, 50)), torch.randint(0, vocab, (8, 50))
    y[0, -1] = -100
    torch.manual_seed(3)
    model = nn.Sequential(nn.Embedding(vocab, 16), nn.Tanh(), nn.Linear(16, vocab))

    def token_ce(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(o.reshape(-1, vocab), t.reshape(-1), ignore_index=-100)

    return model, token_ce, x, y, plain


def bf16_autocast(bug: str) -> Callable[[], Built]:
    """A float32 MLP under bf16 autocast; ``bug``: "reset" (zero_grad each micro-batch) or "skip" (the last)."""

    def step(model: nn.Module, loss_fn: Any, x: torch.Tensor, y: torch.Tensor, k: int) -> None:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        opt.zero_grad()
        for j, (xb, yb) in enumerate(zip(x.chunk(k), y.chunk(k))):
            if bug == "skip" and j == k - 1:
                break
            if bug == "reset":
                opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(xb)
            (loss_fn(out.float(), yb) / k).backward()
        opt.step()

    def build() -> Built:
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(16, 6, generator=g), torch.randint(0, 4, (16,), generator=g)
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))
        return model, F.cross_entropy, x, y, step

    return build


def selecting(pick: str) -> Callable[[], Built]:
    def loss_fn(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        each = F.cross_entropy(o, t, reduction="none")
        return {"max": each.max(), "min": each.min(), "top1": each.topk(1).values.mean()}[pick]

    return lambda: (*make()[:1], loss_fn, *make()[2:], None)


def by_hand(scale: float) -> Any:
    def step(model: nn.Module, loss_fn: Any, x: torch.Tensor, y: torch.Tensor, k: int) -> None:
        for xb, yb in zip(x.chunk(k), y.chunk(k)):
            (loss_fn(model(xb), yb) * scale / k).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
        model.zero_grad()

    return step


class _MySGD(torch.optim.Optimizer):
    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(opt, closure: Any = None) -> None:  # type: ignore[override]  # noqa: N805
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


def own_optimizer(inside: bool) -> Any:
    def step(model: nn.Module, loss_fn: Any, x: torch.Tensor, y: torch.Tensor, k: int) -> None:
        opt = _MySGD(model.parameters(), 0.1)
        opt.zero_grad()
        for xb, yb in zip(x.chunk(k), y.chunk(k)):
            (loss_fn(model(xb), yb) / k).backward()
            if inside:
                opt.step()
        if not inside:
            opt.step()
        opt.zero_grad()

    return step


def autocast_scheduler_each() -> Built:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))

    def step(model: nn.Module, loss_fn: Any, x: torch.Tensor, y: torch.Tensor, k: int) -> None:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1)
        opt.zero_grad()
        for xb, yb in zip(x.chunk(k), y.chunk(k)):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(xb)
            (loss_fn(out.float(), yb) / k).backward()
            sched.step()
        opt.step()

    return model, F.cross_entropy, x, y, step


class _OwnDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(20, 5).double()
        self.g = torch.Generator().manual_seed(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x * torch.bernoulli(torch.full_like(x, 0.7), generator=self.g) / 0.7)


def _accuracy(model: nn.Module, x: torch.Tensor) -> None:
    with torch.no_grad():
        model(x).argmax(1)


def with_accuracy(model: nn.Module, loss_fn: Any, x: torch.Tensor, y: torch.Tensor, k: int) -> None:
    _plain_opt(model, loss_fn, x, y, k, after=_accuracy)


def out_of_range(dtype: torch.dtype, scale: float) -> Callable[[], Built]:
    def build() -> Built:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 1)).to(dtype)
        x, y = torch.randn(16, 5, dtype=dtype), torch.randn(16, 1, dtype=dtype)
        return model, lambda out, t: F.mse_loss(out, t) * scale, x, y, None

    return build


def tanh_mlp10(step: Any) -> Callable[[], Built]:
    def build() -> Built:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 4)).double()
        x, y = torch.randn(32, 10, dtype=torch.float64), torch.randint(0, 4, (32,))
        return model, nn.CrossEntropyLoss(), x, y, step

    return build


def l2_in_the_loss(model: nn.Module, loss_fn: Any, x: torch.Tensor, y: torch.Tensor, k: int) -> None:
    for xb, yb in zip(x.chunk(k), y.chunk(k)):
        l2 = sum((p * p).sum() for p in model.parameters())
        ((loss_fn(model(xb), yb) + 1e-2 * l2) / k).backward()


def _l1_in_the_loss(model: nn.Module, loss_fn: Any, x: torch.Tensor, y: torch.Tensor, k: int) -> None:
    for xb, yb in zip(x.chunk(k), y.chunk(k)):
        l1 = sum(p.abs().sum() for p in model.parameters())
        ((loss_fn(model(xb), yb) + 1e-2 * l1) / k).backward()


def decay_by_hand(where: str, scale: float = 1.0, weights_only: bool = False) -> Any:
    """SGD with ``p.grad += wd * p`` added by hand: once before the step (``where="once"``) or after every
    backward (``"micro"``); ``weights_only``: biases spared; ``scale``: the loss times scale / K."""

    def step(model: nn.Module, loss_fn: Any, x: torch.Tensor, y: torch.Tensor, k: int) -> None:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        opt.zero_grad()
        decayed = [p for name, p in model.named_parameters() if not weights_only or name.endswith("weight")]

        def add() -> None:
            with torch.no_grad():
                for p in decayed:
                    p.grad += 5e-3 * p

        for xb, yb in zip(x.chunk(k), y.chunk(k)):
            (loss_fn(model(xb), yb) * scale / k).backward()
            if where == "micro":
                add()
        if where == "once":
            add()
        opt.step()

    return step


def averaged(per_micro_batch: bool, how: str = "AveragedModel") -> Any:
    """SGD with a model average updated after every backward or once after the step: ``AveragedModel`` (EMA
    decay 0.99), or an EMA written by hand with ``lerp_``, ``mul_().add_()`` or ``torch._foreach_lerp_``."""

    def update(avg: Any, model: nn.Module) -> None:
        if how == "AveragedModel":
            avg.update_parameters(model)
            return
        with torch.no_grad():
            pairs = list(zip(avg.parameters(), model.parameters()))
            if how == "lerp":
                for e, p in pairs:
                    e.lerp_(p, 0.01)
            elif how == "mul_add":
                for e, p in pairs:
                    e.mul_(0.99).add_(p, alpha=0.01)
            else:
                torch._foreach_lerp_([e for e, _ in pairs], [p for _, p in pairs], 0.01)

    def step(model: nn.Module, loss_fn: Any, x: torch.Tensor, y: torch.Tensor, k: int) -> None:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ema = (
            torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.99))
            if how == "AveragedModel"
            else copy.deepcopy(model)
        )
        opt.zero_grad()
        for xb, yb in zip(x.chunk(k), y.chunk(k)):
            (loss_fn(model(xb), yb) / k).backward()
            if per_micro_batch:
                update(ema, model)
        opt.step()
        if not per_micro_batch:
            update(ema, model)

    return step


def own_gradient_buffer(model: nn.Module, loss_fn: Any, x: torch.Tensor, y: torch.Tensor, k: int) -> None:
    """A correct loop that accumulates into buffers of its own with in-place adds (not an average of the weights)."""
    buffers = [torch.zeros_like(p) for p in model.parameters()]
    for xb, yb in zip(x.chunk(k), y.chunk(k)):
        model.zero_grad()
        (loss_fn(model(xb), yb) / k).backward()
        for buf, p in zip(buffers, model.parameters()):
            buf.add_(p.grad)
    for buf, p in zip(buffers, model.parameters()):
        p.grad = buf.clone()
    torch.optim.SGD(model.parameters(), lr=0.1).step()


# ---------------------------------------------------------------- the reports (test_check.py)


def digits_model(
    model_fn: Callable[[], nn.Module], step: Any, n: int, loss_fn: Any = None, dtype: torch.dtype | None = None
) -> Callable[[], Built]:
    """``model_fn()`` on the first ``n`` digits (cross entropy unless ``loss_fn``)."""

    def build() -> Built:
        d = _digits()
        x, y = d.x_train[:n], d.y_train[:n]
        model = model_fn()
        if dtype is not None:
            model, x = model.to(dtype), x.to(dtype)
        return model, loss_fn or nn.CrossEntropyLoss(), x, y, step

    return build


def other_model_step() -> Any:
    other = make_cnn("group")

    def step(model: nn.Module, loss_fn: Any, x: torch.Tensor, y: torch.Tensor, k: int) -> None:
        for xb, yb in zip(x.chunk(k), y.chunk(k)):
            (loss_fn(other(xb), yb) / k).backward()

    return step


class _Centre(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h - h.mean(0, keepdim=True)


def centred() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), _Centre(), nn.Tanh(), nn.Linear(16, 10)).double()


def contrastive(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    z = F.normalize(out, dim=1)
    return F.cross_entropy(z @ z.T / 0.1, torch.arange(out.shape[0]))


def strict(model: nn.Module, loss_fn: Any, x: torch.Tensor, y: torch.Tensor, k: int) -> None:
    if k != 4:
        raise ValueError("this loop always runs 4 micro-batches")
    plain(model, loss_fn, x, y, k)


def bf16(divide: bool) -> Any:
    def step(model: nn.Module, loss_fn: Any, x: torch.Tensor, y: torch.Tensor, k: int) -> None:
        for xb, yb in zip(x.chunk(k), y.chunk(k)):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_fn(model(xb), yb) / (k if divide else 1)
            loss.backward()

    return step


def overflow(model: nn.Module, loss_fn: Any, x: torch.Tensor, y: torch.Tensor, k: int) -> None:
    for xb, yb in zip(x.chunk(k), y.chunk(k)):
        (loss_fn(model(xb), yb) * float("inf")).backward()


def optimizer_outside() -> Built:
    d = _digits()
    model = make_cnn("group")
    opt = torch.optim.SGD(model.parameters(), lr=1.0, weight_decay=0.5)

    def step(m: nn.Module, loss_fn: Any, x: torch.Tensor, y: torch.Tensor, k: int) -> None:
        plain(m, loss_fn, x, y, k)
        opt.step()

    return model, nn.CrossEntropyLoss(), d.x_train[:8], d.y_train[:8], step


def eight_chunks(model: nn.Module, loss_fn: Any, x: torch.Tensor, y: torch.Tensor, k: int) -> None:
    for xb, yb in zip(x.chunk(2 * k), y.chunk(2 * k)):
        (loss_fn(model(xb), yb) / (2 * k)).backward()


class _Noisy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(64, 16), nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x.flatten(1))
        return self.b(torch.tanh(h + torch.rand(16, dtype=h.dtype)))


def noisy() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return _Noisy().double()


def clip_scaled_inside(model: nn.Module, loss_fn: Any, x: torch.Tensor, y: torch.Tensor, k: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    for xb, yb in zip(x.chunk(k), y.chunk(k)):
        scaler.scale(loss_fn(model(xb), yb) / k).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()


def checkpoint_whole_model(model: nn.Module, loss_fn: Any, xs: torch.Tensor, ys: torch.Tensor, k: int) -> None:
    for xb, yb in zip(xs.chunk(k), ys.chunk(k)):
        (loss_fn(checkpoint(model, xb, use_reentrant=False), yb) / k).backward()


def checkpointed_bn(step: Any = None, **options: Any) -> Callable[[], Built]:
    def build() -> Built:
        x, y = torch.randn(16, 4, generator=torch.Generator().manual_seed(1)), torch.arange(16) % 3
        return _CheckpointedBN(**options), nn.CrossEntropyLoss(), x, y, step

    return build


def checkpointed(preserve: bool) -> Any:
    def step(model: nn.Module, loss_fn: Any, xs: torch.Tensor, ys: torch.Tensor, k: int) -> None:
        for xb, yb in zip(xs.chunk(k), ys.chunk(k)):
            out = checkpoint(model, xb, use_reentrant=False, preserve_rng_state=preserve)
            (loss_fn(out, yb) / k).backward()

    return step


def loss_unpreserved(model: nn.Module, loss_fn: Any, xs: torch.Tensor, ys: torch.Tensor, k: int) -> None:
    for xb, yb in zip(xs.chunk(k), ys.chunk(k)):
        out = checkpoint(model, xb, use_reentrant=False)
        (checkpoint(loss_fn, out, yb, use_reentrant=False, preserve_rng_state=False) / k).backward()


def sequential_unpreserved(model: nn.Module, loss_fn: Any, xs: torch.Tensor, ys: torch.Tensor, k: int) -> None:
    for xb, yb in zip(xs.chunk(k), ys.chunk(k)):
        out = checkpoint_sequential(model, 2, xb, use_reentrant=False, preserve_rng_state=False)
        (loss_fn(out, yb) / k).backward()


def _ck_mlp(p: float) -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(p), nn.Linear(16, 3)).double()


def _ck_deep(p: float) -> nn.Module:
    return nn.Sequential(
        nn.Linear(8, 16), nn.Dropout(p), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)
    ).double()


class _Inside(nn.Module):
    def __init__(self, preserve: bool) -> None:
        super().__init__()
        self.body, self.preserve = _ck_mlp(0.3), preserve

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.body, t, use_reentrant=False, preserve_rng_state=self.preserve)


def rng_checkpoint(model: str, step: Any = None) -> Callable[[], Built]:
    """The checkpoint-RNG models: "dropout"/"plain" (6 → 8 → 3), "mlp"/"deep" with p = 0.3 or "deep0", "inside"
    with preserve_rng_state False/True ("inside-kept")."""

    def build() -> Built:
        torch.manual_seed(0)
        if model in ("dropout", "plain"):
            x, y = torch.randn(16, 6, dtype=torch.float64), torch.randint(0, 3, (16,))
            layers = [nn.Linear(6, 8), nn.ReLU()] + ([nn.Dropout(0.3)] if model == "dropout" else [])
            return nn.Sequential(*layers, nn.Linear(8, 3)).double(), nn.CrossEntropyLoss(), x, y, step
        x, y = torch.randn(16, 8, dtype=torch.float64), torch.randint(0, 3, (16,))
        made = {
            "mlp": lambda: _ck_mlp(0.3),
            "deep": lambda: _ck_deep(0.3),
            "deep0": lambda: _ck_deep(0.0),
            "inside": lambda: _Inside(False),
            "inside-kept": lambda: _Inside(True),
        }[model]()
        return made, nn.CrossEntropyLoss(), x, y, step

    return build


def _zoo_step(name: str) -> Any:
    """The zoo's loop ``name`` (any family)."""
    return next(step for (_, loop), step in _zoo().items() if loop == name)
