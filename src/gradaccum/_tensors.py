r"""The tensor helpers every core module shares (private): one copy each, unchecked.

Each public function that uses one validates its arguments first (with :mod:`gradaccum._validate`) and says what
is wrong in its own words; these helpers assume valid input.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import cast

import torch

#: ``clip_grad_norm_``'s constant: the coefficient is :math:`\min(1, c / (\lVert v\rVert + 10^{-6}))`.
EPS = 1e-6


def split_tensors(tensors: Sequence[torch.Tensor], k: int) -> list[tuple[torch.Tensor, ...]]:
    """``k`` equal, consecutive micro-batches of each tensor along dimension 0, as tuples (views, no copy).

    Assumes ``k`` divides a common, non-zero length ``n``: micro-batch ``j`` holds samples ``j·n/k … (j+1)·n/k − 1``.
    """
    return list(zip(*(t.chunk(k) for t in tensors)))


def micro_batches(x: torch.Tensor, y: torch.Tensor, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``k`` equal, consecutive ``(inputs, targets)`` micro-batches of ``(x, y)`` (:func:`split_tensors`)."""
    return cast(list[tuple[torch.Tensor, torch.Tensor]], split_tensors((x, y), k))


def flat_grads(params: Iterable[torch.Tensor], float64: bool = False) -> torch.Tensor:
    """Every parameter's ``.grad`` as one vector, zeros where a parameter has none.

    In the parameters' own dtype and device (not detached), or with ``float64=True`` detached, in float64 on the
    CPU: a reading that rounds nothing, whatever the parameters' dtypes and devices."""

    def one(p: torch.Tensor) -> torch.Tensor:
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        return g.detach().reshape(-1).double().cpu() if float64 else g.reshape(-1)

    return torch.cat([one(p) for p in params])


def relative_error(x: torch.Tensor, reference: torch.Tensor) -> float:
    r""":math:`\lVert x - r\rVert / \lVert r\rVert` in float64, or :math:`\lVert x - r\rVert` when :math:`r = 0`
    (no scale to relate to: the absolute difference)."""
    x, reference = x.double(), reference.double()
    difference, scale = float((x - reference).norm()), float(reference.norm())
    return difference / scale if scale > 0 else difference


def clip_vector(v: torch.Tensor, c: float, mode: str = "norm", norm_type: float = 2.0) -> torch.Tensor:
    r"""``clip_grad_norm_`` on one flat vector, out of place: :math:`v \cdot \min(1, c / (\lVert v\rVert_p +
    10^{-6}))`, the coefficient in ``v``'s dtype as torch computes it; or ``clip_grad_value_`` (``mode="value"``):
    every entry clamped to :math:`[-c, c]`."""
    if mode == "value":
        return v.clamp(-c, c)
    coefficient = c / (torch.linalg.vector_norm(v, norm_type) + EPS)
    return v * coefficient.clamp(max=1.0)
