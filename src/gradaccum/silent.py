r"""Chapter 6: the other silent bugs — token-level loss normalization, dropout seeds, step counting,
the last partial window, and logging the loss of a window.

**Token-level normalization.** A language-model loss is a mean over *tokens*. Micro-batch k holds
:math:`n_k` tokens with summed loss :math:`x_k`; the loss of the window is :math:`\sum_k x_k/\sum_k n_k`. Averaging
per-micro-batch means gives :math:`\frac1K\sum_k x_k/n_k`, which weighs a token of a short micro-batch more than a
token of a long one. The fix: sum the loss and divide by the number of tokens in the whole window
(Hugging Face's ``num_items_in_batch``), and across ranks by the all-reduced count.

**Dropout.** Each micro-batch draws its own masks, which are different draws from the ones a single full-batch
pass would draw; every mask entry is still Bernoulli(1 − p) and independent, so the accumulated gradient has the
full-batch gradient's *distribution* (the same expectation over masks), not its value. Re-seeding the generator
per micro-batch index repeats masks from window to window: that is the bug.

**A last partial window** of :math:`k' < K` micro-batches divided by K has gradient
:math:`\frac{k'}{K}\bar g` (:math:`\bar g` the mean gradient of its samples). Plain SGD's step shrinks by the same
factor. Adam divides by the root of a running mean of squared gradients: its first step is invariant to the
gradient's scale, and early in training (a second-moment estimate built from few steps) it nearly undoes the
shrink; once that estimate reflects many earlier, full-size gradients, the step shrinks noticeably (how much depends
on the model and on how long Adam has run).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ._validate import require_k
from .accumulate import flat_grad, split_batch

IGNORE = -100  # target of padding positions: cross_entropy(ignore_index=IGNORE) skips them


# ------------------------------------------------------------------------------------------ the corpus


def load_corpus() -> list[str]:
    """The lines of the text shipped with the package (the Zen of Python and sentences of the book's
    introduction), 52 lines of 19 to 157 characters."""
    text = resources.files("gradaccum.book").joinpath("corpus.txt").read_text(encoding="utf-8")
    return [line for line in text.splitlines() if line and not line.startswith("#")]


@dataclass(frozen=True)
class Vocab:
    """Characters ↔ ids; id 0 is padding."""

    chars: str

    def encode(self, line: str) -> list[int]:
        return [self.chars.index(c) + 1 for c in line]

    @property
    def size(self) -> int:
        return len(self.chars) + 1


def make_vocab(lines: Sequence[str]) -> Vocab:
    return Vocab("".join(sorted(set("".join(lines)))))


def encode_batch(lines: Sequence[str], vocab: Vocab) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-character targets, right-padded to the longest line; padding targets are ``IGNORE``."""
    if not lines:
        raise ValueError("need at least one line.")
    width = max(len(line) for line in lines) - 1
    if width < 1:
        raise ValueError("every line needs at least two characters.")
    x = torch.zeros(len(lines), width, dtype=torch.long)
    y = torch.full((len(lines), width), IGNORE, dtype=torch.long)
    for i, line in enumerate(lines):
        ids = torch.tensor(vocab.encode(line))
        x[i, : len(ids) - 1] = ids[:-1]
        y[i, : len(ids) - 1] = ids[1:]
    return x, y


class TinyLM(nn.Module):
    """A character model that predicts the next character from the last three (a causal convolution)."""

    def __init__(self, vocab_size: int, dim: int = 16, hidden: int = 64, context: int = 3):
        super().__init__()
        self.context = context
        self.embed = nn.Embedding(vocab_size, dim)
        self.conv = nn.Conv1d(dim, hidden, context)
        self.out = nn.Linear(hidden, vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x).transpose(1, 2)  # (N, dim, T)
        h = F.pad(h, (self.context - 1, 0))  # causal: position t sees t-2..t
        return self.out(torch.relu(self.conv(h)).transpose(1, 2))  # (N, T, vocab)


def make_lm(vocab: Vocab, seed: int = 0, dtype: torch.dtype = torch.float64) -> TinyLM:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TinyLM(vocab.size).to(dtype)


def token_loss(logits: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy over the non-padding tokens (mean or sum)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=IGNORE,
                           reduction=reduction)


def count_tokens(y: torch.Tensor) -> int:
    return int((y != IGNORE).sum())


Normalization = Literal["mean_of_means", "window_tokens"]


