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
  reversed: ``gradaccum.book.ch03_clip_ordering.ERRATA_CASES``).

Whether (a1) and (a2) are longer or shorter than the correct step :math:`\min(\lVert g\rVert, c)` is *not*
fixed: it depends on how the micro-gradients are aligned (the book's ``errata_cases`` give one example of each
direction). What is fixed are the upper bounds above (:func:`norm_bounds`) and two consequences: when the
full-batch gradient is clipped (:math:`\lVert g\rVert \ge c`), (a1) is at most K times and (a2) at most
once the correct length; with K = 2 neither is ever longer than :math:`\lVert g\rVert` (the clip is odd and
nonexpansive); with K ≥ 3 and :math:`\lVert g\rVert < c` neither ratio is bounded, and either can even point
the opposite way.
"""

from __future__ import annotations

import copy
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, cast

import torch
from torch import nn

from gradaccum import _tensors
from gradaccum._validate import require_flag, require_k, require_positive, require_vectors
from gradaccum.accumulate import LossFn, flat_grad, split_batch

Placement = Literal["once", "scaled_micro", "raw_micro", "running"]


PLACEMENTS: tuple[Placement, ...] = ("once", "scaled_micro", "raw_micro", "running")


LABELS: dict[str, str] = {
    "once": "(c) clip once, after accumulation",
    "scaled_micro": "(a1) clip each g_k/K, then sum",
    "raw_micro": "(a2) clip each g_k, then average",
    "running": "(b) clip the running .grad buffer",
}


EPS = _tensors.EPS  # clip_grad_norm_'s constant, 1e-6


def _require_threshold(c: float) -> float:
    """A clipping threshold must be a positive finite number."""
    if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c <= 0:
        raise ValueError(
            f"the clipping threshold must be a positive finite number (a Python float: pass float(c) "
            f"for a NumPy or torch scalar), got {c!r}."
        )
    return float(c)


def _require_mode(mode: str) -> None:
    if mode not in ("norm", "value"):
        raise ValueError(f"mode must be 'norm' or 'value', got {mode!r}.")


def _require_placement(placement: str) -> Placement:
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown placement {placement!r}; choose one of {PLACEMENTS}.")
    return cast(Placement, placement)  # checked just above


def clip_vector(v: torch.Tensor, c: float, mode: Literal["norm", "value"] = "norm") -> torch.Tensor:
    """``clip_grad_norm_`` (or ``clip_grad_value_``) applied to one flat vector, out of place."""
    _require_threshold(c)
    _require_mode(mode)
    if not isinstance(v, torch.Tensor) or not v.is_floating_point():
        raise ValueError(
            f"v must be a floating-point tensor (as a gradient is), got "
            f"{v.dtype if isinstance(v, torch.Tensor) else type(v).__name__}."
        )
    if not bool(torch.isfinite(v).all()):
        raise ValueError(
            "v contains inf or NaN: clipping cannot make it a gradient (torch's clip_grad_norm_ gives "
            "NaN, and a GradScaler skips such a step); find the overflow or the NaN upstream."
        )
    if mode == "norm" and not bool(torch.isfinite(torch.linalg.vector_norm(v))):
        wider = (
            "float32 (v.float())"
            if v.dtype == torch.float16
            else "float64 (v.double())"
            if v.dtype != torch.float64
            else "a rescaled copy (clip v / 2**k: the same result once its norm exceeds c)"
        )
        raise ValueError(
            f"the norm of v overflows {v.dtype} although its entries are finite: clip_grad_norm_ would "
            f"scale it by c/inf = 0; clip it in {wider}."
        )
    return _tensors.clip_vector(v, c, mode)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine of two vectors in float64, each scaled by its largest entry first (no underflow for tiny ones, no
    floor on the norms as ``F.cosine_similarity``'s eps); NaN when either is zero."""
    a64, b64 = a.detach().double().flatten(), b.detach().double().flatten()
    sa, sb = float(a64.abs().max()), float(b64.abs().max())
    if sa == 0 or sb == 0:
        return math.nan
    a64, b64 = a64 / sa, b64 / sb
    return float(a64 @ b64 / (torch.linalg.vector_norm(a64) * torch.linalg.vector_norm(b64)))


