"""The measurements the rules read (:class:`Measurements`), and the arithmetic on gradients they share: relative
error, cosine, least-squares micro-batch weights, chapter 3's clip placements."""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from gradaccum import _tensors

from .recorder import Event, Pass


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖b − a‖ / ‖a‖ (‖b − a‖ when a = 0): the reference first (:func:`gradaccum._tensors.relative_error`)."""
    return _tensors.relative_error(b, a)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    na, nb = float(a.norm()), float(b.norm())
    return float(a @ b) / (na * nb) if na > 0 and nb > 0 else float("nan")


def fit_weights(basis: torch.Tensor, g: torch.Tensor) -> tuple[list[float], float, float]:
    r"""Least-squares weights :math:`w = \arg\min\|g - \sum_j w_j h_j\|`, the relative residual, and the
    condition number of the (normalized) Gram matrix. ``basis`` is (K, P).

    A micro-batch whose gradient is exactly zero (every target ignored, all padding) contributes nothing whatever
    its weight: its weight is undetermined, and it is given the median of the others' (so that it neither hides
    nor invents a pattern in them); the fit and the condition number use the other micro-batches."""
    norms = basis.norm(dim=1)
    live = norms > 0
    if not bool(live.any()):
        return [0.0] * basis.shape[0], (1.0 if float(g.norm()) > 0 else 0.0), float("inf")
    a = basis[live] / norms[live][:, None]
    gram = a @ a.T
    rhs = a @ g
    eig = torch.linalg.eigvalsh(gram)
    cond = float(eig[-1] / eig[0].clamp_min(1e-300)) if eig[0] > 0 else float("inf")
    sol = torch.linalg.lstsq(gram, rhs[:, None]).solution[:, 0]
    w = torch.full_like(norms, float((sol / norms[live]).median()))
    w[live] = sol / norms[live]
    residual = rel(g, w @ basis) if float(g.norm()) > 0 else 0.0
    return [float(v) for v in w], residual, cond


def clip_vec(v: torch.Tensor, c: float, kind: str = "norm", norm_type: float = 2.0) -> torch.Tensor:
    """``clip_grad_norm_`` (coefficient min(1, c/(‖v‖+1e-6))) or ``clip_grad_value_`` on a flat vector
    (:func:`gradaccum._tensors.clip_vector`)."""
    return _tensors.clip_vector(v, c, kind, norm_type)


def placements(
    basis: torch.Tensor, f: Sequence[float], c: float, kind: str = "norm", norm_type: float = 2.0
) -> dict[str, torch.Tensor]:
    """Chapter 3's clipping placements for micro-batch gradients ``basis`` weighted by ``f``."""
    parts = [fj * basis[j] for j, fj in enumerate(f)]
    running = torch.zeros_like(basis[0])
    for p in parts:
        running = clip_vec(running + p, c, kind, norm_type)
    # sum() of tensors is a tensor (typeshed types it ``Tensor | Literal[0]`` for the empty case)
    return {
        "once": clip_vec(cast(torch.Tensor, sum(parts)), c, kind, norm_type),
        "scaled_micro": cast(torch.Tensor, sum(clip_vec(p, c, kind, norm_type) for p in parts)),
        "raw_micro": cast(torch.Tensor, sum(fj * clip_vec(basis[j], c, kind, norm_type) for j, fj in enumerate(f))),
        "running": running,
    }


def tolerances(
    params: list[torch.nn.Parameter], loss: torch.dtype, tolerance: float | None
) -> tuple[float, float, str | None]:
    """The verdict's tolerance and the fitted weights' rounding: 1e-9 when the parameters and the loss (its dtype) are
    float64, else the coarsest of their formats (1e-4 for float32; parameters held in bf16 or fp16 round every
    gradient to their format: 8 of its epsilons count as equal); and a note when the loss's format, coarser than
    the parameters', sets them (transformers' losses cast the logits to float32, float64 ones too)."""
    dtypes = [p.dtype for p in params]
    coarser = loss.is_floating_point and torch.finfo(loss).eps > max(torch.finfo(d).eps for d in dtypes)
    if coarser:
        dtypes.append(loss)
    float64 = all(d == torch.float64 for d in dtypes)
    low = 8 * max(torch.finfo(d).eps for d in dtypes)
    tol = float(tolerance) if tolerance is not None else (1e-9 if float64 else max(1e-4, low))
    wtol = 1e-9 if float64 else max(1e-5, low)
    note = None
    if coarser and tolerance is None:
        note = (
            f"precision: the loss is computed in {str(loss).replace('torch.', '')}, coarser than the "
            f"parameters' (as in transformers, whose losses cast the logits to float32): the tolerance is that "
            f"format's, {tol:.2g}"
        )
    return tol, wtol, note