def window_backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor, k: int,
                    normalization: Normalization = "window_tokens", total_tokens: int | None = None) -> float:
    """One window's backward passes for a token-level loss; gradients are added to ``.grad``.

    ``mean_of_means``: each micro-batch's mean token loss divided by K (what a generic accumulation loop does).
    ``window_tokens``: each micro-batch's *summed* token loss divided by the tokens of the whole window —
    ``total_tokens`` if given (e.g. all-reduced across ranks), else counted here. Returns the window's loss as
    the chosen normalization defines it.
    """
    micro = split_batch(x, y, k)
    if normalization == "window_tokens":
        total = total_tokens if total_tokens is not None else sum(count_tokens(yb) for _, yb in micro)
        if total < 1:
            raise ValueError("the window holds no tokens to average over.")
    elif normalization != "mean_of_means":
        raise ValueError(f"unknown normalization {normalization!r}; use 'mean_of_means' or 'window_tokens'.")
    value = 0.0
    for xb, yb in micro:
        if normalization == "mean_of_means":
            if count_tokens(yb) == 0:
                raise ValueError("a micro-batch holds only padding: its mean loss is undefined (NaN).")
            loss = token_loss(model(xb), yb) / k
        else:
            loss = token_loss(model(xb), yb, "sum") / total
        loss.backward()
        value += float(loss.detach())
    return value


def window_gradient(model: nn.Module, x: torch.Tensor, y: torch.Tensor, k: int, normalization: Normalization) -> torch.Tensor:
    work = copy.deepcopy(model)
    work.zero_grad(set_to_none=True)
    window_backward(work, x, y, k, normalization)
    return flat_grad(work).detach()


