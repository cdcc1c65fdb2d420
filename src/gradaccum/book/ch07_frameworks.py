"""Chapter 7, "Your framework, audited": the measurements behind the behaviour table, the two-process run, the
figures and the widget.

The book layer over :mod:`gradaccum.frameworks` (the runners and the ``check`` adapters).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from gradaccum import frameworks as fw
from gradaccum._validate import require_count, require_k
from gradaccum.book.data import Vocab, encode_batch, load_digits_split, spread_lines
from gradaccum.book.models import TinyLM
from gradaccum.book.plotting import PALETTE, decorate, figure
from gradaccum.book.tables import Table
from gradaccum.checker import check
from gradaccum.windows import token_loss

#: Micro-batches per optimizer step in the measurements.
K = 4
#: Gradient-norm threshold of the clipping row (well below the gradient norm, so clipping acts).
CLIP = 0.05
#: Relative error below which a float32 gradient counts as equal to the reference (float32 rounding is ~1e-7).
EXACT = 1e-5
COLORS = {"accelerate": PALETTE["orange"], "lightning": PALETTE["purple"], "trainer": PALETTE["blue"],
          "nanogpt": PALETTE["green"], "timm": PALETTE["black"]}
MARKERS = {"accelerate": "o", "lightning": "s", "trainer": "^", "nanogpt": "D", "timm": "x"}


def digits_mlp(bn: bool = False, dropout: bool = False, seed: int = 0) -> nn.Sequential:
    """Flatten → Linear(64, 32) [→ BatchNorm1d] → ReLU [→ Dropout(0.3) → Linear(32, 32) → ReLU → Dropout(0.3)]
    → Linear(32, 10), float32; the weights depend only on ``seed``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        mods: list[nn.Module] = [nn.Flatten(), nn.Linear(64, 32)]
        mods += [nn.BatchNorm1d(32)] if bn else []
        mods.append(nn.ReLU())
        if dropout:
            mods += [nn.Dropout(0.3), nn.Linear(32, 32), nn.ReLU(), nn.Dropout(0.3)]
        mods.append(nn.Linear(32, 10))
        return nn.Sequential(*mods)


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


def _require_slices(x: torch.Tensor, seeds: Sequence[int], n: int) -> None:
    """Seed s trains on the s-th slice of n samples: every slice must exist and be whole."""
    if not seeds:
        raise ValueError("pass at least one seed: there is nothing to measure without one.")
    for seed in seeds:
        require_count(seed, "a seed", 0)
    if (max(seeds) + 1) * n > len(x):
        raise ValueError(f"seed {max(seeds)} uses samples {max(seeds) * n} to {(max(seeds) + 1) * n - 1}; only "
                         f"{len(x)} given: pass fewer or smaller seeds (or smaller batches).")


def step_weights(framework: str, x: torch.Tensor, y: torch.Tensor, micro_batches: int, k: int,
                 b: int = 4) -> list[float]:
    """Each optimizer step's gradient as a multiple of the mean gradient of the micro-batches it used, for one
    epoch of ``micro_batches`` micro-batches of ``b`` digits (learning rate 0, so every step sees the same
    weights). A framework that never uses the last micro-batches has fewer entries."""
    require_count(micro_batches, "micro_batches")
    require_k(k)
    require_count(b, "b (the micro-batch size)")
    n = micro_batches * b
    if n > len(x):
        raise ValueError(f"{micro_batches} micro-batches of {b} need {n} samples; only {len(x)} given.")
    model = digits_mlp()
    loss = nn.CrossEntropyLoss()
    result = fw.run(framework, model, loss, fw.split(x[:n], y[:n], micro_batches), k, lr=0.0)
    weights = []
    for s, grad in enumerate(result.grads):
        lo, hi = s * k * b, min((s + 1) * k * b, n)
        weights.append(fw.step_factor(grad, fw.full_gradient(model, loss, x[lo:hi], y[lo:hi])))
    return weights


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


