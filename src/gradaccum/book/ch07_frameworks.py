"""Chapter 7, "Your framework, audited": the measurements behind the behaviour table, the two-process run, the
figures and the widget.

The book layer over :mod:`gradaccum.frameworks` (the runners and the ``check`` adapters).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gradaccum import frameworks as fw
from gradaccum._validate import require_count, require_k
from gradaccum.book import ch07_harness as harness
from gradaccum.book.ch07_windows import COLORS as COLORS
from gradaccum.book.ch07_windows import MARKERS as MARKERS
from gradaccum.book.ch07_windows import K as K
from gradaccum.book.ch07_windows import PartialCurves as PartialCurves
from gradaccum.book.ch07_windows import _require_slices
from gradaccum.book.ch07_windows import digits_mlp as digits_mlp
from gradaccum.book.ch07_windows import partial_weights as partial_weights
from gradaccum.book.ch07_windows import partial_window_curves as partial_window_curves
from gradaccum.book.ch07_windows import plot_epoch_weights as plot_epoch_weights
from gradaccum.book.ch07_windows import plot_partial_curves as plot_partial_curves
from gradaccum.book.ch07_windows import plot_partial_weights as plot_partial_weights
from gradaccum.book.ch07_windows import plot_step_weights as plot_step_weights
from gradaccum.book.ch07_windows import step_weights as step_weights
from gradaccum.book.data import Vocab, encode_batch, load_digits_split, spread_lines
from gradaccum.book.models import TinyLM
from gradaccum.book.plotting import decorate, figure
from gradaccum.book.tables import Table
from gradaccum.checker import check
from gradaccum.framework_probes import _own_accelerate_state
from gradaccum.windows import token_loss

#: Gradient-norm threshold of the clipping row (well below the gradient norm, so clipping acts).
CLIP = 0.05
#: Relative error below which a float32 gradient counts as equal to the reference (float32 rounding is ~1e-7).
EXACT = 1e-5


def lm_batch(lines: Sequence[str], vocab: Vocab, n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` lines of 50 ± 39 characters, grouped by length (as length-bucketing loaders do), padded."""
    return encode_batch(spread_lines(lines, n, 50, 39, seed=1, sort=True), vocab)


def fresh_lm(vocab: Vocab, seed: int = 0) -> TinyLM:
    """The book's character LM in float32."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TinyLM(vocab.size)


def token_sum(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The summed token loss (the token recipes' loss)."""
    return token_loss(out, y, "sum")


@dataclass
class Single:
    """One framework in one process. Errors are relative to the matching full-batch gradient."""

    framework: str
    steps_per_window: int
    scheduler_per_step: float | None  # None: no scheduler object (the LR is computed from the step number)
    dropout_error: float  # gradaccum.check with the framework's step (dropout masks replayed per sample)
    dropout_codes: list[str]
    clip_error: float  # against the full-batch gradient clipped once
    bf16_error: float  # bf16 autocast, against the fp32 full-batch gradient
    fp16: str  # what the framework does when asked for fp16 on the CPU
    partial_steps: int  # optimizer steps for K + K/2 micro-batches
    partial_weight: float | None  # the last step's gradient / the mean gradient of its micro-batches
    token_error: float  # per-micro-batch mean token loss
    recipe_error: float | None  # the framework's token recipe; None where it has none
    bn_per_step: float  # BatchNorm running-statistics updates per optimizer step
    bn_error: float
    logged: str
    lrs: list[float]  # learning rate of each optimizer step over 10 windows under a linear warmup of 8
    # the Trainer only: a model that accepts loss kwargs and returns its mean loss, its step as a multiple of
    # the default's (the mean of micro-batch means)
    kwargs_mean_factor: float | None = None