def token_mean_gradient(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The reference: the gradient of the mean over all tokens of the batch, in one pass."""
    return window_gradient(model, x, y, 1, "window_tokens")


def spread_lines(lines: Sequence[str], n: int, center: int, spread: int, seed: int = 0,
                 sort: bool = False) -> list[str]:
    """n lines cut to lengths drawn uniformly from [center − spread, center + spread] (sorted by length if
    ``sort``, which makes micro-batches of similar length, as length-grouped batching does)."""
    if not 0 <= spread < center:
        raise ValueError(f"need 0 <= spread < center, got spread={spread}, center={center}.")
    long = [line for line in lines if len(line) >= center + spread]
    if not long:
        raise ValueError(f"no line is {center + spread} characters long; lower center or spread.")
    rng = np.random.default_rng(seed)
    lengths = rng.integers(center - spread, center + spread + 1, size=n)
    picks = rng.integers(0, len(long), size=n)
    cut = [long[p][:length] for p, length in zip(picks, lengths)]
    return sorted(cut, key=len) if sort else cut


def ranks_gradient(model: nn.Module, x: torch.Tensor, y: torch.Tensor, p: int, k: int, global_count: bool) -> torch.Tensor:
    """What DDP would apply with p ranks (equal shares of the batch), K micro-batches each, token-sum loss.

    Each rank divides by its own token count (``global_count=False``) or by the all-reduced count of all ranks,
    times p because DDP *averages* gradients over ranks (``global_count=True``). Simulated in one process.
    """
    require_k(p)
    shares = split_batch(x, y, p)
    total = sum(count_tokens(ys) for _, ys in shares)  # what an all-reduce of the counts gives every rank
    grads = []
    for xs, ys in shares:
        work = copy.deepcopy(model)
        work.zero_grad(set_to_none=True)
        if global_count:
            window_backward(work, xs, ys, k, "window_tokens", total_tokens=total)
            grads.append(flat_grad(work).detach() * p)  # × p undoes DDP's average over ranks
        else:
            window_backward(work, xs, ys, k, "window_tokens")  # divides by this rank's own count
            grads.append(flat_grad(work).detach())
    return torch.stack(grads).mean(0)  # DDP's average over ranks


# ---------------------------------------------------------------------------------------------- dropout


def dropout_masks(steps: int, k: int, shape: tuple[int, ...], p: float = 0.5, reset_seed: bool = False,
                  seed: int = 0) -> torch.Tensor:
    """The dropout masks a loop draws: (steps, K, *shape). With ``reset_seed`` the loop calls
    ``torch.manual_seed(seed + micro_index)`` before each micro-batch, the bug this chapter shows."""
    require_k(k)
    if not 0 < p < 1:
        raise ValueError(f"dropout probability must lie in (0, 1), got {p}.")
    layer = nn.Dropout(p).train()
    masks = torch.empty(steps, k, *shape)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for s in range(steps):
            for i in range(k):
                if reset_seed:
                    torch.manual_seed(seed + i)
                masks[s, i] = (layer(torch.ones(shape)) != 0).float()
    return masks


def mask_agreement(masks: torch.Tensor) -> tuple[float, float]:
    """Share of positions where a micro-batch's mask equals the one of the same micro index one step earlier,
    and the same for two different micro indices in one step (0.5 for independent masks with p = 0.5)."""
    same_index = (masks[1:] == masks[:-1]).float().mean()
    other_index = (masks[:, 1:] == masks[:, :-1]).float().mean()
    return float(same_index), float(other_index)


def dropout_mlp(layers: int, p: float = 0.3, hidden: int = 32, seed: int = 0) -> nn.Sequential:
    """An MLP for the 8×8 digits (float64) with ``layers`` = 1 or 2 dropout layers:
    Flatten → Linear(64, h) → ReLU → Dropout [→ Linear(h, h) → ReLU → Dropout] → Linear(h, 10).
    The weights depend only on ``seed``."""
    if layers not in (1, 2):
        raise ValueError(f"layers must be 1 or 2 (dropout layers in the MLP), got {layers!r}.")
    if not 0 < p < 1:
        raise ValueError(f"dropout probability must lie in (0, 1), got {p}.")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        mods: list[nn.Module] = [nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Dropout(p)]
        if layers == 2:
            mods += [nn.Linear(hidden, hidden), nn.ReLU(), nn.Dropout(p)]
        mods.append(nn.Linear(hidden, 10))
        return nn.Sequential(*mods).double().train()


def dropout_gradient(model: nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor, k: int, seed: int) -> torch.Tensor:
    """The gradient of one window of K micro-batches (each loss / K; K = 1 is the full batch) with the random
    generator seeded once with ``seed`` before the window, i.e. for one draw of the dropout masks. Runs on a copy;
    the caller's random state is restored."""
    work = copy.deepcopy(model)
    work.zero_grad(set_to_none=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for xb, yb in split_batch(x, y, k):
            (loss_fn(work(xb), yb) / k).backward()
    return flat_grad(work).detach()


@dataclass(frozen=True)
class DropoutComparison:
    r"""Full-batch vs accumulated gradients of a model with dropout.

    ``same_seed``: relative error between the two when both start from the same seed; ``single_draw``: the same for
    two independent seeds; ``mean_gap``: relative difference between their means over ``draws`` seeds each;
    ``noise``: the size ``mean_gap`` has from sampling alone when both have the same distribution,
    :math:`\sqrt{(\operatorname{tr}\Sigma_{\text{full}} + \operatorname{tr}\Sigma_{\text{acc}})/\text{draws}}\,/\,
    \lVert\text{mean}_{\text{full}}\rVert`.
    """

    same_seed: float
    single_draw: float
    mean_gap: float
    noise: float
    draws: int


def compare_dropout(model: nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor, k: int, draws: int = 200,
                    seed: int = 0) -> DropoutComparison:
    """Compare full-batch and K-micro-batch gradients under dropout: one seed, independent seeds, and the means
    over ``draws`` independent seeds each (full batch: seeds ``seed + 1 …``; accumulated: ``seed + 1 + draws …``)."""
    require_k(k)
    if draws < 2:
        raise ValueError(f"need at least 2 draws to estimate a spread, got {draws}.")
    rel = lambda a, b: float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(a))  # noqa: E731
    full = torch.stack([dropout_gradient(model, loss_fn, x, y, 1, seed + 1 + i) for i in range(draws)])
    acc = torch.stack([dropout_gradient(model, loss_fn, x, y, k, seed + 1 + draws + i) for i in range(draws)])
    same = rel(dropout_gradient(model, loss_fn, x, y, 1, seed), dropout_gradient(model, loss_fn, x, y, k, seed))
    mean_full = full.mean(0)
    noise = float(torch.sqrt((full.var(0).sum() + acc.var(0).sum()) / draws) / torch.linalg.vector_norm(mean_full))
    return DropoutComparison(same, rel(full[0], acc[0]), rel(mean_full, acc.mean(0)), noise, draws)


# ----------------------------------------------------------------------------------------- step counting


def lr_trajectory(optimizer_steps: int, k: int, warmup: int, per_micro: bool,
                  lr: float = 1.0) -> tuple[list[float], list[str]]:
    """The learning rate each *optimizer step* uses under a linear warmup of ``warmup`` steps
    (``LambdaLR``), when ``scheduler.step()`` is called per optimizer step or, wrongly, per micro-batch; and the
    warnings PyTorch raised along the way."""
    import warnings

    require_k(k)
    if warmup < 1:
        raise ValueError(f"warmup must be >= 1 step, got {warmup}.")
    param = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: min(1.0, (t + 1) / warmup))
    used = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(optimizer_steps):
            for _ in range(k):
                if per_micro:
                    sched.step()
            used.append(opt.param_groups[0]["lr"])
            opt.step()
            if not per_micro:
                sched.step()
    return used, [str(w.message).split(". ")[0] for w in caught]


