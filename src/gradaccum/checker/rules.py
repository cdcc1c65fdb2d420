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

import math
from typing import Any, cast

import torch

from .calls import _event_findings
from .decay import decay_findings
from .measure import (
    Measurements,
    _after,
    _counts,
    _dtype_eps,
    _inside,
    _is_zero,
    _user_frame,
    clip_vec,
    cosine,
    fit_weights,
    rel,
)
from .recorder import Event
from .report import (
    BN_FIX,
    CORRECT_LOOP,
    ZERO_GRAD_CAUSE,
    Finding,
    _Findings,
    num,
    nums,
    ordinal_list,
)
from .weights import (
    _alpha_pattern,
    _backward_weight_findings,
    _clip_placement,
    _other_sizes,
    _scale_findings,
    _token_finding,
    _token_from_backwards,
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
    out.add("step_raised", f"your step raised {type(err).__name__}",
            f"{text}{_user_frame(err)}, after {last} backward pass(es); the window could not be compared",
            "fix the error (the findings below name its cause when it is a known one); the checker's verdict "
            "covers only what ran before it", None)
    if "No inf checks were recorded" in str(err):
        out.add("scaler_update_inside_window", "scaler.update() inside the window: the loss scale changes "
                "inside the window", f"scaler.update() called {_after(updates[-1]) if updates else ''} with no "
                "scaler.step() before it (torch raises: no inf checks recorded)",
                "call scaler.step(optimizer) and then scaler.update() once per window, after the last "
                "micro-batch's backward", 4)
    if "unscale_() has already been called" in str(err):
        out.add("scaler_unscale_inside_window", "scaler.unscale_() inside the window",
                f"a second unscale_() in one window ({len(_counts(events, 'scaler.unscale_'))} calls)",
                "unscale_ once, after the last backward, then clip, then scaler.step", 4)


def _no_gradient_findings(m: Measurements, out: _Findings, g: torch.Tensor, last: int) -> bool:
    """A gradient that cannot be compared (inf or NaN) or that no backward reached; True when there is one."""
    if not bool(torch.isfinite(g).all()):
        out.add("non_finite", "non-finite gradients after the window", "inf or NaN in the gradient your step "
                "produced", "with fp16, use a GradScaler (it skips the step on overflow); check the loss", 4)
        return True
    if last == 0 and _is_zero(g) and not _is_zero(m.target):
        out.add("no_gradient", "your step left no gradient in the model it was given",
                "no backward pass reached the model's parameters and every .grad is empty",
                "compute the loss with the `model` argument of step (not a model from elsewhere) and call "
                "backward; leave the gradient in .grad (or step an optimizer built on model.parameters())", None)
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


def _loss_findings(m: Measurements, out: _Findings) -> bool:
    """A loss that couples the samples of a batch (True when it does: the weights f then mean nothing)."""
    loss_thr = m.thr if m.loss_thr is None else min(m.thr, m.loss_thr)
    # a micro-batch with a gradient of its own that weighs nothing in the full batch: the loss selects samples
    # across the batch (a max, a min, the hardest examples); a weighted or token mean gives it its share
    top_f = max((abs(v) for v in m.f), default=0.0)
    unselected = [j + 1 for j, fj in enumerate(m.f)
                  if top_f > 0 and abs(fj) <= m.wtol * top_f and float(m.basis[j].norm()) > 0]
    coupled_loss = m.loss_residual > loss_thr or m.f_moved is not None or bool(unselected)
    fix = ("accumulation cannot reproduce such a loss; enlarge the micro-batch, or compute the full-batch gradient "
           "with GradCache (gradaccum.coupled.grad_cache_backward; for a loss of the model's outputs, the model as "
           "its one encoder and lambda out: loss_fn(out, y))")
    cause = "the loss couples the samples of a batch: it is not a sum over micro-batches"
    if m.loss_residual > loss_thr:
        out.add("loss_couples_samples", cause, f"the loss's gradient on a micro-batch inside the full batch is not a "
                f"multiple of its gradient on the micro-batch alone (relative residual {num(m.loss_residual)}); "
                "in-batch negatives or batch statistics in the loss do this", fix, 8)
    elif m.f_moved is not None:
        out.add("loss_couples_samples", cause, f"the full batch weighs each micro-batch's gradient by a factor that "
                f"changes smoothly with the model's outputs ({nums(m.f)} here, {nums(m.f_moved)} with the outputs "
                "moved by a thousandth of their spread, a hundredth below float64): a batch-wide value of the "
                "outputs sets the weights (a logsumexp or softmax over the samples' losses, the square root of a "
                "mean as in RMSE, a power of the batch's mean loss), so no fixed normalization reproduces them",
                fix, 8)
    elif unselected:
        out.add("loss_couples_samples", cause, f"micro-batch(es) {', '.join(map(str, unselected))} weigh nothing in "
                f"the full batch's gradient (weights {nums(m.f)}), yet have a gradient of their own: the loss "
                "selects samples across the batch (a max, a min, the hardest examples), so which micro-batch counts "
                "depends on the others", fix, 8)
    return coupled_loss


def _closing_findings(m: Measurements, out: _Findings, g: torch.Tensor, error: float) -> None:
    """A difference no bug explains: autocast's rounding, randomness outside the forward, or unexplained (not
    when a clip_grad_value_ bit: it explains a gradient no weights give)."""
    autocast = _counts(m.events, "autocast")
    if error > m.tol and autocast and error <= 0.1 and not any(f.severity in ("bug", "inconclusive")
                                                                 for f in out.list()):
        dtype = autocast[0].detail.get("dtype", "")
        out.add("autocast_precision", "your step runs under torch.autocast; the full-batch reference does not",
                f"{len(autocast)} autocast region(s) ({dtype}); relative error {num(error)}, cosine "
                f"{cosine(m.target, g):.4f}: the size of {dtype} rounding, and no fingerprint of a bug",
                "pass a tolerance that matches the autocast precision (about 3e-2 for bfloat16, 3e-3 for float16)",
                4, "inconclusive")
    if error > m.tol and m.outside_draws and not any(f.severity in ("bug", "inconclusive") for f in out.list()):
        _outside_randomness(m, out)
    if error > m.tol and not any(f.severity in ("bug", "inconclusive") for f in out.list()):
        out.add("unexplained", "unexplained difference", f"relative error {num(error)} against the full batch",
                "look for state that changes between micro-batches, or other layers that couple samples", 6)
    if out.value_clip_bit:
        out.remove({"unexplained"})


def _coupling_findings(m: Measurements, out: _Findings, ideal: torch.Tensor, model_error: float) -> None:
    diffs = []
    for name, sl in m.param_slices:
        a, b = m.full[sl], ideal[sl]
        if float(a.norm()) > 0:
            diffs.append((rel(a, b), name))
    diffs.sort(reverse=True)
    layers = ", ".join(f"{name} {num(d)}" for d, name in diffs[:3])
    coupled = m.coupled()
    if m.random_draws and all(name == "(the model itself)" for name, _, _ in coupled):
        coupled = []  # only the model as a whole, and it draws random numbers: see the randomness case below
    if coupled:
        names = ", ".join(f"{cls} '{name}'" for name, cls, _ in coupled[:4]) + (", …" if len(coupled) > 4 else "")
        bn = all("BatchNorm" in cls for _, cls, _ in coupled)
        cause = ("BatchNorm normalizes each micro-batch with its own statistics" if bn else
                 "a batch-coupled layer: a sample's output depends on the other samples of its batch")
        fix = BN_FIX if bn else ("replace the layer by a per-sample one, or accept (and measure) the difference; "
                                 "larger micro-batches shrink it")
        out.add("batch_coupled_layer", cause,
                f"{len(coupled)} layer(s) give a sample a different output in a micro-batch of {m.b} than in the "
                f"full batch of {m.n} (same inputs, same randomness): {names}; the ideal accumulation of this model "
                f"differs from the full batch by {num(model_error)} (relative), most in {layers}", fix, 1)
    elif m.unreplayed:
        out.add("randomness_not_replayed", "randomness the checker could not replay per sample",
                f"{len(m.unreplayed)} random draw(s) without a batch dimension, e.g. {m.unreplayed[0]}; the full "
                f"batch and the micro-batches differ by {num(model_error)}",
                "rerun with that randomness switched off (dropout p = 0) to compare like with like", 6,
                "inconclusive")
    elif m.random_draws:
        # no layer couples samples, yet the model as a whole does, and its forward draws random numbers: the
        # draws were probably cut into samples wrongly (dropout on torch.cat([x, x]), on a reordered batch)
        out.add("randomness_not_replayed", "randomness the checker could not give each sample reliably",
                f"no single layer couples samples, yet the full batch and the micro-batches differ by "
                f"{num(model_error)}, and the forward makes {m.random_draws} random draw(s): a draw whose rows are "
                "not the batch's samples in order (dropout after torch.cat([x, x]) or a flip of the batch) gets "
                "other masks in a micro-batch than in the full batch",
                "rerun with that randomness switched off (dropout p = 0) to compare like with like", 6,
                "inconclusive")
    else:
        out.add("batch_coupled_layer", "batch coupling inside the model's forward: a sample's output depends on "
                "the other samples of its batch", f"no single layer couples samples, but the model as a whole does: "
                f"the ideal accumulation differs from the full batch by {num(model_error)} (most in {layers})",
                "look for operations across the batch dimension in forward (means, sorting, in-batch attention)", 1)


def _loop_findings(m: Measurements, out: _Findings, w: list[float], e: list[float], residual: float, cond: float,
                   clipped: torch.Tensor, loop_error: float) -> None:
    """The loop's findings when its step is not the ideal accumulation: the micro-batches its forward passes saw,
    then the micro-batch weights it applied (or, where they are not unique, the buffer trace and the scale)."""
    if any(c in out for c in ("optimizer_step_inside_window", "scaler_step_inside_window")):
        return  # the weights moved mid-window: the micro-batch gradients no longer describe the step
    if _data_findings(m, out, loop_error):
        return
    if residual > m.thr:  # (a rank-deficient basis, e.g. duplicate micro-batches, still fits: min-norm weights)
        _residual_findings(m, out, residual)
        return
    _backward_weight_findings(m, out, loop_error, cosine(clipped, m.applied))
    resets = [j + 1 for j in range(1, len(m.passes)) if _is_zero(m.passes[j].before)
              and not _is_zero(m.passes[j - 1].after)]
    if cond > 1e10:
        _dependent_findings(m, out, resets, clipped, loop_error)
    else:
        _weights_findings(m, out, w, e, resets, clipped, loop_error)


def _data_findings(m: Measurements, out: _Findings, loop_error: float) -> bool:
    """Forward passes that did not see the window's K micro-batches once each (True when a finding says so)."""
    seen: dict[int, int] = {}
    for offset, size in m.forwards:
        if size == m.b:
            seen[offset] = seen.get(offset, 0) + 1
    never = [j + 1 for j in range(m.k) if j * m.b not in seen]
    again = [offset // m.b + 1 for offset, count in sorted(seen.items()) if count > 1 and offset % m.b == 0]
    if m.has_step and never and again:  # e.g. a loop that never advances its iterator
        out.add("micro_batches_differ", "your step's micro-batches are not the K parts of the batch",
                f"its forward passes saw micro-batch(es) {ordinal_list(again)} more than once and never "
                f"{ordinal_list(never)}", "advance the data iterator once per micro-batch: each window must see each "
                "of its K micro-batches once", 6)
        return True
    sizes = sorted({n for _, n in m.forwards})
    if m.has_step and sizes and sizes != [m.b] and loop_error > m.tol:  # e.g. a loop with its own, other K
        _other_sizes(m, out, sizes)
        return True
    return False


def _residual_findings(m: Measurements, out: _Findings, residual: float) -> None:
    """A step's gradient that no micro-batch weights give (relative ``residual`` of the fit): randomness, other
    micro-batch sizes, a zero_grad of part of the parameters, or unexplained."""
    sizes = sorted({n for _, n in m.forwards})
    inside_zeros = [ev for ev in _inside(_counts(m.events, "zero_grad"), len(m.passes)) if ev.after > 0]
    if m.unreplayed or m.outside_draws:
        _outside_randomness(m, out)
    elif m.has_step and sizes and sizes != [m.b]:
        _other_sizes(m, out, sizes)
    elif inside_zeros:  # e.g. one of two optimizers emptied mid-window: each part keeps other micro-batches
        out.add("zero_grad_inside_window", ZERO_GRAD_CAUSE,
                f"zero_grad() called {len(inside_zeros)}× inside the window, after "
                f"backward pass(es) {ordinal_list(sorted({ev.after for ev in inside_zeros}))}; where it empties "
                f"part of the parameters (one optimizer of several, say), no one set of micro-batch weights "
                f"gives your step's gradient (relative residual {num(residual)})",
                "zero the gradients once per window, before the first micro-batch (or after "
                "optimizer.step()), for every optimizer", 6)
    else:
        out.add("unexplained", "your step's gradient is not a combination of the micro-batch gradients",
                f"relative residual {num(residual)} after fitting it with the K micro-batch gradients of loss_fn; "
                "does your step use loss_fn, and change nothing but .grad? (A term computed from the "
                "parameters alone, such as a regularizer, is not in the reference: leave it out of the check.)",
                CORRECT_LOOP, 6)


def _dependent_findings(m: Measurements, out: _Findings, resets: list[int], clipped: torch.Tensor,
                        loop_error: float) -> None:
    """Micro-batch gradients linearly dependent (duplicate samples, tiny models): the weights are not unique, so
    read the buffer trace (``resets``: micro-batches it was emptied before), the clips, and the scale along the
    ideal gradient."""
    events = m.events
    last_clip = math.prod(ev.detail.get("factor", 1.0) for ev in _counts(events, "clip")
                          if ev.after == len(m.passes))  # a clip after the last backward rescales the buffer
    if resets and m.passes and rel(m.passes[-1].after * last_clip, m.applied) <= m.thr:
        out.add("zero_grad_inside_window", ZERO_GRAD_CAUSE, f"the .grad buffer was emptied before micro-batch(es) "
                f"{ordinal_list(resets)}; the step applies what the last backward pass(es) left in it",
                "zero the gradients once per window, before the first micro-batch", 6)
        return
    if _clip_placement(m, out, _counts(events, "clip"), "the micro-batch gradients are linearly dependent, "
                       "so the weights cannot be told apart"):
        return
    denom = float(clipped @ clipped)
    s = float(m.applied @ clipped) / denom if denom > 0 else float("nan")
    cos = cosine(clipped, m.applied)
    if abs(cos - 1) <= m.thr:
        _scale_findings(m, out, s, loop_error, cos, _counts(events, "clip"))
    else:
        out.add("weights_differ", "your loop weighs micro-batches differently from the full batch",
                f"cosine {cos:.4f} with the full batch (the micro-batch gradients are linearly dependent, so "
                "the weights cannot be told apart)",
                CORRECT_LOOP, 6)


def _missing_findings(m: Measurements, out: _Findings, missing: list[int], present: list[int], weights: str,
                      resets: list[int]) -> bool:
    """Micro-batches that weigh exactly nothing (0-based ``missing``): a zero_grad inside the window or after the
    last backward, or absent micro-batches; True when the step applied an emptied buffer (nothing more to read)."""
    late = [ev for ev in _counts(m.events, "zero_grad") if ev.after == len(m.passes)]
    if missing and not present and late and _is_zero(m.applied):  # emptied between the last backward and the step
        out.add("zero_grad_inside_window", ZERO_GRAD_CAUSE,
                f"zero_grad() called {len(late)}× after the last backward pass, before "
                f"your step's gradient was applied: the step applies an empty buffer ({weights})",
                "zero the gradients once per window, before the first micro-batch or after optimizer.step(); "
                "never between the last backward and the step", 6)
        return True
    if not missing:
        return False
    zeros = [ev for ev in _inside(_counts(m.events, "zero_grad"), len(m.passes)) if ev.after > 0]
    if resets or zeros:
        calls = f" (zero_grad() called {len(zeros)}× inside the window)" if zeros else ""
        out.add("zero_grad_inside_window", ZERO_GRAD_CAUSE, f"the .grad buffer was emptied before micro-batch(es) "
                f"{ordinal_list(resets)}{calls}; only micro-batch(es) {ordinal_list([j + 1 for j in present])} "
                f"reach the optimizer: {weights}", "zero the gradients once per window, before the first "
                "micro-batch (or after optimizer.step())", 6)
    elif not any(c in out for c in ("clip_running_buffer", "clip_per_micro_batch", "clip_before_unscale",
                                    "scaler_update_inside_window")):  # (those shrink early ones to ~0)
        out.add("micro_batches_missing", "micro-batches missing from the window",
                f"micro-batch(es) {ordinal_list([j + 1 for j in missing])} contribute nothing: {weights}",
                "check the loop's bounds: every micro-batch of the window needs its backward", 6)
    return False


def _uniformity(m: Measurements, w: list[float], e: list[float], present: list[int]
                ) -> tuple[bool, bool, bool, float, float]:
    """Whether the present micro-batches' weights are a common multiple of the full batch's (``uniform``), the
    full batch's are equal (``f_uniform``), the step's are equal (``w_uniform``); the mean ratio and mean weight."""
    ratio = [w[j] / e[j] for j in present]
    mean = sum(ratio) / len(ratio)
    uniform = max(abs(r / mean - 1) for r in ratio) <= m.thr if mean != 0 else False
    f_present = [m.f[j] for j in present]
    f_uniform = max(f_present) - min(f_present) <= 1e-9 * max(abs(v) for v in f_present)
    w_present = [w[j] for j in present]
    w_mean = sum(w_present) / len(w_present)
    w_uniform = max(abs(v / w_mean - 1) for v in w_present) <= m.thr if w_mean else False
    if uniform and not f_uniform and w_uniform and mean != 0 \
            and max(abs(r / mean - 1) for r in ratio) > max(10 * m.wtol, m.tol):
        # equal weights where the full batch's differ by less than thr (a float32 reading) but by more than the
        # fit's rounding: still a mean of per-micro-batch means, not a scale
        uniform = False
    return uniform, f_uniform, w_uniform, mean, w_mean


def _weights_findings(m: Measurements, out: _Findings, w: list[float], e: list[float], resets: list[int],
                      clipped: torch.Tensor, loop_error: float) -> None:
    """The step's micro-batch weights ``w`` against the full batch's ``e``: micro-batches missing, a mean of
    per-micro-batch means, a scale, or weights of another shape."""
    k = m.k
    missing = [j for j in range(k) if w[j] == 0 and e[j] != 0]  # exactly absent (rounding noise removed above)
    present = [j for j in range(k) if j not in missing and e[j] != 0]
    weights = f"weights {nums(w)} instead of {nums(e)}"
    if _missing_findings(m, out, missing, present, weights, resets) or not present:
        return
    uniform, f_uniform, w_uniform, mean, w_mean = _uniformity(m, w, e, present)
    clips = _counts(m.events, "clip")
    before = _alpha_pattern(m) if clips or missing else None  # read before any clip or reset
    if before is not None and before[1]:  # equal weights where the full batch's differ: per-micro-batch means
        _token_finding(m, out, list(m.f), before[2], " (what each backward added, read before your clip or reset)")
    if not uniform and not f_uniform and w_uniform and before is None:
        _token_finding(m, out, e, w)
        plain = sum(e) / k  # equal weights that add up to the full batch's total
        _scale_findings(m, out, w_mean / plain, loop_error, cosine(clipped, m.applied), clips, token=True)
        return
    if before is not None and ((uniform and (missing or before[1])) or (not f_uniform and w_uniform)):
        # a clip rescales, a reset removes: the scale of the loss's weights is what each backward added
        _scale_findings(m, out, before[0], loop_error, cosine(clipped, m.applied), clips, token=before[1],
                        what="on average, the backward passes' weights are")
        return
    empty = [j for j in range(k) if e[j] == 0 and m.tokens[j] == 0]  # micro-batches with no target to count
    if uniform and empty and abs(mean * k / len(present) - 1) <= m.thr:
        # each micro-batch that has tokens weighted 1/K, as if the empty ones counted: a mean of token means
        _token_finding(m, out, e, [w_mean if j in empty else w[j] for j in range(k)])
    elif uniform:
        if abs(mean - 1) > m.thr:
            what = ("the weights of the micro-batches that reach the step are" if missing else
                    "the micro-batch weights are")
            _scale_findings(m, out, mean, loop_error, cosine(clipped, m.applied), clips, what=what)
    else:
        _shape_findings(m, out, weights, clips, clipped, loop_error)


def _shape_findings(m: Measurements, out: _Findings, weights: str, clips: list[Event], clipped: torch.Tensor,
                    loop_error: float) -> None:
    """Weights of another shape than the full batch's: a clip placement, a loss scale that changed inside the
    window, or weights that differ for no reason the checker knows."""
    if _clip_placement(m, out, clips, f"the micro-batches no longer weigh what they weigh in the full batch: "
                       f"{weights}"):
        _token_from_backwards(m, out, loop_error, cosine(clipped, m.applied), clips)
        return
    scales = [p.scale for p in m.passes if p.scale is not None]
    if len(scales) == m.k and len(set(scales)) > 1:
        known = "scaler_update_inside_window" in out
        out.add("scaler_update_inside_window", "scaler.update() inside the window: the loss scale changes inside "
                "the window", ("" if known else f"loss scale at each backward {nums(scales)}; ")
                + f"micro-batches weigh in proportion to it: {weights}",
                "one loss scale per window: call scaler.update() once, after scaler.step()", 4)
        return
    if any(code in out for code in ("clip_running_buffer", "clip_per_micro_batch", "clip_before_unscale")):
        _token_from_backwards(m, out, loop_error, cosine(clipped, m.applied), clips)
        return
    out.add("weights_differ", "your loop weighs micro-batches differently from the full batch", weights,
            CORRECT_LOOP, 6)


def _outside_randomness(m: Measurements, out: _Findings) -> None:
    """Random draws the checker could not replay per sample (no batch dimension, or outside the model's forward):
    the full batch and the micro-batches do not see the same random numbers, so no verdict."""
    if m.unreplayed:
        out.add("randomness_not_replayed", "randomness the checker could not replay per sample",
                f"{len(m.unreplayed)} random draw(s) without a batch dimension, e.g. {m.unreplayed[0]}",
                "rerun with that randomness switched off (dropout p = 0) to compare like with like", 6,
                "inconclusive")
    if m.outside_draws:
        out.add("randomness_not_replayed", "randomness in your step outside the model's forward (e.g. noise or "
                "augmentation added to the inputs), which the checker cannot replay",
                f"{len(m.outside_draws)} random draw(s) in your step outside model.forward, e.g. "
                f"{m.outside_draws[0]}: the full-batch reference does not draw them",
                "rerun with that randomness switched off (or moved into the data pipeline, before step) to compare "
                "like with like", 6, "inconclusive")


