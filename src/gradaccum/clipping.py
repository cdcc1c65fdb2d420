r"""Chapter 3: where to clip under gradient accumulation.

``torch.nn.utils.clip_grad_norm_`` treats all gradients as one vector :math:`v`, computes :math:`\|v\|` and
multiplies every gradient by :math:`\min\big(1, c/(\|v\|+10^{-6})\big)`. Write :math:`\operatorname{clip}_c` for
that map, :math:`g_k` for the gradient of micro-batch :math:`k`'s mean loss and :math:`g=\frac1K\sum_k g_k` for
the accumulated (= full-batch) gradient. The four placements:

* ``"once"`` (c): :math:`\operatorname{clip}_c(g)` — clip once after the last micro-batch; equals clipping the
  full-batch gradient;
* ``"scaled_micro"`` (a1): :math:`\sum_k \operatorname{clip}_c(g_k/K) = \frac1K\sum_k
  \operatorname{clip}_{Kc}(g_k)` — each 1/K-scaled contribution is clipped, which is (a2) with the threshold
  :math:`Kc`; its norm is at most :math:`\sum_k\min(c, \lVert g_k\rVert/K) \le \min(Kc,
  \frac1K\sum_k\lVert g_k\rVert)`;
* ``"raw_micro"`` (a2): :math:`\frac1K\sum_k \operatorname{clip}_c(g_k)` — each raw micro-gradient is
  clipped, then averaged; its norm is at most :math:`\frac1K\sum_k\min(c, \lVert g_k\rVert) \le c`;
* ``"running"`` (b): ``clip_grad_norm_`` on the running ``.grad`` buffer after every backward:
  :math:`r_k = \operatorname{clip}_c(r_{k-1} + g_k/K)`; earlier micro-batches are shrunk again by every later
  clip, so the direction leans towards the last ones, and the result depends on their order; its norm is at
  most :math:`c`, and equals :math:`c` only when the final buffer :math:`r_{K-1} + g_K/K` is longer than
  :math:`c` (otherwise the last clip does nothing, and the step can be shorter than the correct one, or even
  reversed: :data:`ERRATA_CASES`).

Whether (a1) and (a2) are longer or shorter than the correct step :math:`\min(\lVert g\rVert, c)` is *not*
fixed: it depends on how the micro-gradients are aligned (:func:`errata_cases` gives one example of each
direction). What is fixed are the upper bounds above (:func:`norm_bounds`) and two consequences: when the
full-batch gradient is clipped (:math:`\lVert g\rVert \ge c`), (a1) is at most K times and (a2) at most
once the correct length; with K = 2 neither is ever longer than :math:`\lVert g\rVert` (the clip is odd and
nonexpansive); with K ≥ 3 and :math:`\lVert g\rVert < c` neither ratio is bounded, and either can even point
the opposite way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from ._validate import require_k
from .accumulate import LossFn, flat_grad, split_batch
from .book.data import DigitsSplit

Placement = Literal["once", "scaled_micro", "raw_micro", "running"]
PLACEMENTS: tuple[str, ...] = ("once", "scaled_micro", "raw_micro", "running")
LABELS: dict[str, str] = {
    "once": "(c) clip once, after accumulation",
    "scaled_micro": "(a1) clip each g_k/K, then sum",
    "raw_micro": "(a2) clip each g_k, then average",
    "running": "(b) clip the running .grad buffer",
}
EPS = 1e-6  # clip_grad_norm_'s constant


def _require_threshold(c: float) -> float:
    """A clipping threshold must be a positive finite number."""
    if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c <= 0:
        raise ValueError(f"the clipping threshold must be a positive finite number, got {c!r}.")
    return float(c)


def _require_placement(placement: str) -> str:
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown placement {placement!r}; choose one of {PLACEMENTS}.")
    return placement


def clip_vector(v: torch.Tensor, c: float, mode: Literal["norm", "value"] = "norm") -> torch.Tensor:
    """``clip_grad_norm_`` (or ``clip_grad_value_``) applied to one flat vector, out of place."""
    if mode == "value":
        return v.clamp(-c, c)
    if mode != "norm":
        raise ValueError(f"mode must be 'norm' or 'value', got {mode!r}.")
    coef = c / (torch.linalg.vector_norm(v) + EPS)
    return v * coef.clamp(max=1.0)


def combine(micro_grads: Sequence[torch.Tensor], c: float, placement: Placement,
            mode: Literal["norm", "value"] = "norm") -> torch.Tensor:
    """The step's gradient from the raw micro-batch gradients ``g_k`` under each clip placement (the math of
    :func:`clipped_accumulation` on plain vectors, used by the widget and the exercises)."""
    _require_threshold(c)
    _require_placement(placement)
    k = len(micro_grads)
    require_k(k)
    if placement == "once":
        return clip_vector(sum(micro_grads) / k, c, mode)  # type: ignore[arg-type]
    if placement == "scaled_micro":
        return sum(clip_vector(g / k, c, mode) for g in micro_grads)  # type: ignore[return-value]
    if placement == "raw_micro":
        return sum(clip_vector(g, c, mode) for g in micro_grads) / k  # type: ignore[return-value]
    return clip_running_buffer([g / k for g in micro_grads], c, mode)


def clip_running_buffer(contributions: Sequence[torch.Tensor], c: float,
                        mode: Literal["norm", "value"] = "norm") -> torch.Tensor:
    r"""The buffer after adding each contribution and clipping it every time:
    :math:`r_k = \operatorname{clip}_c(r_{k-1} + d_k)`, :math:`r_0 = 0`, returned as :math:`r_K`.

    Placement (b) is this with :math:`d_k = g_k/K`; a loop without the :math:`1/K` factor (the Hugging Face
    issue's example) passes the raw :math:`g_k`."""
    _require_threshold(c)
    require_k(len(contributions))
    running = torch.zeros_like(contributions[0])
    for d in contributions:
        running = clip_vector(running + d, c, mode)
    return running


def norm_bounds(micro_grads: Sequence[torch.Tensor], c: float) -> dict[str, float]:
    r"""Upper bounds on the step's norm under each placement, from the micro-gradients' norms alone.

    With :math:`n_k = \lVert g_k\rVert`, :math:`g = \frac1K\sum_k g_k` and the triangle inequality
    (each clipped vector is no longer than :math:`c` nor than the vector itself):

    * ``once``: :math:`\min(\lVert g\rVert, c)` (an equality, up to ``clip_grad_norm_``'s :math:`10^{-6}`);
    * ``scaled_micro``: :math:`\sum_k \min(c, n_k/K) \le \min\big(Kc, \frac1K\sum_k n_k\big)`;
    * ``raw_micro``: :math:`\frac1K\sum_k \min(c, n_k) \le c`;
    * ``running``: :math:`c` (its last operation is a clip; an equality only when the buffer before that clip
      is longer than :math:`c`, see :func:`running_buffer_norms`).

    Lower bounds do not exist beyond 0: opposing micro-gradients cancel after clipping (:func:`errata_cases`).
    """
    _require_threshold(c)
    k = len(micro_grads)
    require_k(k)
    norms = [float(torch.linalg.vector_norm(g)) for g in micro_grads]
    mean = float(torch.linalg.vector_norm(sum(micro_grads) / k))  # type: ignore[arg-type]
    return {
        "once": min(mean, c),
        "scaled_micro": sum(min(c, n / k) for n in norms),
        "raw_micro": sum(min(c, n) for n in norms) / k,
        "running": c,
    }


@dataclass(frozen=True)
class Comparison:
    """One placement against clipping once, on the same micro-gradients."""

    placement: str
    norm: float        # norm of the placement's step
    correct: float     # norm of clip_c(g), the correct step
    cosine: float      # cosine between the two steps (NaN when either is zero up to clip_grad_norm_'s 1e-6)

    @property
    def ratio(self) -> float:
        """Length of the placement's step in units of the correct one."""
        return self.norm / self.correct


def compare_to_once(micro_grads: Sequence[torch.Tensor], c: float, placement: Placement) -> Comparison:
    r"""The step under ``placement`` next to the correct step :math:`\operatorname{clip}_c(g)`.

    A step shorter than ``EPS`` is zero up to ``clip_grad_norm_``'s :math:`10^{-6}` term (an exact projection
    would give 0); its direction is rounding noise, so its cosine is reported as NaN."""
    step = combine(micro_grads, c, placement)
    correct = combine(micro_grads, c, "once")
    n, m = float(torch.linalg.vector_norm(step)), float(torch.linalg.vector_norm(correct))
    cos = float(step @ correct) / (n * m) if n >= EPS and m >= EPS else math.nan
    return Comparison(placement, n, m, cos)


#: Small two-dimensional cases for the errata: (placement, micro-gradients, threshold c).
ERRATA_CASES: dict[str, tuple[str, tuple[tuple[float, float], ...], float]] = {
    "(a1) too long: aligned": ("scaled_micro", ((2.0, 0.0),) * 4, 1.0),
    "(a1) too short: opposing": ("scaled_micro", ((10.0, 0.0), (-9.0, 0.0)), 1.0),
    "(a1) reversed, K = 3": ("scaled_micro", ((30.3, 0.0), (-15.0, 0.0), (-15.0, 0.0)), 1.0),
    "(a2) too short: orthogonal": ("raw_micro", ((2.0, 0.0), (0.0, 2.0)), 1.0),
    "(a2) too long and reversed": ("raw_micro", ((-3.0, 0.0),) + ((0.95, 0.0),) * 3, 1.0),
    "(b) too short and turned": ("running", ((10.0, 0.0), (-2.0, 1.0)), 1.0),
    "(b) reversed": ("running", ((10.0, 0.0), (-7.0, 0.0)), 1.0),
}


def errata_cases(dtype: torch.dtype = torch.float64) -> dict[str, Comparison]:
    """:func:`compare_to_once` on every case of :data:`ERRATA_CASES`: each per-micro-batch placement errs in
    both directions, depending on how the micro-gradients are aligned; (b) too, when its final buffer is not
    longer than c."""
    out = {}
    for name, (placement, vectors, c) in ERRATA_CASES.items():
        grads = [torch.tensor(v, dtype=dtype) for v in vectors]
        out[name] = compare_to_once(grads, c, placement)  # type: ignore[arg-type]
    return out


def format_errata_cases(cases: dict[str, Comparison]) -> str:
    lines = [f"{'case':<30} {'K':>2} {'c':>4}  {'step norm':>10} {'correct':>8} {'ratio':>8} {'cos':>6}"]
    for name, r in cases.items():
        k, c = len(ERRATA_CASES[name][1]), ERRATA_CASES[name][2]
        cos = "   n/a" if math.isnan(r.cosine) else f"{r.cosine:>6.2f}"  # a zero step has no direction
        lines.append(f"{name:<30} {k:>2} {c:>4g}  {r.norm:>10.3g} {r.correct:>8.4g} {r.ratio:>8.3g} {cos}")
    return "\n".join(lines)


def _require_finite_grads(model: nn.Module) -> None:
    """Raise a ``ValueError`` naming the first parameter whose gradient holds inf or NaN."""
    for name, p in model.named_parameters():
        if p.grad is not None and not torch.isfinite(p.grad).all():
            bad = "NaN" if torch.isnan(p.grad).any() else "inf"
            raise ValueError(
                f"the gradient of parameter {name!r} contains {bad}; clipping cannot repair it. Find where it "
                "comes from (a loss of inf/NaN, an overflow in low precision — chapter 4) or skip the step."
            )


def _clip_grads(params: list[nn.Parameter], c: float, mode: str) -> None:
    if mode == "norm":
        torch.nn.utils.clip_grad_norm_(params, c)
    elif mode == "value":
        torch.nn.utils.clip_grad_value_(params, c)
    else:
        raise ValueError(f"mode must be 'norm' or 'value', got {mode!r}.")


def clipped_accumulation(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, k: int, c: float,
                         placement: Placement = "once", mode: Literal["norm", "value"] = "norm") -> float:
    """One accumulation loop with the clip placement as a parameter; gradients end in ``.grad``.

    Uses ``torch.nn.utils.clip_grad_norm_`` (``clip_grad_value_`` with ``mode="value"``) on the parameters'
    ``.grad``, as a training script would. For the per-micro-batch placements the micro-batch's gradient is
    isolated (the running sum is set aside during its backward pass) so that only it is clipped. The caller
    zeroes gradients before and steps after. Returns the batch loss.
    """
    _require_threshold(c)
    _require_placement(placement)
    params = [p for p in model.parameters() if p.requires_grad]
    total = 0.0
    for xb, yb in split_batch(x, y, k):
        loss = loss_fn(model(xb), yb)
        total += float(loss.detach()) / k
        if placement in ("once", "running"):
            (loss / k).backward()
            if placement == "running":
                _require_finite_grads(model)
                _clip_grads(params, c, mode)
            continue
        stash = [p.grad for p in params]
        for p in params:
            p.grad = None
        (loss / k if placement == "scaled_micro" else loss).backward()
        _require_finite_grads(model)
        _clip_grads(params, c, mode)
        for p, old in zip(params, stash):
            if p.grad is not None and placement == "raw_micro":
                p.grad.div_(k)
            if old is not None:
                p.grad = old + p.grad if p.grad is not None else old
    if placement == "once":
        _require_finite_grads(model)
        _clip_grads(params, c, mode)
    return total


def micro_gradients(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, k: int) -> list[torch.Tensor]:
    """The raw gradients g_k of each micro-batch's mean loss, as flat vectors (the model is left unchanged)."""
    grads = []
    for xb, yb in split_batch(x, y, k):
        model.zero_grad(set_to_none=True)
        loss_fn(model(xb), yb).backward()
        grads.append(flat_grad(model).detach().clone())
    model.zero_grad(set_to_none=True)
    return grads


def mean_pairwise_cosine(vectors: Sequence[torch.Tensor]) -> float:
    """Average cosine between distinct pairs: 1 for aligned micro-gradients, near 0 or below for disagreeing ones."""
    if len(vectors) < 2:
        return 1.0
    unit = torch.stack([v / torch.linalg.vector_norm(v) for v in vectors])
    gram = unit @ unit.T
    n = len(vectors)
    return float((gram.sum() - gram.diagonal().sum()) / (n * (n - 1)))


# --------------------------------------------------------------------------- synthetic micro-gradients


def synthetic_micro_gradients(k: int, alignment: float, norm: float = 1.0, dim: int = 256, seed: int = 0) -> list[torch.Tensor]:
    r"""K micro-gradients :math:`g_k = \text{norm}\cdot(\sqrt{a}\,u + \sqrt{1-a}\,n_k)/\|\cdot\|` sharing the unit
    direction u with weight a = ``alignment`` (independent random unit vectors n_k); their pairwise cosines are
    about a."""
    require_k(k)
    if not 0.0 <= alignment <= 1.0:
        raise ValueError(f"alignment must lie in [0, 1] (0: unrelated micro-gradients, 1: identical), got {alignment}.")
    if norm <= 0:
        raise ValueError(f"norm must be positive, got {norm}.")
    gen = torch.Generator().manual_seed(seed)
    u = torch.randn(dim, generator=gen, dtype=torch.float64)
    u /= torch.linalg.vector_norm(u)
    grads = []
    for _ in range(k):
        n = torch.randn(dim, generator=gen, dtype=torch.float64)
        n /= torch.linalg.vector_norm(n)
        g = math.sqrt(alignment) * u + math.sqrt(1 - alignment) * n
        grads.append(norm * g / torch.linalg.vector_norm(g))
    return grads


@dataclass(frozen=True)
class PlacementEffect:
    """Final norm (in units of the threshold c) and cosine to the correct clipped gradient of one placement."""

    placement: str
    norm_over_c: float
    cosine: float


def placement_effects(k: int, c: float, alignment: float, norm: float = 1.0, seed: int = 0) -> list[PlacementEffect]:
    """The widget's pure function: every placement on synthetic micro-gradients of norm ``norm``."""
    _require_threshold(c)
    grads = synthetic_micro_gradients(k, alignment, norm, seed=seed)
    correct = combine(grads, c, "once")
    rows = []
    for placement in PLACEMENTS:
        result = combine(grads, c, placement)  # type: ignore[arg-type]
        cos = torch.nn.functional.cosine_similarity(result, correct, dim=0)
        rows.append(PlacementEffect(placement, float(torch.linalg.vector_norm(result)) / c, float(cos)))
    return rows


def running_buffer_norms(micro_grads: Sequence[torch.Tensor], c: float) -> list[float]:
    r"""Placement (b): the norm :math:`\lVert r_{k-1} + g_k/K\rVert` of the running buffer just *before* each
    clip, :math:`k = 1..K`. The step has norm :math:`c` (up to :math:`10^{-6}`) exactly when the last entry
    exceeds :math:`c`; otherwise the last clip does nothing and the step is that (shorter) buffer."""
    return [norm for norm, _ in _running_pass(micro_grads, c)]


def running_clip_weights(micro_grads: Sequence[torch.Tensor], c: float) -> list[float]:
    r"""Placement (b) returns :math:`\sum_j w_j g_j` with :math:`w_j = \frac1K\prod_{i\ge j}\kappa_i`, where
    :math:`\kappa_i\le 1` is the coefficient of the clip after micro-batch i. The correct step has
    :math:`w_j = \kappa/K` for all j: equal weights."""
    coefs = [coef for _, coef in _running_pass(micro_grads, c)]
    k = len(coefs)
    return [math.prod(coefs[j:]) / k for j in range(k)]


def _running_pass(micro_grads: Sequence[torch.Tensor], c: float) -> list[tuple[float, float]]:
    """Placement (b) step by step: (norm of the running buffer before the clip, the clip's coefficient) after
    each micro-batch, with ``clip_grad_norm_``'s coefficient min(1, c / (norm + 1e-6))."""
    _require_threshold(c)
    k = len(micro_grads)
    require_k(k)
    running = torch.zeros_like(micro_grads[0])
    steps = []
    for g in micro_grads:
        running = running + g / k
        norm = float(torch.linalg.vector_norm(running))
        coef = min(1.0, c / (norm + EPS))
        running = running * coef
        steps.append((norm, coef))
    return steps


def clip_with_scaler(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, k: int, c: float,
                     unscale_first: bool = True, init_scale: float = 2.0**16) -> torch.Tensor:
    """The gradient an optimizer would receive from the torch.amp recipe with accumulation and clipping:
    ``scaler.scale(loss / K).backward()`` per micro-batch, then either ``unscale_`` → clip (right) or clip →
    ``unscale_`` (wrong; ``scaler.step`` would unscale after the clip). Runs on a copy of ``model``."""
    import copy

    _require_threshold(c)
    work = copy.deepcopy(model)
    work.zero_grad(set_to_none=True)
    device_type = next(work.parameters()).device.type
    opt = torch.optim.SGD(work.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler(device_type, init_scale=init_scale)
    for xb, yb in split_batch(x, y, k):
        scaler.scale(loss_fn(work(xb), yb) / k).backward()
    params = list(work.parameters())
    if unscale_first:
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, c)
    else:
        torch.nn.utils.clip_grad_norm_(params, c)
        scaler.unscale_(opt)
    return flat_grad(work).detach()


def placement_table(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, ks: Sequence[int],
                    c: float, mode: Literal["norm", "value"] = "norm") -> dict[int, dict[str, tuple[float, float]]]:
    """For each K: micro-gradient agreement, and per placement (final size / c, cosine to the correct step).

    Size is the L2 norm for ``mode="norm"`` and the largest |element| for ``mode="value"``. Each row also holds,
    in units of c and in the first slot, the size of the unclipped accumulated gradient (``"full"``), of the
    shortest and longest micro-gradient (``"smallest"``, ``"largest"``) and, for ``mode="norm"``, the norm of
    placement (b)'s buffer before its last clip (``"buffer"``, :func:`running_buffer_norms`; NaN by value).
    """
    table: dict[int, dict[str, tuple[float, float]]] = {}
    nan = float("nan")
    for k in ks:
        grads = micro_gradients(model, loss_fn, x, y, k)
        correct = combine(grads, c, "once", mode)
        sizes = [float(torch.linalg.vector_norm(g) if mode == "norm" else g.abs().max()) / c for g in grads]
        full = sum(grads) / k  # type: ignore[operator]
        row = {"agreement": (mean_pairwise_cosine(grads), nan),
               "full": (float(torch.linalg.vector_norm(full) if mode == "norm" else full.abs().max()) / c, nan),
               "smallest": (min(sizes), nan), "largest": (max(sizes), nan),
               "buffer": (running_buffer_norms(grads, c)[-1] / c if mode == "norm" else nan, nan)}
        for placement in PLACEMENTS:
            g = combine(grads, c, placement, mode)  # type: ignore[arg-type]
            size = torch.linalg.vector_norm(g) if mode == "norm" else g.abs().max()
            row[placement] = (float(size) / c, float(torch.nn.functional.cosine_similarity(g, correct, dim=0)))
        table[k] = row
    return table


def format_placement_table(table: dict[int, dict[str, tuple[float, float]]], size: str = "norm") -> str:
    head = f"{'K':>3} {'agreement':>10}  " + "".join(f"{p:>22}" for p in PLACEMENTS)
    lines = [f"{'':>16}" + "".join(f"{f'{size}/c   cos':>22}" for _ in PLACEMENTS), head]
    for k, row in table.items():
        lines.append(f"{k:>3} {row['agreement'][0]:>10.3f}  " +
                     "".join(f"{row[p][0]:>14.3f} {row[p][1]:>6.3f} " for p in PLACEMENTS))
    return "\n".join(lines)


@dataclass(frozen=True)
class ClipRun:
    placement: str
    k: int
    val_acc: float
    losses: list[float]


def train_placements(split: DigitsSplit, k: int, c: float, epochs: int = 8, seed: int = 0,
                     placements: Sequence[str] = PLACEMENTS, norm: str = "group",
                     full_batch: bool = True) -> list[ClipRun]:
    """Train a SmallCNN with a per-sample normalization (``norm="group"`` or ``"layer"``, so that accumulation
    is otherwise exact) with each clip placement, plus (if ``full_batch``) the full batch clipped once
    (``placement="full batch"``, K = 1), on the same batches."""
    import functools

    from .accumulate import train
    from .book.models import make_cnn

    _require_threshold(c)
    if norm not in ("group", "layer"):
        raise ValueError(f"norm must be 'group' or 'layer' (per-sample statistics), got {norm!r}; with BatchNorm "
                         "the micro-batch statistics would change the runs as well (chapter 1).")
    runs = []
    for placement in (("full batch",) if full_batch else ()) + tuple(placements):
        kk, p = (1, "once") if placement == "full batch" else (k, placement)
        backward_fn = functools.partial(clipped_accumulation, c=c, placement=_require_placement(p))
        model = make_cnn(norm, seed=seed, device=split.x_train.device)  # type: ignore[arg-type]
        r = train(model, split.x_train, split.y_train, split.x_val, split.y_val, batch_size=64, k=kk,
                  epochs=epochs, seed=seed, backward_fn=backward_fn)
        runs.append(ClipRun(placement, kk, r.val_acc, r.train_loss))
    return runs


def last_epoch_loss(run: ClipRun, epochs: int) -> float:
    """Mean training loss over the optimizer steps of the last epoch."""
    per_epoch = len(run.losses) // epochs
    return sum(run.losses[-per_epoch:]) / per_epoch


#: Set-ups of the robustness checks: (normalization, threshold c).
SETUPS: tuple[tuple[str, float], ...] = (("group", 0.3), ("layer", 0.3), ("group", 1.0))


def table_sweep(split: DigitsSplit, setups: Sequence[tuple[str, float]] = SETUPS, seeds: Sequence[int] = (0, 1, 2),
                ks: Sequence[int] = (1, 2, 4, 8, 16), batch_size: int = 64
                ) -> dict[tuple[str, float, int], dict[int, dict[str, tuple[float, float]]]]:
    """:func:`placement_table` for every set-up and seed: seed s takes a fresh SmallCNN initialized with seed s
    and the training batch of ``batch_size`` images number s."""
    from torch import nn as _nn

    from .book.models import make_cnn

    loss_fn = _nn.CrossEntropyLoss()
    out = {}
    for norm, c in setups:
        for s in seeds:
            x = split.x_train[s * batch_size:(s + 1) * batch_size]
            y = split.y_train[s * batch_size:(s + 1) * batch_size]
            model = make_cnn(norm, seed=s, device=x.device).train()  # type: ignore[arg-type]
            out[(norm, c, s)] = placement_table(model, loss_fn, x, y, ks, c)
    return out


def train_sweep(split: DigitsSplit, k: int = 8, epochs: int = 2, setups: Sequence[tuple[str, float]] = SETUPS,
                seeds: Sequence[int] = (0, 1, 2)) -> dict[tuple[str, float, int], dict[str, float]]:
    """Last-epoch training loss of every placement, for every set-up and seed (short runs: ``epochs``)."""
    out = {}
    for norm, c in setups:
        for s in seeds:
            runs = train_placements(split, k, c, epochs=epochs, seed=s, norm=norm, full_batch=False)
            out[(norm, c, s)] = {r.placement: last_epoch_loss(r, epochs) for r in runs}
    return out


def format_table_sweep(tables: dict[tuple[str, float, int], dict[int, dict[str, tuple[float, float]]]]) -> str:
    """One line per (normalization, c, seed): the unclipped ‖g‖/c, (a1) and (a2) as ‖step‖/c and (b)'s cosine to
    the correct step, at the smallest and the largest K > 1 of the tables."""
    first = next(iter(tables.values()))
    ks = [k for k in first if k > 1]
    lo, hi = ks[0], ks[-1]
    lines = [f"{'norm':<6} {'c':>4} {'seed':>4} {'‖g‖/c':>6}   {'(a1) ‖step‖/c':>15}   "
             f"{'(a2) ‖step‖/c':>15}   {'(b) cosine':>13}",
             f"{'':<23}" + f"   {f'K={lo}':>7}{f'K={hi}':>8}" * 3]
    for (norm, c, s), tab in tables.items():
        lines.append(f"{norm:<6} {c:>4g} {s:>4} {tab[lo]['full'][0]:>6.2f}   "
                     f"{tab[lo]['scaled_micro'][0]:>7.2f}{tab[hi]['scaled_micro'][0]:>8.2f}   "
                     f"{tab[lo]['raw_micro'][0]:>7.3f}{tab[hi]['raw_micro'][0]:>8.3f}   "
                     f"{tab[lo]['running'][1]:>7.3f}{tab[hi]['running'][1]:>8.3f}")
    return "\n".join(lines)


def format_train_sweep(losses: dict[tuple[str, float, int], dict[str, float]]) -> str:
    """One line per (normalization, c, seed): last-epoch training loss of every placement."""
    lines = [f"{'norm':<6} {'c':>4} {'seed':>4}  " + "".join(f"{LABELS[p].split(' ')[0]:>8}" for p in PLACEMENTS)]
    for (norm, c, s), row in losses.items():
        lines.append(f"{norm:<6} {c:>4g} {s:>4}  " + "".join(f"{row[p]:>8.4f}" for p in PLACEMENTS))
    return "\n".join(lines)


def raw_micro_all_clipped(agreement: float, k: int, smallest_over_c: float) -> float:
    r"""‖step‖/c of placement (a2) when *every* micro-gradient is longer than c.

    ``smallest_over_c`` is the norm of the shortest micro-gradient in units of c; the formula assumes it
    exceeds 1 (a ``ValueError`` otherwise: a micro-gradient shorter than c is not clipped, so compute the step
    with ``combine(grads, c, "raw_micro")`` instead).

    Then each :math:`\operatorname{clip}_c(g_k) = c\,u_k` with :math:`u_k` the unit direction of
    :math:`g_k`, and :math:`\lVert \frac1K\sum_k c\,u_k\rVert^2 = \frac{c^2}{K^2}\big(K + K(K-1)\bar a\big)`
    with :math:`\bar a` the mean pairwise cosine, so

    .. math:: \lVert\text{(a2)}\rVert / c = \sqrt{1/K + (1 - 1/K)\,\bar a}.

    At fixed agreement :math:`\bar a` the step still shrinks as K grows, towards :math:`\sqrt{\bar a}`
    (:math:`1/\sqrt K` for unrelated micro-gradients)."""
    require_k(k)
    if not -1.0 <= agreement <= 1.0:
        raise ValueError(f"agreement is a mean cosine and must lie in [-1, 1], got {agreement}.")
    if not smallest_over_c > 1.0:
        raise ValueError(f"the formula needs every micro-gradient longer than c, but the shortest has norm "
                         f"{smallest_over_c}·c; compute (a2) with combine(grads, c, 'raw_micro') instead.")
    return math.sqrt(max(0.0, 1 / k + (1 - 1 / k) * agreement))


def scaler_clip_norm(grad_norm: float, c: float, scale: float = 2.0**16, unscale_first: bool = False) -> float:
    """Norm of the gradient the optimizer receives from ``torch.amp.GradScaler`` with ``clip_grad_norm_(c)``,
    for an accumulated gradient of true norm ``grad_norm``: ``unscale_`` then clip (right) or clip then
    ``unscale_`` (wrong: the clip sees the scaled norm S·‖g‖ and brings it to c, unscaling leaves c/S).
    Uses a real scaler on one float64 parameter on the CPU."""
    _require_threshold(c)
    if not grad_norm > 0 or not math.isfinite(grad_norm):
        raise ValueError(f"grad_norm must be a positive finite number, got {grad_norm}.")
    p = nn.Parameter(torch.zeros(2, dtype=torch.float64))
    opt = torch.optim.SGD([p], lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    scaler.scale((p * torch.tensor([grad_norm, 0.0], dtype=torch.float64)).sum()).backward()
    if unscale_first:
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_([p], c)
    else:
        torch.nn.utils.clip_grad_norm_([p], c)
        scaler.unscale_(opt)
    return float(torch.linalg.vector_norm(p.grad))  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------- figures


def plot_placement_table(table: dict[int, dict[str, tuple[float, float]]]):
    """Final norm over c and cosine to the correct step, against K, one line per placement."""
    from .book.plotting import PALETTE, decorate, figure

    colors = {"once": PALETTE["black"], "scaled_micro": PALETTE["vermillion"], "raw_micro": PALETTE["blue"],
              "running": PALETTE["green"]}
    markers = {"once": "o", "scaled_micro": "^", "raw_micro": "v", "running": "s"}
    ks = list(table)
    fig, (ax1, ax2) = figure(2, 9.6, 3.6)
    for p in PLACEMENTS:
        ax1.plot(ks, [table[k][p][0] for k in ks], marker=markers[p], color=colors[p], label=LABELS[p])
        ax2.plot(ks, [table[k][p][1] for k in ks], marker=markers[p], color=colors[p])
    decorate(ax1, "accumulation steps K", "‖step‖ / c", "Size of the clipped step", xscale="log", xticks=ks)
    ax1.legend(frameon=False, fontsize=8)
    decorate(ax2, "accumulation steps K", "cosine to the correct step", "Direction", xscale="log", xticks=ks)
    return fig


def plot_training(runs: list[ClipRun], window: int = 19):
    """Training loss (moving average over one epoch of steps) for every placement."""
    import numpy as np

    from .book.plotting import PALETTE, decorate, figure

    colors = {"full batch": PALETTE["sky"], "once": PALETTE["black"], "scaled_micro": PALETTE["vermillion"],
              "raw_micro": PALETTE["blue"], "running": PALETTE["green"]}
    styles = {"full batch": "-", "once": "--"}
    fig, (ax,) = figure()
    for r in runs:
        smooth = np.convolve(r.losses, np.ones(window) / window, mode="valid")
        label = "full batch, clipped once (K = 1)" if r.placement == "full batch" else LABELS[r.placement]
        ax.plot(np.arange(window, len(r.losses) + 1), smooth, styles.get(r.placement, "-"),
                color=colors[r.placement], label=label, linewidth=2.5 if r.placement == "full batch" else 1.5)
    decorate(ax, "optimizer step", "training loss (moving average)", f"Training with K = {runs[-1].k}, same batches")
    ax.legend(frameon=False, fontsize=8)
    return fig


def plot_running_weights(weights: list[float], c: float):
    from .book.plotting import PALETTE, decorate, figure

    fig, (ax,) = figure()
    k = len(weights)
    ax.bar(range(1, k + 1), weights, color=PALETTE["green"], label="(b) clip the running buffer")
    decorate(ax, "micro-batch j (in the order processed)", "weight w_j of g_j in the step",
             f"Placement (b), K = {k}, c = {c}: later micro-batches count more", xticks=list(range(1, k + 1)))
    return fig


def plot_placement_effects(k: int, c: float, alignment: float):
    """The widget's picture: final norm / c and cosine to the correct step, per placement."""
    from .book.plotting import PALETTE, decorate, figure

    rows = placement_effects(k, c, alignment)
    names = [LABELS[r.placement] for r in rows]
    fig, (ax1, ax2) = figure(2, 9.6, 3.4)
    ax1.barh(names, [r.norm_over_c for r in rows], color=PALETTE["vermillion"])
    ax1.axvline(1.0, color="black", linewidth=1)
    decorate(ax1, "‖step‖ / c", "", f"K = {k}, c = {c:g}, micro-gradients of norm 1")
    ax2.barh(names, [r.cosine for r in rows], color=PALETTE["blue"])
    ax2.set_yticks(range(len(names)), [""] * len(names))
    ax2.set_xlim(-0.05, 1.05)
    decorate(ax2, "cosine to the correct step", "", f"alignment of micro-gradients = {alignment:g}")
    return fig


def placement_grid(ks: Sequence[int], alignments: Sequence[float], c: float) -> dict[str, "np.ndarray"]:
    """‖step‖/c over K (rows) × alignment (columns), per placement, for synthetic micro-gradients of norm 1."""
    import numpy as np

    out = {p: np.zeros((len(ks), len(alignments))) for p in PLACEMENTS}
    for i, k in enumerate(ks):
        for j, a in enumerate(alignments):
            for e in placement_effects(k, c, a):
                out[e.placement][i, j] = e.norm_over_c
    return out


def plot_placement_grid(grid: dict[str, "np.ndarray"], ks: Sequence[int], alignments: Sequence[float]):
    from .book.plotting import figure, heatmap

    fig, axes = figure(4, 14.0, 3.6)
    vmax = max(float(g.max()) for g in grid.values())
    for ax, p in zip(axes, PLACEMENTS):
        image = heatmap(ax, grid[p], ks, [f"{a:g}" for a in alignments], vmin=0.0, vmax=vmax, xlabel="alignment",
                        ylabel="K", title=LABELS[p].split(") ")[0] + ")")
    fig.colorbar(image, ax=axes, label="‖step‖ / c", shrink=0.9)
    return fig