def scheduler_order_warnings(k: int, windows: int, optimizer_first: bool) -> list[str]:
    """The warnings PyTorch raises for a loop that (wrongly) calls ``scheduler.step()`` after every micro-batch and
    ``optimizer.step()`` once per window, K·windows scheduler steps in all. With ``optimizer_first`` one optimizer
    step runs before the loop (as in a loop whose first scheduler step follows an optimizer step). PyTorch checks
    the order only at the scheduler's first ``step()``."""
    import warnings

    require_k(k)
    param = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if optimizer_first:
            opt.step()
        for _ in range(windows):
            for _ in range(k):
                sched.step()
            opt.step()
    return [str(w.message).split(". ")[0] for w in caught]


def adam_step_count(windows: int, k: int, step_per_micro: bool) -> int:
    """Adam's ``state['step']`` after ``windows`` accumulation windows (it drives the bias correction
    1/(1 − β^t)); stepping per micro-batch advances it K times per window."""
    param = nn.Parameter(torch.zeros(3))
    opt = torch.optim.Adam([param], lr=1e-3)
    for _ in range(windows):
        for _ in range(k):
            param.grad = torch.ones(3)
            if step_per_micro:
                opt.step()
        if not step_per_micro:
            opt.step()
    return int(opt.state[param]["step"])


PartialPolicy = Literal["divide_by_K", "divide_by_actual", "drop"]


def partial_window_gradient(model: nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor, b: int, k: int,
                            policy: PartialPolicy) -> torch.Tensor | None:
    """Gradient of a last window that holds only ``len(x)/b < K`` micro-batches of b.

    ``divide_by_K`` keeps the 1/K factor of full windows (Lightning's behaviour reported in #19987), so the
    gradient is k'/K of the mean; ``divide_by_actual`` divides by the k' micro-batches present (the mean over
    the samples seen); ``drop`` skips the window (returns None).
    """
    require_k(k)
    if x.shape[0] % b:
        raise ValueError(f"the partial window's {x.shape[0]} samples are not whole micro-batches of {b}.")
    present = x.shape[0] // b
    if not 1 <= present < k:
        raise ValueError(f"a partial window holds between 1 and K − 1 = {k - 1} micro-batches, got {present}.")
    if policy == "drop":
        return None
    divisor = {"divide_by_K": k, "divide_by_actual": present}.get(policy)
    if divisor is None:
        raise ValueError(f"unknown policy {policy!r}; use 'divide_by_K', 'divide_by_actual' or 'drop'.")
    work = copy.deepcopy(model)
    work.zero_grad(set_to_none=True)
    for xb, yb in split_batch(x, y, present):
        (loss_fn(work(xb), yb) / divisor).backward()
    return flat_grad(work).detach()


OptimizerName = Literal["sgd", "momentum", "adam"]


def _make_optimizer(name: str, params, lr: float) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    raise ValueError(f"unknown optimizer {name!r}; use 'sgd', 'momentum' (SGD with momentum 0.9) or 'adam'.")