def combine(
    micro_grads: Sequence[torch.Tensor], c: float, placement: Placement, mode: Literal["norm", "value"] = "norm"
) -> torch.Tensor:
    """The step's gradient from the raw micro-batch gradients ``g_k`` under each clip placement (the math of
    :func:`clipped_accumulation` on plain vectors, used by the widget and the exercises)."""
    _require_threshold(c)
    _require_placement(placement)
    micro_grads = require_vectors(micro_grads)
    k = len(micro_grads)
    # sum() of K >= 1 tensors is a tensor (typeshed types it ``Tensor | Literal[0]`` for the empty case)
    if placement == "once":  # each g_k / K first, as a loop's backward of loss / K adds them (no overflow of the sum)
        return clip_vector(cast(torch.Tensor, sum(g / k for g in micro_grads)), c, mode)
    if placement == "scaled_micro":
        return cast(torch.Tensor, sum(clip_vector(g / k, c, mode) for g in micro_grads))
    if placement == "raw_micro":
        return cast(torch.Tensor, sum(clip_vector(g, c, mode) for g in micro_grads)) / k
    return clip_running_buffer([g / k for g in micro_grads], c, mode)


def clip_running_buffer(
    contributions: Sequence[torch.Tensor], c: float, mode: Literal["norm", "value"] = "norm"
) -> torch.Tensor:
    r"""The buffer after adding each contribution and clipping it every time:
    :math:`r_k = \operatorname{clip}_c(r_{k-1} + d_k)`, :math:`r_0 = 0`, returned as :math:`r_K`.

    Placement (b) is this with :math:`d_k = g_k/K`; a loop without the :math:`1/K` factor (the Hugging Face
    issue's example) passes the raw :math:`g_k`."""
    _require_threshold(c)
    contributions = require_vectors(contributions, "contributions")
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

    Lower bounds do not exist beyond 0: opposing micro-gradients cancel after clipping (the book's ``errata_cases``).
    """
    _require_threshold(c)
    micro_grads = require_vectors(micro_grads)
    k = len(micro_grads)
    norms = [float(torch.linalg.vector_norm(g)) for g in micro_grads]
    mean = float(torch.linalg.vector_norm(sum(micro_grads) / k))
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
    norm: float  # norm of the placement's step
    correct: float  # norm of clip_c(g), the correct step
    cosine: float  # cosine between the two steps (NaN when either is zero up to clip_grad_norm_'s 1e-6)
    floor: float = EPS  # below this a step is zero up to clip_grad_norm_'s 1e-6 (see compare_to_once)

    @property
    def ratio(self) -> float:
        """Length of the placement's step in units of the correct one (NaN when the correct step is zero up to
        ``clip_grad_norm_``'s 1e-6: no unit to measure in)."""
        return self.norm / self.correct if self.correct >= self.floor and self.correct > 0 else math.nan


def compare_to_once(micro_grads: Sequence[torch.Tensor], c: float, placement: Placement) -> Comparison:
    r"""The step under ``placement`` next to the correct step :math:`\operatorname{clip}_c(g)`.

    ``clip_grad_norm_``'s :math:`10^{-6}` term leaves a residue of at most about :math:`10^{-6}` times the smaller
    of c and the micro-gradients' mean norm where an exact projection would give 0 (opposite micro-gradients
    clipped to c each): a step shorter than that floor is zero up to it, its direction is rounding noise, and its
    cosine (and a ratio to it) is reported as NaN. Where no clip acted (every vector clipped is shorter than
    :math:`c - 10^{-6}`), both steps are plain sums, the floor is 0, and only an exactly zero step has no cosine."""
    step = combine(micro_grads, c, placement)
    correct = combine(micro_grads, c, "once")
    scale = sum(float(torch.linalg.vector_norm(g.double())) for g in micro_grads) / len(micro_grads)
    # the residue comes from a clip that acted; where none did, both steps are exact sums and keep their directions
    acted = _clip_acted(micro_grads, c, placement) or _clip_acted(micro_grads, c, "once")
    floor = EPS * min(float(c), scale) if acted else 0.0
    n, m = float(torch.linalg.vector_norm(step)), float(torch.linalg.vector_norm(correct))
    cos = cosine(step, correct) if n >= floor and m >= floor else math.nan
    return Comparison(placement, n, m, cos, floor)


def _clip_acted(micro_grads: Sequence[torch.Tensor], c: float, placement: Placement) -> bool:
    r"""Whether any clip of ``placement`` scaled its vector (``clip_grad_norm_``'s coefficient
    :math:`c/(\lVert v\rVert + 10^{-6})` below 1)."""
    k = len(micro_grads)
    if placement == "once":
        norms = [float(torch.linalg.vector_norm(sum(g.double() / k for g in micro_grads)))]
    elif placement == "scaled_micro":
        norms = [float(torch.linalg.vector_norm(g.double())) / k for g in micro_grads]
    elif placement == "raw_micro":
        norms = [float(torch.linalg.vector_norm(g.double())) for g in micro_grads]
    else:
        norms = running_buffer_norms(micro_grads, c)
    return any(n + EPS > c for n in norms)


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


def clipped_accumulation(
    model: nn.Module,
    loss_fn: LossFn,
    x: torch.Tensor,
    y: torch.Tensor,
    k: int,
    c: float,
    placement: Placement = "once",
    mode: Literal["norm", "value"] = "norm",
) -> float:
    """One accumulation loop with the clip placement as a parameter; gradients end in ``.grad``.

    Uses ``torch.nn.utils.clip_grad_norm_`` (``clip_grad_value_`` with ``mode="value"``) on the parameters'
    ``.grad``, as a training script would. For the per-micro-batch placements the micro-batch's gradient is
    isolated (the running sum is set aside during its backward pass) so that only it is clipped. The caller
    zeroes gradients before and steps after. Returns the batch loss.
    """
    _require_threshold(c)
    _require_placement(placement)
    _require_mode(mode)
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
    """The raw gradients g_k of each micro-batch's mean loss, as flat vectors. Computed on a copy: the model's
    ``.grad`` and buffers (BatchNorm's running statistics) are left as they were."""
    work = copy.deepcopy(model)
    grads = []
    for xb, yb in split_batch(x, y, k):
        work.zero_grad(set_to_none=True)
        loss_fn(work(xb), yb).backward()
        grads.append(flat_grad(work).detach().clone())
    return grads


def mean_pairwise_cosine(vectors: Sequence[torch.Tensor]) -> float:
    """Average cosine between distinct pairs: 1 for aligned micro-gradients, near 0 or below for disagreeing ones
    (1 for a single vector). A zero vector has no direction and is refused."""
    vectors = require_vectors(vectors, "vectors")
    for i, v in enumerate(vectors):
        if not v.abs().max() > 0:
            raise ValueError(f"vectors[{i}] is zero and has no direction; leave it out of the cosines.")
    if len(vectors) < 2:
        return 1.0
    scaled = [v.double() / v.double().abs().max() for v in vectors]  # no underflow of tiny float32 norms
    unit = torch.stack([v / torch.linalg.vector_norm(v) for v in scaled])
    gram = unit @ unit.T
    n = len(vectors)
    mean = float((gram.sum() - gram.diagonal().sum()) / (n * (n - 1)))
    return min(1.0, max(-1.0 / (n - 1), mean))  # the exact range: rounding can step out of it by an ulp


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
    micro_grads = require_vectors(micro_grads)
    k = len(micro_grads)
    running = torch.zeros_like(micro_grads[0])
    steps = []
    for g in micro_grads:
        running = running + g / k
        norm = float(torch.linalg.vector_norm(running))
        coef = min(1.0, c / (norm + EPS))
        running = running * coef
        steps.append((norm, coef))
    return steps


def _require_scaler_scale(scale: float, name: str) -> None:
    """A loss scale GradScaler can hold and invert: it keeps S in float32 and unscales by 1/S computed in float64
    and rounded to float32, which is infinite below about 2.94e-39 (every gradient would turn into inf or NaN)."""
    require_positive(scale, name)
    top = torch.finfo(torch.float32).max
    if scale > top:
        raise ValueError(
            f"GradScaler keeps its scale in float32, whose largest value is {top:g}; got {name} {scale:g}."
        )
    held = torch.tensor(float(scale), dtype=torch.float32)
    if float(held) == 0.0 or not math.isfinite(float(held.double().reciprocal().float())):
        raise ValueError(
            f"GradScaler unscales by 1/S in float32, which is infinite for S = {scale:g} (below "
            f"{1 / top:.3g}): every gradient would become inf or NaN. Use a scale of at least "
            f"{1 / top:.3g}."
        )


def clip_with_scaler(
    model: nn.Module,
    loss_fn: LossFn,
    x: torch.Tensor,
    y: torch.Tensor,
    k: int,
    c: float,
    unscale_first: bool = True,
    init_scale: float = 2.0**16,
) -> torch.Tensor:
    """The gradient an optimizer would receive from the torch.amp recipe with accumulation and clipping:
    ``scaler.scale(loss / K).backward()`` per micro-batch, then either ``unscale_`` → clip (right) or clip →
    ``unscale_`` (wrong; ``scaler.step`` would unscale after the clip). Runs on a copy of ``model``."""

    _require_threshold(c)
    require_flag(unscale_first, "unscale_first", "True: unscale_ then clip, the right order")
    _require_scaler_scale(init_scale, "init_scale")
    if any(p.dtype == torch.float16 for p in model.parameters()):
        raise ValueError(
            "the model has float16 parameters, whose gradients GradScaler refuses to unscale (torch: "
            "'Attempting to unscale FP16 gradients'); keep the parameters in float32 and run the forward "
            "under torch.autocast(device_type, dtype=torch.float16), the recipe of chapter 4."
        )
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
    grad = flat_grad(work).detach()
    if not bool(torch.isfinite(grad).all()):
        raise ValueError(
            "the gradient is not finite (inf or NaN, from the data or an overflow at this loss scale): "
            "GradScaler.step would skip this step, so no optimizer receives a gradient; check the inputs, "
            f"or, if S = {init_scale:g} times the gradients overflowed, use a smaller init_scale."
        )
    return grad


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
    for name, value in (("agreement", agreement), ("smallest_over_c", smallest_over_c)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value!r}.")
    low = -1.0 / (k - 1 if k > 1 else 1)
    if low - 1e-12 <= agreement <= 1.0 + 1e-12:  # a cosine computed in floating point may step out by an ulp
        agreement = min(1.0, max(low, float(agreement)))
    else:
        raise ValueError(
            f"agreement is the mean pairwise cosine of K = {k} unit vectors, which lies in "
            f"[-1/(K-1), 1] = [{-1 / max(k - 1, 1):.3g}, 1], got {agreement}."
        )
    if not smallest_over_c > 1.0:
        raise ValueError(
            f"the formula needs every micro-gradient longer than c, but the shortest has norm "
            f"{smallest_over_c}·c; compute (a2) with combine(grads, c, 'raw_micro') instead."
        )
    return math.sqrt(max(0.0, 1 / k + (1 - 1 / k) * agreement))


def scaler_clip_norm(grad_norm: float, c: float, scale: float = 2.0**16, unscale_first: bool = True) -> float:
    """Norm of the gradient the optimizer receives from ``torch.amp.GradScaler`` with ``clip_grad_norm_(c)``,
    for an accumulated gradient of true norm ``grad_norm``: ``unscale_`` then clip (right) or clip then
    ``unscale_`` (``unscale_first=False``, wrong: the clip sees the scaled norm S·‖g‖ and brings it to c, unscaling
    leaves c/S). The default is the right order, as in :func:`clip_with_scaler`. Uses a real scaler on one float64
    parameter on the CPU."""
    _require_threshold(c)
    require_flag(unscale_first, "unscale_first", "True: unscale_ then clip, the right order")
    require_positive(grad_norm, "grad_norm")
    _require_scaler_scale(scale, "the loss scale")
    if grad_norm * scale > torch.finfo(torch.float64).max / 4:
        raise ValueError(f"grad_norm · scale = {grad_norm * scale:g} overflows float64; give a smaller scale.")
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
    return float(torch.linalg.vector_norm(p.grad))