def _dtype_eps(name: object) -> float:
    """Machine epsilon of the floating dtype called ``name`` ("bfloat16"), 0 for anything else."""
    dtype = getattr(torch, str(name), None)
    return float(torch.finfo(dtype).eps) if isinstance(dtype, torch.dtype) and dtype.is_floating_point else 0.0


@dataclass
class Measurements:
    """Everything :func:`diagnose` reads."""

    k: int
    b: int
    n: int
    tol: float
    wtol: float  # rounding of the fitted weights (float64: 1e-9, otherwise 1e-5)
    basis: torch.Tensor  # (K, P) micro-batch gradients h_j
    full: torch.Tensor  # full-batch gradient
    target: torch.Tensor  # full batch, clipped once when a threshold applies
    applied: torch.Tensor  # what the step produced
    f: list[float]  # loss weights of micro-batches
    loss_residual: float
    tokens: list[int]
    clip: float | None
    clip_kind: str
    clip_norm_type: float
    clip_source: str | None  # "argument", "your loop" or None
    events: list[Event]
    passes: list[Pass]
    error: BaseException | None
    forwards: list[tuple[int, int]]
    unreplayed: list[str]
    random_draws: int
    reseeded: tuple[int, int] | None  # (identical draws, draws compared) between two starting states
    coupled: Callable[[], list[tuple[str, str, float]]]
    param_slices: list[tuple[str, slice]]
    has_step: bool
    outside_draws: list[str] = field(default_factory=list)  # random ops the step ran outside the model's forward
    # the loss weights f again at slightly moved outputs, when they follow the outputs smoothly: a weighting set
    # by a batch-wide value of the outputs (check._loss_probe)
    f_moved: list[float] | None = None
    loss_thr: float | None = None  # what counts as equal in the loss probe (its dtype's rounding); None: thr
    params: torch.Tensor | None = None  # the trainable parameters θ as the window starts (flat, as basis)

    @property
    def thr(self) -> float:
        """What counts as equal when reading fingerprints (weights, fits, scales): 1e-6 for float64, 1e-2 for
        lower precision, never below the tolerance the verdict uses."""
        return max(1e-6 if self.wtol < 1e-6 else 1e-2, self.tol)


def _user_frame(err: BaseException) -> str:
    """Where in the user's code an exception was raised: the innermost frame outside torch and gradaccum."""
    frames = traceback.extract_tb(err.__traceback__)
    skip = (os.sep + "torch" + os.sep, os.sep + "gradaccum" + os.sep + "check")
    mine = [f for f in frames if not any(s in f.filename for s in skip)]
    if not mine:
        return ""
    f = mine[-1]
    return f" at {os.path.basename(f.filename)}:{f.lineno} in {f.name}"


def _after(event: Event) -> str:
    return "before the first backward" if event.after == 0 else f"after micro-batch {event.after}"


def _counts(events: list[Event], kind: str) -> list[Event]:
    return [e for e in events if e.kind == kind]


def _is_zero(v: torch.Tensor) -> bool:
    return float(v.abs().max()) == 0.0 if v.numel() else True


def _inside(events: list[Event], last: int) -> list[Event]:
    """Events before the last backward pass of the window."""
    return [e for e in events if e.after < last]


def _most_per(events: list[Event], key: str) -> int:
    """The most calls any one object made (the optimizer or scheduler named by ``key`` in each event's detail)."""
    counts: dict[Any, int] = {}
    for e in events:
        counts[e.detail.get(key)] = counts.get(e.detail.get(key), 0) + 1
    return max(counts.values(), default=0)