def measure(framework: str, x: torch.Tensor, y: torch.Tensor, lm_x: torch.Tensor, lm_y: torch.Tensor,
            vocab: Vocab, k: int = K) -> Single:
    """All single-process measurements of one framework (digits ``x, y``: at least ``k · 8 + k · 4`` samples)."""
    ce = nn.CrossEntropyLoss()
    b = 8
    xs, ys = x[:k * b], y[:k * b]
    full = fw.full_gradient(digits_mlp(), ce, xs, ys)

    basic = fw.run(framework, digits_mlp(), ce, fw.split(xs, ys, k), k)
    report = check(digits_mlp(dropout=True), ce, xs, ys, k, step=fw.framework_step(framework))
    clipped = fw.run(framework, digits_mlp(), ce, fw.split(xs, ys, k), k, clip=CLIP)
    full_clipped = full * min(1.0, CLIP / (float(full.norm()) + 1e-6))
    bf16 = fw.run(framework, digits_mlp(), ce, fw.split(xs, ys, k), k, precision="bf16")
    fp16 = "not offered"
    if framework in ("accelerate", "lightning", "trainer"):
        half = fw.run(framework, digits_mlp(), ce, fw.split(xs, ys, k), k, precision="fp16").grads[0]
        fp16 = ("runs fp32, no GradScaler" if fw.relative_error(half, basic.grads[0]) == 0
                else "runs bf16-mixed instead" if fw.relative_error(half, bf16.grads[0]) == 0 else "fp16")
    weights = step_weights(framework, x, y, k + k // 2, k, b)
    bn_model = digits_mlp(bn=True)
    bn_full = fw.full_gradient(bn_model, ce, xs, ys)
    bn = fw.run(framework, bn_model, ce, fw.split(xs, ys, k), k)

    n_warm = 10 * k * b
    warm = fw.run(framework, digits_mlp(), ce, fw.split(x[:n_warm], y[:n_warm], 10 * k), k, warmup=8)

    lm_micro = fw.split(lm_x, lm_y, k)
    lm_full = fw.full_gradient(fresh_lm(vocab), token_loss, lm_x, lm_y, sum_loss=token_sum)
    plain = fw.run(framework, fresh_lm(vocab), token_loss, lm_micro, k, lr=0.0)
    recipe_error = None
    try:
        recipe = fw.run(framework, fresh_lm(vocab), token_loss, lm_micro, k, sum_loss=token_sum, lr=0.0)
        recipe_error = fw.relative_error(recipe.grads[0], lm_full)
    except ValueError:
        pass
    kwargs_mean_factor = None
    if framework == "trainer":
        kwargs_mean = fw.run(framework, fresh_lm(vocab), token_loss, lm_micro, k, lr=0.0, loss_kwargs=True)
        kwargs_mean_factor = fw.step_factor(kwargs_mean.grads[0], plain.grads[0])
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
        clip_error=fw.relative_error(clipped.grads[0], full_clipped),
        bf16_error=fw.relative_error(bf16.grads[0], full),
        fp16=fp16,
        partial_steps=len(weights),
        partial_weight=weights[1] if len(weights) > 1 else None,
        token_error=fw.relative_error(plain.grads[0], lm_full),
        recipe_error=recipe_error,
        bn_per_step=bn.bn_updates / bn.optimizer_steps,
        bn_error=fw.relative_error(bn.grads[0], bn_full),
        logged=_logged(plain, means, token_mean),
        lrs=warm.lrs,
        kwargs_mean_factor=kwargs_mean_factor,
    )


def causal_lm_labels(lm_x: torch.Tensor, lm_y: torch.Tensor) -> torch.Tensor:
    """Labels for a Transformers causal LM on :func:`lm_batch`'s inputs: the input ids, -100 at padding (the model
    shifts them itself)."""
    return torch.where(lm_y != fw.IGNORE, lm_x, torch.full_like(lm_x, fw.IGNORE))


#: The Transformers classes :func:`builtin_classifier_step` trains, by ``kind``.
HEADS = {"bert": "BertForSequenceClassification", "llama": "LlamaForSequenceClassification",
         "bert-token": "BertForTokenClassification", "bert-mlm": "BertForMaskedLM",
         "vit": "ViTForImageClassification", "vit-regression": "ViTForImageClassification, regression"}


@dataclass
class BuiltinStep:
    """One Trainer window of a Transformers model against its full batch."""

    error: float  # relative error of the step's gradient
    weight: float  # the step's gradient as a multiple of the full batch's (least squares)


def _builtin_step(run: fw.Run, full: torch.Tensor) -> BuiltinStep:
    return BuiltinStep(fw.relative_error(run.grads[0], full), fw.step_factor(run.grads[0], full))


