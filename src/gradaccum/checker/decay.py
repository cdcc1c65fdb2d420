r"""Weight decay in the gradient: a term proportional to the parameters :math:`\theta` that the step adds to the
micro-batch gradients (``p.grad += wd * p`` before the optimizer step, or an L2 term :math:`\lambda\|\theta\|^2` in
the loss), which the full-batch reference of ``loss_fn`` does not have. It is found, measured and taken out before
the fingerprints of :mod:`.rules` are read, so that the rest of the loop is judged as if it were not there.

The step's gradient is fitted as :math:`g = \sum_j w_j h_j + c\,\theta_S`, with :math:`\theta_S` the parameters of
the tensors S it decays (all of them, or those a per-tensor fit gives one common coefficient: a loop that spares
biases and norms). The term is named when it explains what the micro-batch gradients leave (the residual falls to
the fingerprints' threshold, and by a factor 10 or more) and is larger than the tolerance. Where it was added is
read from the ``.grad`` trace: between backward passes (each gap of the buffer a multiple of :math:`\theta_S`) or
inside them (an L2 term in the loss). Added once per window, it is a note; added after every micro-batch, the decay
is that many times the one the loop writes: a bug.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .measure import Measurements, _is_zero, fit_weights, rel
from .recorder import Pass
from .report import _Findings, num, nums


@dataclass
class Decay:
    """The term :math:`c\\,\\theta_S` in a step's gradient: ``coef`` c, ``column`` :math:`\\theta_S`, the names of
    the tensors it spares (``spared``, of ``tensors`` with parameters), the fit's relative ``residual``."""

    coef: float
    column: torch.Tensor
    spared: list[str]
    tensors: int
    residual: float


