"""The rules that read the loop: when the step is not the ideal accumulation, the micro-batches its forward
passes saw, the weights :math:`w_j` it gave each micro-batch's gradient against the full batch's :math:`f_j`
(micro-batches missing, a mean of per-micro-batch means, a scale, weights of another shape), or, where the
micro-batch gradients are linearly dependent and the weights not unique, the ``.grad`` buffer's trace and the scale
along the ideal gradient. The model's and the loss's findings are in :mod:`.model_rules`; the notation in
:mod:`.rules`."""

from __future__ import annotations

import math

import torch

from .measure import (
    Measurements,
    _counts,
    _inside,
    _is_zero,
    cosine,
    rel,
)
from .model_rules import _outside_randomness
from .recorder import Event
from .report import (
    CORRECT_LOOP,
    ZERO_GRAD_CAUSE,
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


def _loop_findings(
    m: Measurements,
    out: _Findings,
    w: list[float],
    e: list[float],
    residual: float,
    cond: float,
    clipped: torch.Tensor,
    loop_error: float,
) -> None:
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
    resets = [
        j + 1 for j in range(1, len(m.passes)) if _is_zero(m.passes[j].before) and not _is_zero(m.passes[j - 1].after)
    ]
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
        out.add(
            "micro_batches_differ",
            "your step's micro-batches are not the K parts of the batch",
            f"its forward passes saw micro-batch(es) {ordinal_list(again)} more than once and never "
            f"{ordinal_list(never)}",
            "advance the data iterator once per micro-batch: each window must see each of its K micro-batches once",
            6,
        )
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
        out.add(
            "zero_grad_inside_window",
            ZERO_GRAD_CAUSE,
            f"zero_grad() called {len(inside_zeros)}× inside the window, after "
            f"backward pass(es) {ordinal_list(sorted({ev.after for ev in inside_zeros}))}; where it empties "
            f"part of the parameters (one optimizer of several, say), no one set of micro-batch weights "
            f"gives your step's gradient (relative residual {num(residual)})",
            "zero the gradients once per window, before the first micro-batch (or after "
            "optimizer.step()), for every optimizer",
            6,
        )
    else:
        out.add(
            "unexplained",
            "your step's gradient is not a combination of the micro-batch gradients",
            f"relative residual {num(residual)} after fitting it with the K micro-batch gradients of loss_fn; "
            "does your step use loss_fn, and change nothing but .grad? (A term computed from the "
            "parameters alone, such as a regularizer, is not in the reference: leave it out of the check.)",
            CORRECT_LOOP,
            6,
        )


def _dependent_findings(
    m: Measurements, out: _Findings, resets: list[int], clipped: torch.Tensor, loop_error: float
) -> None:
    """Micro-batch gradients linearly dependent (duplicate samples, tiny models): the weights are not unique, so
    read the buffer trace (``resets``: micro-batches it was emptied before), the clips, and the scale along the
    ideal gradient."""
    events = m.events
    last_clip = math.prod(
        ev.detail.get("factor", 1.0) for ev in _counts(events, "clip") if ev.after == len(m.passes)
    )  # a clip after the last backward rescales the buffer
    if resets and m.passes and rel(m.passes[-1].after * last_clip, m.applied) <= m.thr:
        out.add(
            "zero_grad_inside_window",
            ZERO_GRAD_CAUSE,
            f"the .grad buffer was emptied before micro-batch(es) "
            f"{ordinal_list(resets)}; the step applies what the last backward pass(es) left in it",
            "zero the gradients once per window, before the first micro-batch",
            6,
        )
        return
    if _clip_placement(
        m,
        out,
        _counts(events, "clip"),
        "the micro-batch gradients are linearly dependent, so the weights cannot be told apart",
    ):
        return
    denom = float(clipped @ clipped)
    s = float(m.applied @ clipped) / denom if denom > 0 else float("nan")
    cos = cosine(clipped, m.applied)
    if abs(cos - 1) <= m.thr:
        _scale_findings(m, out, s, loop_error, cos, _counts(events, "clip"))
    else:
        out.add(
            "weights_differ",
            "your loop weighs micro-batches differently from the full batch",
            f"cosine {cos:.4f} with the full batch (the micro-batch gradients are linearly dependent, so "
            "the weights cannot be told apart)",
            CORRECT_LOOP,
            6,
        )


def _missing_findings(
    m: Measurements, out: _Findings, missing: list[int], present: list[int], weights: str, resets: list[int]
) -> bool:
    """Micro-batches that weigh exactly nothing (0-based ``missing``): a zero_grad inside the window or after the
    last backward, or absent micro-batches; True when the step applied an emptied buffer (nothing more to read)."""
    late = [ev for ev in _counts(m.events, "zero_grad") if ev.after == len(m.passes)]
    if missing and not present and late and _is_zero(m.applied):  # emptied between the last backward and the step
        out.add(
            "zero_grad_inside_window",
            ZERO_GRAD_CAUSE,
            f"zero_grad() called {len(late)}× after the last backward pass, before "
            f"your step's gradient was applied: the step applies an empty buffer ({weights})",
            "zero the gradients once per window, before the first micro-batch or after optimizer.step(); "
            "never between the last backward and the step",
            6,
        )
        return True
    if not missing:
        return False
    zeros = [ev for ev in _inside(_counts(m.events, "zero_grad"), len(m.passes)) if ev.after > 0]
    if resets or zeros:
        calls = f" (zero_grad() called {len(zeros)}× inside the window)" if zeros else ""
        out.add(
            "zero_grad_inside_window",
            ZERO_GRAD_CAUSE,
            f"the .grad buffer was emptied before micro-batch(es) "
            f"{ordinal_list(resets)}{calls}; only micro-batch(es) {ordinal_list([j + 1 for j in present])} "
            f"reach the optimizer: {weights}",
            "zero the gradients once per window, before the first micro-batch (or after optimizer.step())",
            6,
        )
    elif not any(
        c in out
        for c in ("clip_running_buffer", "clip_per_micro_batch", "clip_before_unscale", "scaler_update_inside_window")
    ):  # (those shrink early ones to ~0)
        out.add(
            "micro_batches_missing",
            "micro-batches missing from the window",
            f"micro-batch(es) {ordinal_list([j + 1 for j in missing])} contribute nothing: {weights}",
            "check the loop's bounds: every micro-batch of the window needs its backward",
            6,
        )
    return False


def _uniformity(
    m: Measurements, w: list[float], e: list[float], present: list[int]
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
    if (
        uniform
        and not f_uniform
        and w_uniform
        and mean != 0
        and max(abs(r / mean - 1) for r in ratio) > max(10 * m.wtol, m.tol)
    ):
        # equal weights where the full batch's differ by less than thr (a float32 reading) but by more than the
        # fit's rounding: still a mean of per-micro-batch means, not a scale
        uniform = False
    return uniform, f_uniform, w_uniform, mean, w_mean


def _weights_findings(
    m: Measurements,
    out: _Findings,
    w: list[float],
    e: list[float],
    resets: list[int],
    clipped: torch.Tensor,
    loop_error: float,
) -> None:
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
        _scale_findings(
            m,
            out,
            before[0],
            loop_error,
            cosine(clipped, m.applied),
            clips,
            token=before[1],
            what="on average, the backward passes' weights are",
        )
        return
    empty = [j for j in range(k) if e[j] == 0 and m.tokens[j] == 0]  # micro-batches with no target to count
    if uniform and empty and abs(mean * k / len(present) - 1) <= m.thr:
        # each micro-batch that has tokens weighted 1/K, as if the empty ones counted: a mean of token means
        _token_finding(m, out, e, [w_mean if j in empty else w[j] for j in range(k)])
    elif uniform:
        if abs(mean - 1) > m.thr:
            what = (
                "the weights of the micro-batches that reach the step are" if missing else "the micro-batch weights are"
            )
            _scale_findings(m, out, mean, loop_error, cosine(clipped, m.applied), clips, what=what)
    else:
        _shape_findings(m, out, weights, clips, clipped, loop_error)


def _shape_findings(
    m: Measurements, out: _Findings, weights: str, clips: list[Event], clipped: torch.Tensor, loop_error: float
) -> None:
    """Weights of another shape than the full batch's: a clip placement, a loss scale that changed inside the
    window, or weights that differ for no reason the checker knows."""
    if _clip_placement(
        m, out, clips, f"the micro-batches no longer weigh what they weigh in the full batch: {weights}"
    ):
        _token_from_backwards(m, out, loop_error, cosine(clipped, m.applied), clips)
        return
    scales = [p.scale for p in m.passes if p.scale is not None]
    if len(scales) == m.k and len(set(scales)) > 1:
        known = "scaler_update_inside_window" in out
        out.add(
            "scaler_update_inside_window",
            "scaler.update() inside the window: the loss scale changes inside the window",
            ("" if known else f"loss scale at each backward {nums(scales)}; ")
            + f"micro-batches weigh in proportion to it: {weights}",
            "one loss scale per window: call scaler.update() once, after scaler.step()",
            4,
        )
        return
    if any(code in out for code in ("clip_running_buffer", "clip_per_micro_batch", "clip_before_unscale")):
        _token_from_backwards(m, out, loop_error, cosine(clipped, m.applied), clips)
        return
    out.add(
        "weights_differ", "your loop weighs micro-batches differently from the full batch", weights, CORRECT_LOOP, 6
    )