def builtin_lm_step(kind: str, lm_x: torch.Tensor, lm_y: torch.Tensor, vocab: Vocab, k: int = K,
                    loss_type: str | None = None) -> BuiltinStep:
    """The Trainer on a one-layer ``GPT2LMHeadModel`` or ``LlamaForCausalLM`` built from a config, padded lines,
    ``k`` micro-batches: what its ``num_items_in_batch`` makes of the model's own (shifted) token loss.
    ``loss_type`` (e.g. ``"ForCausalLM"``) is set on the model before the Trainer is built (the fix for a model
    whose class name matches none of the library's losses)."""
    if loss_type is not None and not isinstance(loss_type, str):
        raise ValueError(f"loss_type must be None or the name of a Transformers loss such as 'ForCausalLM', got "
                         f"{loss_type!r}.")
    labels = causal_lm_labels(lm_x, lm_y)
    model = fw.tiny_causal_lm(kind, vocab.size, lm_x.shape[1])
    if loss_type is not None:
        setattr(model, "loss_type", loss_type)  # noqa: B010  (a Transformers attribute nn.Module does not declare)
    return _builtin_step(*fw.trainer_on_causal_lm(model, lm_x, labels, k))


def builtin_classifier_step(kind: str, lm_x: torch.Tensor, lm_y: torch.Tensor, vocab: Vocab, k: int = K,
                            opt_out: bool = False, loss_func: str | None = None,
                            scaled_for_ga: bool | None = None) -> BuiltinStep:
    """The Trainer on a one-layer Transformers classifier built from a config
    (:func:`gradaccum.frameworks.tiny_classifier`: ``"bert"`` or ``"llama"`` label sequences, ``"bert-token"`` and
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
    if fw.CLASSIFIER_KINDS.get(kind) == "image":
        split = load_digits_split(dtype=torch.float32)
        inputs, digits = split.x_train[: len(lm_x)], split.y_train[: len(lm_x)]
        classes = digits.float() / 9 if kind == "vit-regression" else digits % 3
    elif fw.CLASSIFIER_KINDS.get(kind) == "token":
        tokens = causal_lm_labels(lm_x, lm_y)
        classes = torch.where(tokens != fw.IGNORE, tokens % 3, tokens) if kind == "bert-token" else tokens
    else:
        classes = torch.arange(len(lm_x)) % 3
    model = fw.tiny_classifier(kind, vocab.size, inputs.shape[-1])
    if opt_out:  # what the Trainer reads first (an instance attribute does, as the class attribute would)
        setattr(model, "accepts_loss_kwargs", False)  # noqa: B010
    func = None if loss_func is None else _trainer_loss(loss_func)
    return _builtin_step(*fw.trainer_on_causal_lm(model, inputs, classes, k, func, scaled_for_ga))


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
    with fw._own_accelerate_state():
        plugin = GradientAccumulationPlugin(num_steps=K, adjust_scheduler=requested)
        accelerator = Accelerator(cpu=True, gradient_accumulation_plugin=plugin)
        return bool(accelerator.gradient_state.adjust_scheduler)


def bf16_full_batch_error(x: torch.Tensor, y: torch.Tensor, k: int = K) -> float:
    """The bf16 autocast full-batch gradient against the fp32 one: the error bf16 costs without accumulation (on
    the first K·8 samples)."""
    _require_slices(x, (0,), require_k(k) * 8)
    ce = nn.CrossEntropyLoss()
    xs, ys = x[:k * 8], y[:k * 8]
    net = digits_mlp()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = ce(net(xs), ys)
    loss.backward()
    return fw.relative_error(fw.flat_grads(list(net.parameters())), fw.full_gradient(digits_mlp(), ce, xs, ys))


def bf16_accumulation_ratios(x: torch.Tensor, y: torch.Tensor, seeds: Sequence[int] = (0, 1, 2),
                             ks: Sequence[int] = (4, 8), b: int = 8) -> dict[tuple[int, int], float]:
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
            xs, ys = x[seed * n:(seed + 1) * n], y[seed * n:(seed + 1) * n]
            full = fw.full_gradient(digits_mlp(seed=seed), ce, xs, ys)
            one, acc = digits_mlp(seed=seed), digits_mlp(seed=seed)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = ce(one(xs), ys)
            loss.backward()
            for xb, yb in zip(xs.split(b), ys.split(b)):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    micro = ce(acc(xb), yb) / k
                micro.backward()
            ratios[seed, k] = (fw.relative_error(fw.flat_grads(list(acc.parameters())), full)
                               / fw.relative_error(fw.flat_grads(list(one.parameters())), full))
    return ratios


def two_processes(lm_x: torch.Tensor, lm_y: torch.Tensor, k: int = K, timeout: float = 120.0
                  ) -> dict[str, fw.RankResult]:
    """Every framework on two gloo processes (:func:`gradaccum.frameworks.rank_task`); rank 0's results, after
    checking that both ranks measured the same thing."""
    from gradaccum.book.ddp_workers import launch

    ranks = launch("frameworks", 2, timeout=timeout, x=lm_x, y=lm_y, k=k)
    for a, b in zip(*ranks):
        same = (a.optimizer_steps, a.scheduler_steps, a.allreduces, a.lrs) == (
            b.optimizer_steps, b.scheduler_steps, b.allreduces, b.lrs)
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
    "bf16 autocast: error vs fp32, against the full batch in bf16",
    "fp16 asked for, on the CPU",
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


def behaviour_rows(single: dict[str, Single], multi: dict[str, fw.RankResult], bf16_full: float,
                   k: int = K) -> list[list[str]]:
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
            s.fp16,
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


def behaviour_table(single: dict[str, Single], multi: dict[str, fw.RankResult], bf16_full: float,
                    k: int = K) -> Table:
    """The chapter's table: condition × framework, every cell measured."""
    return Table(["condition"] + [fw.LABELS[n] for n in single], behaviour_rows(single, multi, bf16_full, k),
                 caption=f"Measured with the pinned versions, K = {k}, on the CPU.")