def _logged(run: fw.Run, means: list[float], token_mean: float) -> str:
    """Which quantity a framework logged for one window (its values against the candidates)."""
    close = lambda a, b: abs(a - b) <= 1e-5 * abs(b)  # noqa: E731
    if not run.logged:
        return "nothing (you log)"
    if len(run.logged) == len(means):
        if all(close(a, b) for a, b in zip(run.logged, means)):
            return "each micro-batch's mean"
        if all(close(a, b / len(means)) for a, b in zip(run.logged, means)):
            return "each micro-batch's mean ÷ K"
    if len(run.logged) != 1:
        return "other"
    value = run.logged[0]
    if close(value, token_mean):
        return "the token mean"
    if close(value, sum(means) / len(means)):
        return "the mean of micro-batch means"
    if close(value, means[-1]):
        return "the last micro-batch's mean"
    return "other"


def _fp16_on_the_cpu(framework: str, xs: torch.Tensor, ys: torch.Tensor, k: int, fp32: fw.Run, bf16: fw.Run) -> str:
    """What a framework runs when asked for fp16 on the CPU: the fp32 or the bf16 run's gradient, bit for bit, or
    fp16 itself; "not offered" where it has no such option."""
    if framework not in ("accelerate", "lightning", "trainer"):
        return "not offered"
    half = fw.run(framework, digits_mlp(), nn.CrossEntropyLoss(), fw.split(xs, ys, k), k, precision="fp16").grads[0]
    if harness.relative_error(half, fp32.grads[0]) == 0:
        return "runs fp32, no GradScaler"
    return "runs bf16-mixed instead" if harness.relative_error(half, bf16.grads[0]) == 0 else "fp16"