def partial_step_ratio(model: nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor, b: int, k: int, present: int,
                       optimizer: OptimizerName, lr: float, warm_windows: int = 0, seed: int = 0) -> float:
    r"""How much smaller the optimizer's *step* is when a last window of ``present`` < K micro-batches is divided
    by K instead of by ``present``: :math:`\lVert\Delta\theta_{/K}\rVert / \lVert\Delta\theta_{/k'}\rVert`.

    First ``warm_windows`` full windows (K micro-batches of b samples drawn at random from x, y) train a copy of
    the model; both variants of the partial window then start from that same model and optimizer state. Plain SGD
    gives exactly k'/K; SGD with momentum and Adam mix the partial gradient into running averages (Adam's first
    step is invariant to the gradient's scale).
    """
    require_k(k)
    if not 1 <= present < k:
        raise ValueError(f"a partial window holds between 1 and K − 1 = {k - 1} micro-batches, got {present}.")
    if b * k > x.shape[0]:
        raise ValueError(f"a full window needs K·b = {k * b} samples, but only {x.shape[0]} were given.")
    work = copy.deepcopy(model)
    opt = _make_optimizer(optimizer, work.parameters(), lr)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(warm_windows):
        idx = torch.randperm(x.shape[0], generator=gen)[: b * k]
        opt.zero_grad(set_to_none=True)
        for xb, yb in split_batch(x[idx], y[idx], k):
            (loss_fn(work(xb), yb) / k).backward()
        opt.step()
    idx = torch.randperm(x.shape[0], generator=gen)[: b * present]
    norms = []
    for divisor in (k, present):
        trial = copy.deepcopy(work)
        trial_opt = _make_optimizer(optimizer, trial.parameters(), lr)
        trial_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        before = [p.detach().clone() for p in trial.parameters()]
        trial_opt.zero_grad(set_to_none=True)
        for xb, yb in split_batch(x[idx], y[idx], present):
            (loss_fn(trial(xb), yb) / divisor).backward()
        trial_opt.step()
        norms.append(float(torch.sqrt(sum(((p.detach() - q) ** 2).sum() for p, q in zip(trial.parameters(), before)))))
    return norms[0] / norms[1]


#: learning rates of :func:`partial_step_study`'s two set-ups, per optimizer
STUDY_LR = {"CNN, digits": {"sgd": 0.1, "momentum": 0.05, "adam": 1e-3},
            "char LM": {"sgd": 0.5, "momentum": 0.1, "adam": 1e-2}}


def partial_step_study(x_digits: torch.Tensor, y_digits: torch.Tensor, lines: Sequence[str], vocab: Vocab,
                       seeds: Sequence[int] = (0, 1, 2), warm: Sequence[int] = (0, 10), k: int = 8,
                       present: int = 3, optimizers: Sequence[OptimizerName] = ("sgd", "momentum", "adam"),
                       ) -> dict[tuple[str, str, int], list[float]]:
    """:func:`partial_step_ratio` for two set-ups — the book's GroupNorm ``SmallCNN`` on the digits (micro-batches
    of 8 images) and the character LM on the corpus (micro-batches of 2 lines, token-mean loss) — with plain SGD,
    SGD with momentum 0.9 and Adam (learning rates :data:`STUDY_LR`), after each number of ``warm`` windows, one
    value per seed (the seed sets the model's initial weights and the batches); ``optimizers`` picks a subset.
    Returns ``{(set-up, optimizer, warm windows): [ratio per seed]}``."""
    from .book.models import make_cnn

    lm_x, lm_y = encode_batch(lines, vocab)
    setups = {"CNN, digits": (lambda sd: make_cnn("group", seed=sd), nn.CrossEntropyLoss(), x_digits, y_digits, 8),
              "char LM": (lambda sd: make_lm(vocab, seed=sd), token_loss, lm_x, lm_y, 2)}
    out: dict[tuple[str, str, int], list[float]] = {}
    for name, (make, loss_fn, xs, ys, b) in setups.items():
        for opt in optimizers:
            for w in warm:
                out[name, opt, w] = [partial_step_ratio(make(sd), loss_fn, xs, ys, b, k, present, opt,  # type: ignore[arg-type]
                                                        STUDY_LR[name][opt], w, seed=sd) for sd in seeds]
    return out


@dataclass(frozen=True)
class WindowLog:
    """Three ways to log a window's loss: the last micro-batch's (scaled) loss, the mean of micro-batch means,
    and the token-weighted mean (the loss the window actually optimizes with token normalization)."""

    last_micro: float
    mean_of_means: float
    token_mean: float


def window_log(model: nn.Module, x: torch.Tensor, y: torch.Tensor, k: int) -> WindowLog:
    with torch.no_grad():
        micro = split_batch(x, y, k)
        means = [float(token_loss(model(xb), yb)) for xb, yb in micro]
        sums = [float(token_loss(model(xb), yb, "sum")) for xb, yb in micro]
        tokens = [count_tokens(yb) for _, yb in micro]
    return WindowLog(means[-1] / k, sum(means) / k, sum(sums) / sum(tokens))