# ----------------------------------------------------------------------------------------------- figures


def plot_lrs(single: dict[str, list[float]], multi: dict[str, list[float]], warmup: int):
    """Learning rate at each optimizer step under a linear warmup, in one process and on two."""
    fig, axes = figure(2, 6.4, 3.2)
    for ax, data, title in zip(axes, (single, multi), ("1 process", "2 processes")):
        for name, lrs in data.items():
            ax.plot(range(1, len(lrs) + 1), lrs, marker=MARKERS[name], color=COLORS[name], label=fw.LABELS[name],
                    alpha=0.85)
        decorate(ax, "optimizer step", "learning rate", title, legend=False)
    axes[1].legend(frameon=False, fontsize="small", loc="lower right")
    fig.suptitle(f"Linear warmup over {warmup} scheduler steps")
    return fig


def plot_step_weights(weights: dict[str, list[float]], micro_batches: int, k: int):
    """Each optimizer step's gradient as a multiple of its micro-batches' mean gradient, per framework."""
    fig, (ax,) = figure(1, 6.4, 3.6)
    names = list(weights)
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        steps = np.arange(1, len(weights[name]) + 1) + (i - (len(names) - 1) / 2) * width
        ax.bar(steps, weights[name], width, color=COLORS[name], label=fw.LABELS[name])
    ax.axhline(1.0, color="black", linewidth=1, linestyle="--")
    n_steps = max(len(w) for w in weights.values())
    decorate(ax, "optimizer step of the epoch", "weight of the step's gradient",
             f"{micro_batches} micro-batches, K = {k}", xticks=range(1, n_steps + 1), legend=False)
    ax.set_ylim(0, 1.15)
    ax.legend(frameon=False, fontsize="small", ncols=3, loc="upper center", bbox_to_anchor=(0.5, -0.2))
    return fig


def _no_nanogpt(frameworks: Sequence[str]) -> None:
    if "nanogpt" in frameworks:
        raise ValueError("the nanoGPT-style loop has no epochs and never runs a partial window (micro-batches left "
                         "over are not used): leave it out of partial-window measurements.")


def partial_weights(x: torch.Tensor, y: torch.Tensor, ks: Sequence[int],
                    frameworks: Sequence[str] = ("accelerate", "lightning", "timm"),
                    ) -> dict[str, list[tuple[int, int, float]]]:
    """``(K, r, weight)`` of the last step of an epoch of ``K + r`` micro-batches (of 2 digits), for every
    ``r = 1 … K − 1``: the partial window's gradient as a multiple of the mean gradient of its micro-batches."""
    if not ks or any(require_k(k) < 2 for k in ks):
        raise ValueError(f"pass Ks of 2 or more (K = 1 has no partial window), got {tuple(ks)!r}.")
    _no_nanogpt(frameworks)
    return {name: [(k, r, step_weights(name, x, y, k + r, k, b=2)[-1]) for k in ks for r in range(1, k)]
            for name in frameworks}


def plot_epoch_weights(x: torch.Tensor, y: torch.Tensor, micro_batches: int, k: int):
    """The widget's picture: the weight of every optimizer step of one epoch of ``micro_batches`` micro-batches
    of 2 digits, per framework (:func:`step_weights`)."""
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"the epoch needs at least one micro-batch, got {micro_batches!r}.")
    weights = {name: step_weights(name, x, y, micro_batches, k, b=2) for name in fw.FRAMEWORKS}
    return plot_step_weights(weights, micro_batches, k)


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


