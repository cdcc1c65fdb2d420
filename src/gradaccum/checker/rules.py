r"""The fingerprints :func:`gradaccum.checker.check` names causes by, each derived from what was measured.

Notation. The window holds K micro-batches :math:`B_1,\dots,B_K`; :math:`h_j = \nabla_\theta L(\theta; B_j)` is the
gradient of ``loss_fn`` on micro-batch j alone (randomness replayed per sample). For a loss that is a sum over
positions (samples, or tokens), the full-batch gradient is a combination

.. math::
    \nabla_\theta L(\theta; B) = \sum_j f_j\, h_j

with weights :math:`f_j` measured on the loss alone (the gradient of ``loss_fn`` with respect to the model's
output, full batch against micro-batch j): :math:`f_j = 1/K` for a mean over samples, :math:`n_j/\sum_i n_i` for a
mean over :math:`n_j` tokens, 1 for a sum. When a layer couples the samples of a batch (BatchNorm in training)
the identity fails, and the difference between :math:`\sum_j f_j h_j` and the full batch is the layer's share.

A training step that only adds up micro-batch gradients, rescales its buffer, zeroes it or clips it produces
:math:`g = \sum_j w_j h_j` for some weights :math:`w_j`, found by least squares on :math:`h_1..h_K`. The weights
are the fingerprint:

* :math:`w_j = K f_j` for all j (relative error exactly K − 1, cosine 1): the loss was not divided by K;
  :math:`w_j = f_j / K`: divided twice; :math:`w_j = S f_j`: still multiplied by the loss scale S;
* :math:`w_j = 0` for all but the last micro-batches: the buffer was emptied inside the window (``zero_grad``);
* :math:`w_j` equal while :math:`f_j \propto n_j` differ: a mean of per-micro-batch token means;
* :math:`w_j` growing towards the last micro-batch, matching chapter 3's placements to rounding: clipping inside
  the window, on the running buffer (:math:`r_j = \mathrm{clip}(r_{j-1} + f_j h_j)`) or per micro-batch;
* :math:`w_j \propto S_j` with the loss scale :math:`S_j` in force at backward j: the scale changed inside the
  window.

Calls that leave the gradient unchanged (a scheduler stepped per micro-batch) are named from the recorded calls.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from .calls import _event_findings
from .decay import decay_findings
from .loop_rules import _loop_findings
from .measure import (
    Measurements,
    _after,
    _counts,
    _dtype_eps,
    _is_zero,
    _user_frame,
    clip_vec,
    cosine,
    fit_weights,
    rel,
)
from .model_rules import _coupling_findings, _loss_findings, _outside_randomness
from .report import (
    Finding,
    _Findings,
    num,
)
from .weights import (
    _backward_weight_findings,
)


def diagnose(m: Measurements) -> tuple[list[Finding], dict[str, Any]]:
    """All findings for one window, and the measured quantities a report shows (weights, scale, calls)."""
    out = _Findings()
    info: dict[str, Any] = {}
    last = len(m.passes)
    info["backward_passes"] = last
    if m.error is not None:
        _error_findings(m, out, m.error, last)
    _event_findings(m, out, last)
    if m.error is not None:
        return out.list(), info
    g = m.applied
    if _no_gradient_findings(m, out, g, last):
        return out.list(), info
    m = decay_findings(m, out, info)  # weight decay in the gradient: named, then taken out
    g = m.applied
    w, residual, cond = _fitted_weights(m, g)
    ideal_unclipped, clipped, clip_factor = _ideal(m)
    e = [fj * clip_factor for fj in m.f]
    info.update(weights=w, expected_weights=e, fit_residual=residual)
    error = rel(m.target, g)
    info["rel_error"], info["cosine"] = error, cosine(m.target, g)
    if error <= m.tol:
        # a clip that bites on both sides, or two bugs that cancel on this window (duplicate micro-batches, a
        # zero_grad and a missing 1/K), can hide a wrong weight from the step: read what each backward added
        # (not when the step is only within a tolerance the caller loosened: that is the caller's "equal")
        if _counts(m.events, "clip") or error <= m.wtol:
            _backward_weight_findings(m, out, rel(clipped, g), cosine(clipped, g))
        return out.list(), info

    # ---- the model or the loss: does the full batch equal the ideal accumulation of this model?
    coupled_loss = _loss_findings(m, out)
    model_error = rel(m.full, ideal_unclipped)
    if model_error > m.tol and not coupled_loss:
        _coupling_findings(m, out, ideal_unclipped, model_error)

    # ---- the loop: does the step produce the ideal accumulation?
    loop_error = rel(clipped, g)
    info["loop_error"] = loop_error
    if loop_error > m.tol and not coupled_loss:  # (the weights f mean nothing for a coupled loss)
        _loop_findings(m, out, w, e, residual, cond, clipped, loop_error)
    _closing_findings(m, out, g, error)
    return out.list(), info


def _error_findings(m: Measurements, out: _Findings, err: BaseException, last: int) -> None:
    """The step raised ``err``: the error itself, and the scaler misuse torch's message names."""
    events = m.events
    text = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}".rstrip(": ")
    updates = _counts(events, "scaler.update")
    out.add(
        "step_raised",
        f"your step raised {type(err).__name__}",
        f"{text}{_user_frame(err)}, after {last} backward pass(es); the window could not be compared",
        "fix the error (the findings below name its cause when it is a known one); the checker's verdict "
        "covers only what ran before it",
        None,
    )
    if "No inf checks were recorded" in str(err):
        out.add(
            "scaler_update_inside_window",
            "scaler.update() inside the window: the loss scale changes inside the window",
            f"scaler.update() called {_after(updates[-1]) if updates else ''} with no "
            "scaler.step() before it (torch raises: no inf checks recorded)",
            "call scaler.step(optimizer) and then scaler.update() once per window, after the last "
            "micro-batch's backward",
            4,
        )
    if "unscale_() has already been called" in str(err):
        out.add(
            "scaler_unscale_inside_window",
            "scaler.unscale_() inside the window",
            f"a second unscale_() in one window ({len(_counts(events, 'scaler.unscale_'))} calls)",
            "unscale_ once, after the last backward, then clip, then scaler.step",
            4,
        )