def measure(
    framework: str, x: torch.Tensor, y: torch.Tensor, lm_x: torch.Tensor, lm_y: torch.Tensor, vocab: Vocab, k: int = K
) -> Single:
    """All single-process measurements of one framework (digits ``x, y``: at least ``k · 8 + k · 4`` samples)."""
    ce = nn.CrossEntropyLoss()
    b = 8
    xs, ys = x[: k * b], y[: k * b]
    full = harness.full_gradient(digits_mlp(), ce, xs, ys)

    basic = fw.run(framework, digits_mlp(), ce, fw.split(xs, ys, k), k)
    report = check(digits_mlp(dropout=True), ce, xs, ys, k, step=fw.framework_step(framework))
    clipped = fw.run(framework, digits_mlp(), ce, fw.split(xs, ys, k), k, clip=CLIP)
    full_clipped = full * min(1.0, CLIP / (float(full.norm()) + 1e-6))
    bf16 = fw.run(framework, digits_mlp(), ce, fw.split(xs, ys, k), k, precision="bf16")
    fp16 = _fp16_on_the_cpu(framework, xs, ys, k, basic, bf16)
    weights = step_weights(framework, x, y, k + k // 2, k, b)
    bn_model = digits_mlp(bn=True)
    bn_full = harness.full_gradient(bn_model, ce, xs, ys)
    bn = fw.run(framework, bn_model, ce, fw.split(xs, ys, k), k)

    n_warm = 10 * k * b
    warm = fw.run(framework, digits_mlp(), ce, fw.split(x[:n_warm], y[:n_warm], 10 * k), k, warmup=8)

    lm_micro = fw.split(lm_x, lm_y, k)
    lm_full = harness.full_gradient(fresh_lm(vocab), token_loss, lm_x, lm_y, sum_loss=token_sum)
    plain = fw.run(framework, fresh_lm(vocab), token_loss, lm_micro, k, lr=0.0)
    recipe_error = None
    try:
        recipe = fw.run(framework, fresh_lm(vocab), token_loss, lm_micro, k, sum_loss=token_sum, lr=0.0)
        recipe_error = harness.relative_error(recipe.grads[0], lm_full)
    except ValueError:
        pass
    kwargs_mean_factor = None
    if framework == "trainer":
        kwargs_mean = fw.run(framework, fresh_lm(vocab), token_loss, lm_micro, k, lr=0.0, loss_kwargs=True)
        kwargs_mean_factor = harness.step_factor(kwargs_mean.grads[0], plain.grads[0])
    with torch.no_grad():
        net = fresh_lm(vocab)
        means = [float(token_loss(net(xb), yb)) for xb, yb in lm_micro]
        token_mean = float(token_loss(net(lm_x), lm_y))
    return Single(
        framework=framework,
        steps_per_window=basic.optimizer_steps,
        scheduler_per_step=basic.scheduler_steps / basic.optimizer_steps if framework != "nanogpt" else None,
        dropout_error=report.rel_error,
        dropout_codes=report.codes,
        clip_error=harness.relative_error(clipped.grads[0], full_clipped),
        bf16_error=harness.relative_error(bf16.grads[0], full),
        fp16=fp16,
        partial_steps=len(weights),
        partial_weight=weights[1] if len(weights) > 1 else None,
        token_error=harness.relative_error(plain.grads[0], lm_full),
        recipe_error=recipe_error,
        bn_per_step=bn.bn_updates / bn.optimizer_steps,
        bn_error=harness.relative_error(bn.grads[0], bn_full),
        logged=_logged(plain, means, token_mean),
        lrs=warm.lrs,
        kwargs_mean_factor=kwargs_mean_factor,
    )


def causal_lm_labels(lm_x: torch.Tensor, lm_y: torch.Tensor) -> torch.Tensor:
    """Labels for a Transformers causal LM on :func:`lm_batch`'s inputs: the input ids, -100 at padding (the model
    shifts them itself)."""
    return torch.where(lm_y != fw.IGNORE, lm_x, torch.full_like(lm_x, fw.IGNORE))


#: The Transformers classes :func:`builtin_classifier_step` trains, by ``kind``.
HEADS = {
    "bert": "BertForSequenceClassification",
    "llama": "LlamaForSequenceClassification",
    "bert-token": "BertForTokenClassification",
    "bert-mlm": "BertForMaskedLM",
    "vit": "ViTForImageClassification",
    "vit-regression": "ViTForImageClassification, regression",
}


@dataclass
class BuiltinStep:
    """One Trainer window of a Transformers model against its full batch."""

    error: float  # relative error of the step's gradient
    weight: float  # the step's gradient as a multiple of the full batch's (least squares)


def _builtin_step(run: fw.Run, full: torch.Tensor) -> BuiltinStep:
    return BuiltinStep(harness.relative_error(run.grads[0], full), harness.step_factor(run.grads[0], full))


def builtin_lm_step(
    kind: str, lm_x: torch.Tensor, lm_y: torch.Tensor, vocab: Vocab, k: int = K, loss_type: str | None = None
) -> BuiltinStep:
    """The Trainer on a one-layer ``GPT2LMHeadModel`` or ``LlamaForCausalLM`` built from a config, padded lines,
    ``k`` micro-batches: what its ``num_items_in_batch`` makes of the model's own (shifted) token loss.
    ``loss_type`` (e.g. ``"ForCausalLM"``) is set on the model before the Trainer is built (the fix for a model
    whose class name matches none of the library's losses)."""
    if loss_type is not None and not isinstance(loss_type, str):
        raise ValueError(
            f"loss_type must be None or the name of a Transformers loss such as 'ForCausalLM', got {loss_type!r}."
        )
    labels = causal_lm_labels(lm_x, lm_y)
    model = harness.tiny_causal_lm(kind, vocab.size, lm_x.shape[1])
    if loss_type is not None:
        setattr(model, "loss_type", loss_type)  # noqa: B010  (a Transformers attribute nn.Module does not declare)
    return _builtin_step(*harness.trainer_on_causal_lm(model, lm_x, labels, k))


def builtin_classifier_step(
    kind: str,
    lm_x: torch.Tensor,
    lm_y: torch.Tensor,
    vocab: Vocab,
    k: int = K,
    opt_out: bool = False,
    loss_func: str | None = None,
    scaled_for_ga: bool | None = None,
) -> BuiltinStep:
    """The Trainer on a one-layer Transformers classifier built from a config
    (:func:`ch07_harness.tiny_classifier`: ``"bert"`` or ``"llama"`` label sequences, ``"bert-token"`` and
    ``"bert-mlm"`` tokens), :func:`lm_batch`'s lines as inputs, ``k`` micro-batches. A sequence's class is ``i % 3``
    for row i; a token's is its id modulo 3 (``"bert-token"``) or its id (``"bert-mlm"``), padding -100. The
    image heads (``"vit"``, ``"vit-regression"``) take as many digits instead (8×8, float32), the digit modulo 3
    as the class, or the digit / 9 as the target. ``opt_out`` sets ``model.accepts_loss_kwargs = False``, so that
    the Trainer divides by K again. ``loss_func`` gives the Trainer a ``compute_loss_func``: ``"mean"`` returns
    the micro-batch's mean cross-entropy, ``"count"`` its summed cross-entropy over ``num_items_in_batch``.
    ``scaled_for_ga`` sets the Trainer's ``loss_is_scaled_for_ga`` (``False``: it divides by K whatever the model
    takes)."""
    if not isinstance(opt_out, bool):
        raise ValueError(f"opt_out must be True or False, got {opt_out!r}.")
    if loss_func not in (None, "mean", "count"):
        raise ValueError(f"loss_func must be None, 'mean' or 'count', got {loss_func!r}.")
    if scaled_for_ga is not None and not isinstance(scaled_for_ga, bool):
        raise ValueError(f"scaled_for_ga must be None, True or False, got {scaled_for_ga!r}.")
    inputs = lm_x
    if harness.CLASSIFIER_KINDS.get(kind) == "image":
        split = load_digits_split(dtype=torch.float32)
        inputs, digits = split.x_train[: len(lm_x)], split.y_train[: len(lm_x)]
        classes = digits.float() / 9 if kind == "vit-regression" else digits % 3
    elif harness.CLASSIFIER_KINDS.get(kind) == "token":
        tokens = causal_lm_labels(lm_x, lm_y)
        classes = torch.where(tokens != fw.IGNORE, tokens % 3, tokens) if kind == "bert-token" else tokens
    else:
        classes = torch.arange(len(lm_x)) % 3
    model = harness.tiny_classifier(kind, vocab.size, inputs.shape[-1])
    if opt_out:  # what the Trainer reads first (an instance attribute does, as the class attribute would)
        setattr(model, "accepts_loss_kwargs", False)  # noqa: B010
    func = None if loss_func is None else _trainer_loss(loss_func)
    return _builtin_step(*harness.trainer_on_causal_lm(model, inputs, classes, k, func, scaled_for_ga))


def _trainer_loss(how: str) -> Any:
    """A ``compute_loss_func(outputs, labels, num_items_in_batch)``: the mean cross-entropy, or the summed one over
    the count the Trainer passes."""

    def loss(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
        logits = outputs.logits.reshape(-1, outputs.logits.shape[-1])
        if how == "mean":
            return nn.functional.cross_entropy(logits, labels.reshape(-1), ignore_index=fw.IGNORE)
        total = nn.functional.cross_entropy(logits, labels.reshape(-1), ignore_index=fw.IGNORE, reduction="sum")
        return total / num_items_in_batch

    return loss


def accelerate_adjust_scheduler(requested: bool) -> bool:
    """What Accelerate's ``GradientState`` — the object its prepared scheduler reads — reports as
    ``adjust_scheduler`` for an ``Accelerator`` built with ``GradientAccumulationPlugin(num_steps=K,
    adjust_scheduler=requested)`` (documented: "defaults to True")."""
    from accelerate import Accelerator
    from accelerate.utils import GradientAccumulationPlugin

    if not isinstance(requested, bool):
        raise ValueError(f"requested must be True or False, got {requested!r}.")
    with _own_accelerate_state():
        plugin = GradientAccumulationPlugin(num_steps=K, adjust_scheduler=requested)
        accelerator = Accelerator(cpu=True, gradient_accumulation_plugin=plugin)
        return bool(accelerator.gradient_state.adjust_scheduler)


def bf16_full_batch_error(x: torch.Tensor, y: torch.Tensor, k: int = K) -> float:
    """The bf16 autocast full-batch gradient against the fp32 one: the error bf16 costs without accumulation (on
    the first K·8 samples)."""
    _require_slices(x, (0,), require_k(k) * 8)
    ce = nn.CrossEntropyLoss()
    xs, ys = x[: k * 8], y[: k * 8]
    net = digits_mlp()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = ce(net(xs), ys)
    loss.backward()
    full = harness.full_gradient(digits_mlp(), ce, xs, ys)
    return harness.relative_error(fw.flat_grads(list(net.parameters())), full)


def bf16_accumulation_ratios(
    x: torch.Tensor, y: torch.Tensor, seeds: Sequence[int] = (0, 1, 2), ks: Sequence[int] = (4, 8), b: int = 8
) -> dict[tuple[int, int], float]:
    """Plain bf16 autocast, no framework: for each seed (model weights and data slice) and K, the relative error of
    the accumulated gradient (K micro-batches of ``b``, each loss divided by K, summed in the fp32 ``.grad``)
    against the fp32 full-batch gradient, divided by the same error of one bf16 pass over the full batch."""
    if not ks:
        raise ValueError("pass at least one K (ks) to measure.")
    _require_slices(x, seeds, max(require_k(k) for k in ks) * require_count(b, "b (the micro-batch size)"))
    ce = nn.CrossEntropyLoss()
    ratios = {}
    for seed in seeds:
        for k in ks:
            n = k * b
            xs, ys = x[seed * n : (seed + 1) * n], y[seed * n : (seed + 1) * n]
            full = harness.full_gradient(digits_mlp(seed=seed), ce, xs, ys)
            one, acc = digits_mlp(seed=seed), digits_mlp(seed=seed)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = ce(one(xs), ys)
            loss.backward()
            for xb, yb in zip(xs.split(b), ys.split(b)):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    micro = ce(acc(xb), yb) / k
                micro.backward()
            ratios[seed, k] = harness.relative_error(
                fw.flat_grads(list(acc.parameters())), full
            ) / harness.relative_error(fw.flat_grads(list(one.parameters())), full)
    return ratios


def two_processes(
    lm_x: torch.Tensor, lm_y: torch.Tensor, k: int = K, timeout: float = 120.0
) -> dict[str, harness.RankResult]:
    """Every framework on two gloo processes (:func:`gradaccum.book.ch07_harness.rank_task`); rank 0's results, after
    checking that both ranks measured the same thing."""
    from gradaccum.book.ddp_workers import launch

    ranks = launch("frameworks", 2, timeout=timeout, x=lm_x, y=lm_y, k=k)
    for a, b in zip(*ranks):
        same = (a.optimizer_steps, a.scheduler_steps, a.allreduces, a.lrs) == (
            b.optimizer_steps,
            b.scheduler_steps,
            b.allreduces,
            b.lrs,
        )
        if not same or abs(a.token_error - b.token_error) > 1e-6:
            raise RuntimeError(f"the two ranks of {a.framework} disagree: {a} vs {b}")
    return {r.framework: r for r in ranks[0]}


# ------------------------------------------------------------------------------------------------- the table


def _exact(error: float | None) -> str:
    if error is None:
        return "no recipe"
    return "✓ exact" if error < EXACT else f"✗ off by {error:.2f}"


def _count(value: float | None, unit: str = "") -> str:
    if value is None:
        return "no scheduler"
    return f"{value:g}{unit}"


def _partial(s: Single, k: int) -> str:
    if s.partial_weight is None:
        return "never used"
    if abs(s.partial_weight - 1) < EXACT:
        return "full weight"
    return f"weighted {s.partial_weight:.2f} (= {round(s.partial_weight * k)}/{k})"


#: Row labels of the behaviour table, in order.
ROWS = (
    "optimizer steps per K micro-batches",
    "scheduler steps per optimizer step, 1 process",
    "scheduler steps per optimizer step, 2 processes",
    "gradient all-reduces per optimizer step, 2 processes",
    "fp32 gradient (dropout MLP) = full batch",
    "clip once, on the window's gradient",
    "bf16 autocast: as accurate as a bf16 full batch",
    "last partial window (2 of K = 4)",
    "padded tokens, per-micro-batch mean loss, 1 process",
    "padded tokens, its token recipe, 1 process",
    "padded tokens, per-micro-batch mean loss, 2 processes",
    "padded tokens, its token recipe, 2 processes",
    "BatchNorm: running-statistics updates per step",
    "BatchNorm: gradient = full batch",
    "loss it logs per step (padded LM)",
)


def _like(error: float, reference: float) -> str:
    return "✓ as the full batch" if 0.8 <= error / reference <= 1.25 else f"✗ {error / reference:.1f}× the full batch's"


def behaviour_rows(
    single: dict[str, Single], multi: dict[str, harness.RankResult], bf16_full: float, k: int = K
) -> list[list[str]]:
    """One list of cells per row of :data:`ROWS`, one cell per framework (the order of ``single``);
    ``bf16_full``: :func:`bf16_full_batch_error`."""
    names = list(single)
    cells: dict[str, list[str]] = {}
    for name in names:
        s, m = single[name], multi[name]
        cells[name] = [
            str(s.steps_per_window),
            _count(s.scheduler_per_step),
            _count(m.scheduler_steps / m.optimizer_steps if name != "nanogpt" else None),
            f"{m.allreduces / m.optimizer_steps:g}",
            "✓ exact" if s.dropout_error < EXACT and not s.dropout_codes else f"✗ {s.dropout_error:.2g}",
            "✓" if s.clip_error < EXACT else f"✗ off by {s.clip_error:.2f}",
            _like(s.bf16_error, bf16_full),
            _partial(s, k),
            _exact(s.token_error),
            _exact(s.recipe_error),
            _exact(m.token_error),
            _exact(m.recipe_error),
            f"{s.bn_per_step:g} (= K)" if s.bn_per_step == k else f"{s.bn_per_step:g}",
            _exact(s.bn_error),
            s.logged,
        ]
    return [[label] + [cells[n][i] for n in names] for i, label in enumerate(ROWS)]


def behaviour_table(
    single: dict[str, Single], multi: dict[str, harness.RankResult], bf16_full: float, k: int = K
) -> Table:
    """The chapter's table: condition × framework, every cell measured."""
    return Table(
        ["condition"] + [fw.LABELS[n] for n in single],
        behaviour_rows(single, multi, bf16_full, k),
        caption=f"Measured with the pinned versions, K = {k}, on the CPU.",
    )


# ----------------------------------------------------------------------------------------------- figures


def plot_lrs(single: dict[str, list[float]], multi: dict[str, list[float]], warmup: int):
    """Learning rate at each optimizer step under a linear warmup, in one process and on two."""
    fig, axes = figure(2, 6.4, 3.2)
    for ax, data, title in zip(axes, (single, multi), ("1 process", "2 processes")):
        for name, lrs in data.items():
            ax.plot(
                range(1, len(lrs) + 1), lrs, marker=MARKERS[name], color=COLORS[name], label=fw.LABELS[name], alpha=0.85
            )
        decorate(ax, "optimizer step", "learning rate", title, legend=False)
    axes[1].legend(frameon=False, fontsize="small", loc="lower right")
    fig.suptitle(f"Linear warmup over {warmup} scheduler steps")
    return fig


def digits_module() -> Any:
    """A LightningModule of the kind a reader writes: :func:`digits_mlp` with dropout, cross-entropy in
    ``training_step``, SGD with momentum 0.9 and a per-step cosine schedule in ``configure_optimizers``."""
    import pytorch_lightning as pl

    class DigitsModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = digits_mlp(dropout=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.cross_entropy(self(x), y)

        def configure_optimizers(self) -> Any:
            opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
            sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return DigitsModule()