def _solver(rows: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """Least-squares coefficients of a vector on ``rows`` (R, N), the Gram matrix computed once."""
    norms = rows.norm(dim=1).clamp_min(1e-300)
    a = rows / norms[:, None]
    gram = a @ a.T
    return lambda v: torch.linalg.lstsq(gram, (a @ v)[:, None]).solution[:, 0] / norms


def _per_tensor(
    basis: torch.Tensor, g: torch.Tensor, theta: torch.Tensor, slices: list[tuple[str, slice]]
) -> list[float]:
    r"""Each tensor's own coefficient :math:`c_P` in :math:`g = \sum_j w_j h_j + \sum_P c_P \theta_P`, from the
    normal equations (the :math:`\theta_P` have disjoint supports: no (tensors, N) matrix is built)."""
    k = basis.shape[0]
    norms_h = basis.norm(dim=1).clamp_min(1e-300)
    a = basis / norms_h[:, None]
    units = [theta[sl] / max(float(theta[sl].norm()), 1e-300) for _, sl in slices]
    t = len(slices)
    gram = torch.eye(k + t, dtype=g.dtype)
    gram[:k, :k] = a @ a.T
    rhs = torch.zeros(k + t, dtype=g.dtype)
    rhs[:k] = a @ g
    for i, (_, sl) in enumerate(slices):
        gram[:k, k + i] = gram[k + i, :k] = a[:, sl] @ units[i]
        rhs[k + i] = units[i] @ g[sl]
    sol = torch.linalg.lstsq(gram, rhs[:, None]).solution[:, 0]
    return [float(sol[k + i]) / max(float(theta[sl].norm()), 1e-300) for i, (_, sl) in enumerate(slices)]


def find_decay(
    basis: torch.Tensor,
    g: torch.Tensor,
    theta: torch.Tensor | None,
    slices: list[tuple[str, slice]],
    thr: float,
    tol: float,
) -> Decay | None:
    """The term of the parameters in ``g`` (see the module's docstring), or None."""
    if theta is None or theta.shape != g.shape or not float(theta.norm()) or not float(g.norm()):
        return None
    live = [(name, sl) for name, sl in slices if float(theta[sl].norm()) > 0]
    if not live:
        return None
    _, r0, _ = fit_weights(basis, g)
    c_p = _per_tensor(basis, g, theta, live)
    top = max(range(len(live)), key=lambda i: abs(c_p[i]) * float(theta[live[i][1]].norm()))
    common = [abs(c - c_p[top]) <= 0.25 * abs(c_p[top]) for c in c_p]
    subset = theta.clone()
    for keep, (_, sl) in zip(common, live):
        if not keep:
            subset[sl] = 0
    best: Decay | None = None
    for column, spared in ((theta, []), (subset, [n for keep, (n, _) in zip(common, live) if not keep])):
        if column is subset and not spared:
            continue
        w, r1, _ = fit_weights(torch.cat([basis, column[None]]), g)
        c = w[-1]
        if (
            r1 <= thr
            and r0 >= 10 * r1
            and abs(c) * float(column.norm()) > tol * float(g.norm())
            and (best is None or r1 < best.residual)
        ):
            best = Decay(c, column, spared, len(live), r1)
    return best


def _along(v: torch.Tensor, column: torch.Tensor, thr: float) -> float:
    """a when ``v`` is a·column (to relative ``thr``), else 0."""
    a = float(v @ column) / float(column @ column)
    return a if float(v.norm()) > 0 and rel(v, a * column) <= thr else 0.0


def _trace(m: Measurements, d: Decay) -> tuple[list[Pass], list[tuple[int, float]], list[float]]:
    """The ``.grad`` trace with the term taken out, where it was added between backward passes ((backward passes
    before it, a)) and what each backward pass added of it."""
    loose = m.thr if m.thr < 1e-3 else 0.1  # a low-precision gap rounds the term to the buffer's own size
    solve = _solver(torch.cat([m.basis, d.column[None]]))
    added, gaps, passes, total, previous = [], [], [], 0.0, None
    for j, p in enumerate(m.passes):
        gap = p.before if previous is None else p.before - previous
        if j and _is_zero(p.before):
            total = 0.0  # emptied: the term added so far is gone with the rest
        else:
            a = _along(gap, d.column, loose)
            if abs(a) > 1e-3 * abs(d.coef):
                gaps.append((j, a))
                total += a
        before = p.before - total * d.column
        added.append(float(solve(p.after - p.before)[-1]))
        total += added[-1]
        passes.append(Pass(before, p.after - total * d.column, p.scale))
        previous = p.after
    if m.passes:
        a = _along(m.applied - m.passes[-1].after, d.column, loose)
        if abs(a) > 1e-3 * abs(d.coef):
            gaps.append((len(m.passes), a))
    return passes, gaps, added


def decay_findings(m: Measurements, out: _Findings, info: dict[str, Any]) -> Measurements:
    """Name a term of the parameters in the step's gradient, and return the measurements without it (the gradient
    and the ``.grad`` trace; ``info["compared"]``: the gradient compared with the reference)."""
    if rel(m.target, m.applied) <= m.tol:
        return m
    d = find_decay(m.basis, m.applied, m.params, m.param_slices, m.thr, m.tol)
    if d is None:
        return m
    passes, gaps, added = _trace(m, d)
    where = (
        f" on {d.tensors - len(d.spared)} of {d.tensors} parameter tensors (not on "
        f"{', '.join(d.spared[:3])}{', …' if len(d.spared) > 3 else ''})"
        if d.spared
        else ""
    )
    places = ", ".join("before the first backward" if j == 0 else f"after backward {j}" for j, _ in gaps[:4])
    if len(gaps) > 1:
        out.add(
            "weight_decay_per_micro_batch",
            "weight decay added to .grad after every micro-batch: the decay is that many times the one you add",
            f"a term proportional to the parameters{where}, "
            f"{nums([a for _, a in gaps[:4]])}·θ, was added to .grad {len(gaps)}× in one window of {m.k} "
            f"micro-batches ({places}{', …' if len(gaps) > 4 else ''}): {num(d.coef)}·θ in all; the comparison "
            "leaves it out",
            "add the decay once per optimizer step, after the last backward (or use the optimizer's weight_decay)",
            None,
        )
    else:
        how = (
            f"added to .grad once, {places}"
            if gaps
            else f"added by the backward passes ({nums(added[:6])}·θ "
            f"each{', …' if len(added) > 6 else ''}): an L2 term in the loss"
        )
        out.add(
            "weight_decay_in_gradient",
            "weight decay in the gradient: a term of the parameters that the reference, loss_fn alone, does not have",
            f"your step's gradient holds {num(d.coef)}·θ{where} "
            f"besides the micro-batch gradients, {how}; the comparison leaves it out",
            f"nothing to fix if {num(d.coef)}·θ is the decay you mean per optimizer step (an L2 term λ‖θ‖² "
            "gives 2λ·θ; in every micro-batch's loss without 1/K, it counts K times)",
            None,
            "note",
        )
    applied = m.applied - d.coef * d.column
    info["compared"], info["decay"] = applied, d.column
    return dataclasses.replace(m, applied=applied, passes=passes)