def _no_gradient_findings(m: Measurements, out: _Findings, g: torch.Tensor, last: int) -> bool:
    """A gradient that cannot be compared (inf or NaN) or that no backward reached; True when there is one."""
    if not bool(torch.isfinite(g).all()):
        out.add(
            "non_finite",
            "non-finite gradients after the window",
            "inf or NaN in the gradient your step produced",
            "with fp16, use a GradScaler (it skips the step on overflow); check the loss",
            4,
        )
        return True
    if last == 0 and _is_zero(g) and not _is_zero(m.target):
        out.add(
            "no_gradient",
            "your step left no gradient in the model it was given",
            "no backward pass reached the model's parameters and every .grad is empty",
            "compute the loss with the `model` argument of step (not a model from elsewhere) and call "
            "backward; leave the gradient in .grad (or step an optimizer built on model.parameters())",
            None,
        )
        return True
    return False


def _fitted_weights(m: Measurements, g: torch.Tensor) -> tuple[list[float], float, float]:
    """The micro-batch weights w that give ``g`` (least squares), rounding noise shown as 0; the fit's relative
    residual and the basis's condition number."""
    w, residual, cond = fit_weights(m.basis, g)
    top_w = max(abs(v) for v in w) if w else 0.0
    # rounding noise of the fit shown as 0 (under autocast, the noise of its dtype: a zeroed micro-batch reads
    # about 1e-4 of the others in bf16)
    zero = max([m.wtol, 1e-9] + [_dtype_eps(ev.detail.get("dtype", "")) for ev in _counts(m.events, "autocast")])
    return [v if abs(v) > zero * top_w else 0.0 for v in w], residual, cond


def _ideal(m: Measurements) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The ideal accumulation sum_j f_j h_j, the same clipped as the step's clip would clip the full batch's
    gradient, and the factor a norm clip scales it by."""
    clip_factor = 1.0
    ideal_unclipped = cast(torch.Tensor, sum(fj * m.basis[j] for j, fj in enumerate(m.f)))
    if m.clip is not None:
        clipped = clip_vec(ideal_unclipped, m.clip, m.clip_kind, m.clip_norm_type)
        if m.clip_kind == "norm":
            n0 = float(torch.linalg.vector_norm(ideal_unclipped, ord=m.clip_norm_type))
            clip_factor = min(1.0, m.clip / (n0 + 1e-6))
    else:
        clipped = ideal_unclipped
    return ideal_unclipped, clipped, clip_factor


def _closing_findings(m: Measurements, out: _Findings, g: torch.Tensor, error: float) -> None:
    """A difference no bug explains: autocast's rounding, randomness outside the forward, or unexplained (not
    when a clip_grad_value_ bit: it explains a gradient no weights give)."""
    autocast = _counts(m.events, "autocast")
    if (
        error > m.tol
        and autocast
        and error <= 0.1
        and not any(f.severity in ("bug", "inconclusive") for f in out.list())
    ):
        dtype = autocast[0].detail.get("dtype", "")
        out.add(
            "autocast_precision",
            "your step runs under torch.autocast; the full-batch reference does not",
            f"{len(autocast)} autocast region(s) ({dtype}); relative error {num(error)}, cosine "
            f"{cosine(m.target, g):.4f}: the size of {dtype} rounding, and no fingerprint of a bug",
            "pass a tolerance that matches the autocast precision (about 3e-2 for bfloat16, 3e-3 for float16)",
            4,
            "inconclusive",
        )
    if error > m.tol and m.outside_draws and not any(f.severity in ("bug", "inconclusive") for f in out.list()):
        _outside_randomness(m, out)
    if error > m.tol and not any(f.severity in ("bug", "inconclusive") for f in out.list()):
        out.add(
            "unexplained",
            "unexplained difference",
            f"relative error {num(error)} against the full batch",
            "look for state that changes between micro-batches, or other layers that couple samples",
            6,
        )
    if out.value_clip_bit:
        out.remove({"unexplained"})