# ------------------------------------------------------------------------------- training and figures


def train_lm(model: nn.Module, lines: Sequence[str], vocab: Vocab, steps: int = 150, k: int = 4,
             lr: float = 0.01, seed: int = 0) -> list[float]:
    """Train the tiny LM in place with Adam on random batches of 16 lines (K micro-batches, window-token
    normalization); returns the window losses."""
    x_all, y_all = encode_batch(lines, vocab)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        idx = torch.randperm(len(lines), generator=gen)[:16]
        opt.zero_grad(set_to_none=True)
        losses.append(window_backward(model, x_all[idx], y_all[idx], k))
        opt.step()
    return losses


def token_error(model: nn.Module, lines: Sequence[str], vocab: Vocab, k: int, spread: int, sort: bool,
                n: int = 32, center: int = 50, seed: int = 1) -> float:
    """Relative error of the mean-of-means gradient against the token-mean gradient for one batch of n lines."""
    if n % k:
        raise ValueError(f"K = {k} must divide the batch of {n} lines.")
    x, y = encode_batch(spread_lines(lines, n, center, spread, seed=seed, sort=sort), vocab)
    ref = token_mean_gradient(model, x, y)
    g = window_gradient(model, x, y, k, "mean_of_means")
    return float(torch.linalg.vector_norm(g - ref) / torch.linalg.vector_norm(ref))


def token_error_grid(model: nn.Module, lines: Sequence[str], vocab: Vocab, ks: Sequence[int],
                     spreads: Sequence[int], sort: bool = True) -> np.ndarray:
    return np.array([[token_error(model, lines, vocab, k, s, sort) for s in spreads] for k in ks])


def plot_token_error(spreads: Sequence[int], random: Sequence[float], grouped: Sequence[float]):
    from .book.plotting import PALETTE, decorate, figure

    fig, (ax,) = figure()
    ax.plot(spreads, grouped, "o-", color=PALETTE["vermillion"], label="length-grouped micro-batches")
    ax.plot(spreads, random, "s-", color=PALETTE["blue"], label="random micro-batches")
    ax.axhline(0, color="black", linewidth=1)
    decorate(ax, "spread of sequence lengths (± characters around 50)", "relative gradient error",
             "Mean of per-micro-batch means vs token mean (K = 4)")
    return fig


def plot_lr(right: Sequence[float], wrong: Sequence[float], k: int, warmup: int):
    from .book.plotting import PALETTE, decorate, figure

    fig, (ax,) = figure()
    steps = range(1, len(right) + 1)
    ax.plot(steps, right, "o-", color=PALETTE["blue"], label="scheduler.step() per optimizer step")
    ax.plot(steps, wrong, "s-", color=PALETTE["vermillion"], label="scheduler.step() per micro-batch")
    decorate(ax, "optimizer step", "learning rate (fraction of peak)", f"Linear warmup of {warmup} steps, K = {k}")
    return fig


def plot_token_grid(grid: np.ndarray, ks: Sequence[int], spreads: Sequence[int]):
    """Heat map of :func:`token_error_grid`."""
    from .book.plotting import figure, heatmap

    fig, (ax,) = figure(1, 6.4, 4.0)
    image = heatmap(ax, grid, ks, spreads, vmin=0.0, aspect="equal", xlabel="spread of lengths (±)", ylabel="K",
                    title="Mean of means vs token mean, length-grouped")
    fig.colorbar(image, ax=ax, label="relative gradient error")
    return fig


def plot_token_widget(model: nn.Module, lines: Sequence[str], vocab: Vocab, k: int, spread: int):
    """The widget's picture: gradient error of mean-of-means for random and length-grouped micro-batches."""
    from .book.plotting import PALETTE, decorate, figure

    errors = [token_error(model, lines, vocab, k, spread, sort) for sort in (False, True)]
    fig, (ax,) = figure(1, 6.4, 3.2)
    ax.bar(["random micro-batches", "length-grouped"], errors, color=[PALETTE["blue"], PALETTE["vermillion"]])
    decorate(ax, "", "relative gradient error", f"mean of means vs token mean: K = {k}, lengths 50 ± {spread}")
    return fig