@dataclass
class PartialCurves:
    """Training loss after each epoch (on the epoch's samples, one full batch) per framework, seed and schedule."""

    epochs: int
    losses: dict[tuple[str, int, str], list[float]]


def partial_window_curves(x: torch.Tensor, y: torch.Tensor, seeds: Sequence[int] = (0, 1, 2),
                          schedules: Sequence[str] = ("constant", "cosine"), epochs: int = 30,
                          micro_batches: int = 6, k: int = K, b: int = 8, lr: float = 0.2,
                          frameworks: Sequence[str] = ("lightning", "timm")) -> PartialCurves:
    """Train :func:`digits_mlp` (seed ``s``, on the ``s``-th slice of ``micro_batches · b`` digits) for ``epochs``
    epochs of ``micro_batches`` micro-batches — every epoch ends with a partial window of ``micro_batches mod k`` —
    with each framework, SGD at ``lr``, constant or decayed to 0 by a cosine over the run."""
    _no_nanogpt(frameworks)
    if not schedules:
        raise ValueError("pass at least one schedule ('constant', 'cosine').")
    for schedule in schedules:
        if schedule not in ("constant", "cosine"):
            raise ValueError(f"schedules are 'constant' or 'cosine', got {schedule!r}.")
    require_count(epochs, "epochs")
    require_k(k)
    n = require_count(micro_batches, "micro_batches") * require_count(b, "b (the micro-batch size)")
    _require_slices(x, seeds, n)
    steps = epochs * -(-micro_batches // k)
    ce = nn.CrossEntropyLoss()
    losses: dict[tuple[str, int, str], list[float]] = {}
    for seed in seeds:
        xs, ys = x[seed * n:(seed + 1) * n], y[seed * n:(seed + 1) * n]
        for schedule in schedules:
            for name in frameworks:
                model = digits_mlp(seed=seed)
                result = fw.run(name, model, ce, fw.split(xs, ys, micro_batches), k, lr=lr, epochs=epochs,
                                cosine=steps if schedule == "cosine" else 0)
                per_epoch = len(result.params) // epochs
                curve = []
                probe = digits_mlp(seed=seed)
                for e in range(1, epochs + 1):
                    torch.nn.utils.vector_to_parameters(result.params[e * per_epoch - 1].float(), probe.parameters())
                    with torch.no_grad():
                        curve.append(float(ce(probe(xs), ys)))
                losses[name, seed, schedule] = curve
    return PartialCurves(epochs, losses)


def plot_partial_curves(curves: PartialCurves, seed: int = 0):
    """Training loss per epoch, one panel per schedule, for one seed."""
    schedules = sorted({key[2] for key in curves.losses}, key=["constant", "cosine"].index)
    fig, axes = figure(len(schedules), 6.4, 3.0)
    for ax, schedule in zip(axes, schedules):
        for (name, s, sch), curve in curves.losses.items():
            if s == seed and sch == schedule:
                label = f"{fw.LABELS[name]} (last window {'k′/K' if name in ('accelerate', 'lightning') else '1'})"
                ax.plot(range(1, curves.epochs + 1), curve, marker=MARKERS[name], markersize=3, color=COLORS[name],
                        label=label)
        decorate(ax, "epoch", "training loss" if ax is axes[0] else "", f"{schedule} learning rate", legend=False)
    axes[0].legend(frameon=False, fontsize="small")
    return fig


def plot_partial_weights(weights: dict[str, list[tuple[int, int, float]]]):
    """The last window's weight against the fraction r/K of the window it holds, one panel per framework."""
    fig, axes = figure(len(weights), 6.4, 2.8)
    for ax, (name, points) in zip(axes, weights.items()):
        for k, marker in zip(sorted({p[0] for p in points}), ("o", "s", "^", "D")):
            mine = [(r / k, w) for kk, r, w in points if kk == k]
            ax.plot(*zip(*mine), marker, color=COLORS[name], label=f"K = {k}", alpha=0.8)
        ax.plot([0, 1], [0, 1], color="black", linewidth=0.8, linestyle=":")
        decorate(ax, "r / K", "weight" if ax is axes[0] else "", fw.LABELS[name], legend=ax is axes[0])
        ax.set_ylim(0, 1.1)
    return fig
