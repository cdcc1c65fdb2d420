"""Chapter 3's errata cases: small two-dimensional micro-gradients on which each per-micro-batch clip placement
errs in both directions (a step too long or too short, turned or reversed), and the ratio a placement's step makes
to the correct one when every clip is ``torch.nn.utils.clip_grad_norm_`` in another norm.

A placement's error depends on how the micro-gradients are aligned, not only on their sizes; each case shows one
way it errs. :mod:`gradaccum.book.ch03_clip_ordering` re-exports the public names.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import cast

import torch

from gradaccum._validate import require_vectors
from gradaccum.book.tables import Table
from gradaccum.clipping import Comparison, Placement, _require_placement, _require_threshold, compare_to_once

#: Small two-dimensional cases for the errata: (placement, micro-gradients, threshold c).
ERRATA_CASES: dict[str, tuple[Placement, tuple[tuple[float, float], ...], float]] = {
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
        out[name] = compare_to_once(grads, c, placement)
    return out


def torch_clip_ratio(vectors: Sequence[Sequence[float]], c: float, placement: Placement, norm_type: float) -> float:
    """Length of a placement's step over the correct step's, both measured in ``norm_type``, with every clip made by
    ``torch.nn.utils.clip_grad_norm_(..., norm_type=norm_type)`` on float64 tensors (placements (c), (a1), (a2))."""
    _require_placement(placement)
    if placement == "running":
        raise ValueError("torch_clip_ratio covers (c), (a1) and (a2); (b) is clipping.clip_running_buffer.")
    c = _require_threshold(c)
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or not norm_type >= 1:
        raise ValueError(
            f"norm_type must be a number >= 1 (1, 2 or math.inf), got {norm_type!r}: below 1 it is not a norm."
        )
    try:
        grads = require_vectors([torch.tensor(v, dtype=torch.float64) for v in vectors], "vectors")
    except (TypeError, ValueError, RuntimeError) as err:
        raise ValueError(f"vectors must be K >= 1 lists of finite numbers of one length: {err}") from None
    k = len(grads)
    if not float(torch.linalg.vector_norm(cast(torch.Tensor, sum(grads)), norm_type)) > 0:
        raise ValueError(
            "the micro-gradients cancel exactly: the correct step is zero, and a ratio to it is "
            "undefined; pick vectors whose mean is not zero."
        )

    def clip(v: torch.Tensor) -> torch.Tensor:
        p = v.clone().requires_grad_()
        p.grad = v.clone()
        torch.nn.utils.clip_grad_norm_([p], c, norm_type=norm_type)
        return cast(torch.Tensor, p.grad)

    correct = clip(cast(torch.Tensor, sum(grads)) / k)
    if placement == "once":
        step = correct
    elif placement == "scaled_micro":
        step = cast(torch.Tensor, sum(clip(g / k) for g in grads))
    else:
        step = cast(torch.Tensor, sum(clip(g) for g in grads)) / k
    return float(torch.linalg.vector_norm(step, norm_type) / torch.linalg.vector_norm(correct, norm_type))


def format_errata_cases(cases: dict[str, Comparison]) -> Table:
    rows = []
    for name, r in cases.items():
        k, c = len(ERRATA_CASES[name][1]), ERRATA_CASES[name][2]
        cos = "n/a" if math.isnan(r.cosine) else f"{r.cosine:.2f}"  # a zero step has no direction
        rows.append([name, k, f"{c:g}", f"{r.norm:.3g}", f"{r.correct:.4g}", f"{r.ratio:.3g}", cos])
    return Table(["case", "K", "c", "step norm", "correct", "ratio", "cos"], rows)
