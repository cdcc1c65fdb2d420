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

from .measure import (
    Measurements,
    _after,
    _counts,
    _dtype_eps,
    _inside,
    _is_zero,
    _most_per,
    _user_frame,
    clip_vec,
    cosine,
    fit_weights,
    placements,
    rel,
)
from .recorder import Event
from .report import (
    _DOUBLE_1_OVER_K,
    _DOUBLE_1_OVER_K_FIX,
    CLIP_FIX,
    CLIP_PER_MICRO,
    CLIP_RUNNING,
    CORRECT_LOOP,
    PLACEMENT_TEXT,
    ZERO_GRAD_CAUSE,
    Finding,
    num,
    nums,
    ordinal_list,
)


class _Findings:
    """Findings by code, in the order they were raised; a second report of the same code adds evidence."""

    def __init__(self) -> None:
        self.by_code: dict[str, Finding] = {}
        # a clip_grad_value_ inside the window that bit: it changes the gradient's direction, so a gradient that is
        # no combination of the micro-batch gradients is explained by it, not "unexplained"
        self.value_clip_bit = False

    def add(self, code: str, cause: str, evidence: str, fix: str, chapter: int | None, severity: str = "bug") -> None:
        if code in self.by_code:
            old = self.by_code[code]
            if evidence and evidence not in old.evidence:
                self.by_code[code] = Finding(code, old.cause, old.evidence + "; " + evidence, old.fix, old.chapter,
                                             old.severity)
            return
        self.by_code[code] = Finding(code, cause, evidence, fix, chapter, severity)

    def remove(self, codes: set[str]) -> None:
        for code in codes:
            self.by_code.pop(code, None)

    def __contains__(self, code: str) -> bool:
        return code in self.by_code

    def list(self) -> list[Finding]:
        return list(self.by_code.values())


def diagnose(m: Measurements) -> tuple[list[Finding], dict[str, Any]]:
    """All findings for one window, and the measured quantities a report shows (weights, scale, calls)."""
    out = _Findings()
    info: dict[str, Any] = {}
    last = len(m.passes)
    events = m.events
    info["backward_passes"] = last

    # ---- the step raised
    if m.error is not None:
        err = m.error
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

    _event_findings(m, out, last)
    if m.error is not None:
        return out.list(), info

    g = m.applied
    if not bool(torch.isfinite(g).all()):
        out.add("non_finite", "non-finite gradients after the window", "inf or NaN in the gradient your step "
                "produced", "with fp16, use a GradScaler (it skips the step on overflow); check the loss", 4)
        return out.list(), info
    if last == 0 and _is_zero(g) and not _is_zero(m.target):
        out.add("no_gradient", "your step left no gradient in the model it was given",
                "no backward pass reached the model's parameters and every .grad is empty",
                "compute the loss with the `model` argument of step (not a model from elsewhere) and call "
                "backward; leave the gradient in .grad (or step an optimizer built on model.parameters())", None)
        return out.list(), info

    w, residual, cond = fit_weights(m.basis, g)
    top_w = max(abs(v) for v in w) if w else 0.0
    # rounding noise of the fit shown as 0 (under autocast, the noise of its dtype: a zeroed micro-batch reads
    # about 1e-4 of the others in bf16)
    zero = max([m.wtol, 1e-9] + [_dtype_eps(ev.detail.get("dtype", "")) for ev in _counts(m.events, "autocast")])
    w = [v if abs(v) > zero * top_w else 0.0 for v in w]
    clip_factor = 1.0
    ideal_unclipped = cast(torch.Tensor, sum(fj * m.basis[j] for j, fj in enumerate(m.f)))
    if m.clip is not None:
        clipped = clip_vec(ideal_unclipped, m.clip, m.clip_kind, m.clip_norm_type)
        if m.clip_kind == "norm":
            n0 = float(torch.linalg.vector_norm(ideal_unclipped, ord=m.clip_norm_type))
            clip_factor = min(1.0, m.clip / (n0 + 1e-6))
    else:
        clipped = ideal_unclipped
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
    model_error = rel(m.full, ideal_unclipped)
    if model_error > m.tol and not coupled_loss:
        _coupling_findings(m, out, ideal_unclipped, model_error)

    # ---- the loop: does the step produce the ideal accumulation?
    loop_error = rel(clipped, g)
    info["loop_error"] = loop_error
    if loop_error > m.tol and not coupled_loss:  # (the weights f mean nothing for a coupled loss)
        _loop_findings(m, out, w, e, residual, cond, clipped, loop_error)
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
    return out.list(), info


def _event_findings(m: Measurements, out: _Findings, last: int) -> None:
    events, k = m.events, m.k
    opt = [e for e in _counts(events, "optimizer.step")]
    own = [e for e in opt if not e.detail.get("via_scaler")]
    sstep = _counts(events, "scaler.step")
    # several optimizers (one per parameter group, e.g. Muon beside AdamW) each step once per window, with one
    # scheduler each and one GradScaler for all: counted per optimizer (per scheduler)
    if _most_per(own, "opt") > 1 or _inside(own, last):
        out.add("optimizer_step_inside_window", "optimizer.step() inside the accumulation window",
                f"optimizer.step() ran {len(own)}× in one window of {k} micro-batches "
                f"({', '.join(_after(e) for e in own[:4])}{', …' if len(own) > 4 else ''}): every call applies a "
                "partial gradient and the later micro-batches see changed weights",
                "step the optimizer once per window, after the last micro-batch's backward", 6)
    if _most_per(sstep, "opt") > 1 or _inside(sstep, last):
        out.add("scaler_step_inside_window", "scaler.step() (an optimizer step) inside the accumulation window",
                f"scaler.step(optimizer) ran {len(sstep)}× in one window of {k} micro-batches "
                f"({', '.join(_after(e) for e in sstep[:4])}); after an overflow only that micro-batch's step "
                "is skipped", "scaler.step(optimizer) and scaler.update() once per window, after the last backward",
                4)
    sched = _counts(events, "scheduler.step")
    if _most_per(sched, "sched") > 1 or _inside(sched, last):
        out.add("scheduler_step_inside_window", "scheduler.step() inside the accumulation window",
                f"{len(sched)} scheduler step(s) in one window of {k} micro-batches "
                f"({', '.join(_after(e) for e in sched[:4])}{', …' if len(sched) > 4 else ''}; the step a "
                "scheduler's constructor makes is not counted): warmup and decay run up to "
                f"{k}× too fast", "step the scheduler once per optimizer step, after it", 6)
    updates = _counts(events, "scaler.update")
    if (len(updates) > 1 or _inside(updates, last)) and m.error is None:
        scales = [p.scale for p in m.passes if p.scale is not None]
        changed = f"; loss scale at each backward {nums(scales)}" if len(set(scales)) > 1 else ""
        out.add("scaler_update_inside_window", "scaler.update() inside the window: the loss scale changes "
                "inside the window", f"scaler.update() called {len(updates)}×, {len(_inside(updates, last))} "
                f"before the last backward{changed}", "call scaler.update() once per window, after scaler.step()",
                4)
    unscales = _counts(events, "scaler.unscale_")
    if (_most_per(unscales, "opt") > 1 or _inside(unscales, last)) and "scaler_unscale_inside_window" not in out:
        out.add("scaler_unscale_inside_window", "scaler.unscale_() inside the window",
                f"unscale_() called {len(unscales)}×, {len(_inside(unscales, last))} before the last backward",
                "unscale_ once, after the last backward, then clip, then scaler.step", 4)
    clips = _counts(events, "clip")
    scaled = [e for e in clips if e.detail.get("scaled")]
    if scaled:
        e = scaled[0]
        seen = e.detail.get("norm_before", float("nan"))
        out.add("clip_before_unscale", "clipping before scaler.unscale_(): the threshold is applied to scaled "
                "gradients", f"{e.detail.get('fn', 'clip')} ran {_after(e)} on gradients still multiplied by the "
                f"loss scale (it saw a norm of {num(seen)}) and scaled them by {num(e.detail.get('factor', 1.0))}",
                "call scaler.unscale_(optimizer) first, then clip, then scaler.step(optimizer)", 3)
    inside = [e for e in clips if e.after < last]
    if inside:
        # the placement: per micro-batch when the buffer held one micro-batch only at each clip
        per_micro = _trace_per_micro(m, inside)
        factors = [e.detail.get("factor", 1.0) for e in inside]
        bites = any(abs(f - 1) > 1e-12 for f in factors)
        by_value = all(e.detail.get("fn") == "clip_grad_value_" for e in inside)
        effect = ((f"it clipped entries of the gradient (its norm changed by {nums(factors[:6])}×)" if by_value else
                   f"it scaled the gradient by {nums(factors[:6])}") if bites else
                  "it did not change this window's gradient (every norm was below the threshold) but will when "
                  "gradients grow")
        evidence = (f"{len(clips)} clip call(s), {len(inside)} before the last backward "
                    f"({', '.join(_after(e) for e in inside[:4])}); {effect}")
        if per_micro:
            out.add("clip_per_micro_batch", CLIP_PER_MICRO, evidence, CLIP_FIX, 3)
        else:
            out.add("clip_running_buffer", CLIP_RUNNING, evidence, CLIP_FIX, 3)
        out.value_clip_bit = out.value_clip_bit or (bites and by_value)
    if m.reseeded is not None and m.reseeded[0] > 0:
        same, compared = m.reseeded
        seeds = _counts(events, "seed")
        calls = (f"; seeding calls in the window: {len(seeds)} ({', '.join(_after(e) for e in seeds[:4])})"
                 if seeds else "")
        out.add("rng_reseeded", "the RNG is re-seeded inside the window",
                f"{same} of {compared} random draws (dropout masks) were identical when the window started from two "
                f"different random states{calls}: the masks repeat from window to window",
                "seed once, at the start of training; never inside the accumulation loop", 6)
    elif _counts(events, "seed") and m.random_draws == 0:
        out.add("seed_inside_window", "a seed is set inside the window", f"{len(_counts(events, 'seed'))} seeding "
                "call(s); this window draws no random numbers, so nothing repeats yet",
                "seed once, at the start of training (dropout added later would repeat its masks)", 6, "note")
    foreign = [e for e in opt if not e.detail.get("owns_params", True)]
    if foreign:
        out.add("optimizer_not_on_model", "your step steps an optimizer that holds none of the model's parameters",
                "the checker runs your step on a copy of the model; an optimizer built outside step holds the "
                "original's parameters", "build the optimizer (and scheduler) inside step from model.parameters(), "
                "or leave them out of step", None, "note")


def _token_finding(m: Measurements, out: _Findings, e: list[float], w: list[float], how: str = "") -> None:
    """A loop that weighs micro-batches equally (``w``) where the full batch weighs them unequally (``e``): by
    their token counts (a mean of per-micro-batch token means), or by some other total the loss divides by (a
    class-weighted mean). ``how`` says where ``w`` was read."""
    total_e, total_t = sum(e), sum(m.tokens)
    by_tokens = bool(total_e and total_t) and all(
        abs(ej / total_e - tj / total_t) <= 1e-6 for ej, tj in zip(e, m.tokens))
    if len(set(m.tokens)) > 1 and by_tokens:
        out.add("token_normalization", "mean of per-micro-batch token means: micro-batches weighted equally, "
                "not by their token counts", f"tokens per micro-batch {m.tokens}: the full batch weighs "
                f"micro-batch gradients by their tokens, {nums(e)}; your loop weighs them equally, {nums(w)}{how}",
                "reduction='sum' and divide by the tokens of the whole window (num_items_in_batch), all-reduced "
                "across ranks", 6)
    else:
        # the same number of targets everywhere, yet the loss weighs micro-batches unequally: a weighted loss
        counted = (f"each micro-batch has {m.tokens[0]} target(s)" if len(set(m.tokens)) == 1 else
                   f"micro-batches have {m.tokens} target(s), not in proportion to these weights")
        out.add("token_normalization", "a mean of per-micro-batch weighted means: micro-batches weighted "
                "equally, not by their total weight", f"{counted}, yet the full batch weighs micro-batch "
                f"gradients {nums(e)}: the loss divides by a total that differs between micro-batches (e.g. "
                f"CrossEntropyLoss(weight=...) divides by the summed class weights of the targets); your loop "
                f"weighs them equally, {nums(w)}{how}", "sum each micro-batch's weighted loss (reduction='sum') and "
                "divide by the total weight of the whole window's targets", 6)


def _token_from_backwards(m: Measurements, out: _Findings, loop_error: float, cos: float,
                          clips: list[Event]) -> None:
    r"""A clip inside the window rescales the buffer, so the step's fitted weights mix the clip with the loss's
    weighting. What each backward pass added, :math:`\alpha_j` (read before any clip), is the loss's alone: equal
    :math:`\alpha_j` where the full batch's :math:`f_j` differ is a per-micro-batch mean, named alongside the clip
    (and a mean :math:`\alpha` K or 1/K times the mean :math:`f` a missing or doubled 1/K)."""
    pattern = _alpha_pattern(m)
    if pattern is None or not pattern[1]:
        return
    if "token_normalization" not in out:
        _token_finding(m, out, list(m.f), pattern[2], " (what each backward added, read before your clip)")
    _scale_findings(m, out, pattern[0], loop_error, cos, clips, token=True,
                    what="on average, the backward passes' weights are")


def _clip_placement(m: Measurements, out: _Findings, clips: list[Event], weights: str) -> bool:
    """Whether the step equals one of chapter 3's clip placements (other than clipping once) computed from the
    micro-batch gradients at the loop's threshold; if so, the placement is named (the measured gradient decides
    between the running buffer and per micro-batch) and True returned."""
    c, kind, norm_type = _loop_clip(m, clips)
    inside = [e for e in clips if e.after < len(m.passes)]
    if c is None or not inside:  # no clip inside the window: none of these placements
        return False
    matches = [name for name, vec in placements(m.basis, m.f, c, kind, norm_type).items()
               if name != "once" and rel(vec, m.applied) <= m.thr]
    if not matches:
        return False
    # several can match (duplicate micro-batches make the running buffer and raw per-micro-batch clips one
    # vector): then the placement the buffer trace shows stands
    traced = "clip_per_micro_batch" if _trace_per_micro(m, inside) else "clip_running_buffer"
    agreeing = [name for name in matches
                if ("clip_running_buffer" if name == "running" else "clip_per_micro_batch") == traced]
    matched = (agreeing or matches)[0]
    evidence = f"your gradient equals {PLACEMENT_TEXT[matched]} at threshold {num(c)} to rounding; {weights}"
    if matched == "running":
        out.remove({"clip_per_micro_batch"})
        out.add("clip_running_buffer", CLIP_RUNNING, evidence, CLIP_FIX, 3)
    else:
        out.remove({"clip_running_buffer"})
        out.add("clip_per_micro_batch", CLIP_PER_MICRO, evidence, CLIP_FIX, 3)
    return True


def _alpha_pattern(m: Measurements) -> tuple[float, bool, list[float]] | None:
    r"""What each backward pass added, :math:`\alpha_j`, against the full batch's :math:`f_j`, over the
    micro-batches that carry weight (:math:`f_j \ne 0`): ``(scale, equal, alphas)`` when the :math:`\alpha_j`
    are proportional to the :math:`f_j` (``equal`` False; scale the common ratio) or equal where the :math:`f_j`
    differ (``equal`` True, a per-micro-batch mean; scale the mean :math:`\alpha` over the mean :math:`f`); None
    when neither, or when they cannot be read."""
    alphas = _per_backward(m)
    present = [j for j in range(m.k) if m.f[j] != 0]
    if alphas is None or len(present) < 1 or any(math.isnan(alphas[j]) for j in present):
        return None
    f, a = [m.f[j] for j in present], [alphas[j] for j in present]
    ratio = [aj / fj for aj, fj in zip(a, f)]
    r_mean = sum(ratio) / len(ratio)
    if r_mean != 0 and max(abs(r / r_mean - 1) for r in ratio) <= m.thr:
        return r_mean, False, alphas
    a_mean = sum(a) / len(a)
    f_equal = max(f) - min(f) <= m.thr * max(abs(v) for v in f)
    if len(present) > 1 and not f_equal and a_mean != 0 and max(abs(v / a_mean - 1) for v in a) <= m.thr:
        return a_mean / (sum(m.f) / m.k), True, alphas
    return None


def _per_micro_with(m: Measurements, alphas: list[float]) -> bool:
    """Whether the step is each backward's contribution clipped on its own and added up (the per-micro-batch
    placement with the measured weights): then those weights are what reached the step."""
    clips = [e for e in _counts(m.events, "clip") if e.after < len(m.passes)]
    c, kind, norm_type = _loop_clip(m, clips)
    if not clips or c is None:
        return False
    weights = [0.0 if math.isnan(a) else a for a in alphas]
    return rel(placements(m.basis, weights, c, kind, norm_type)["scaled_micro"], m.applied) <= m.thr


def _trace_per_micro(m: Measurements, inside: list[Event]) -> bool:
    """Whether the buffer trace shows clips per micro-batch: at each clip after the first the buffer held that
    micro-batch only, and after each clip it was emptied (K = 2 has only the second kind of evidence)."""
    later = [e for e in inside if e.after >= 2]  # the first clip always sees one micro-batch only
    emptied = all(e.after < len(m.passes) and _is_zero(m.passes[e.after].before) for e in inside)
    return bool(inside) and all(_held_one(m, e) for e in later) and (bool(later) or emptied)


def _held_one(m: Measurements, e: Event) -> bool:
    """Whether, at clip event e, the buffer held only the latest micro-batch (it was emptied before it)."""
    j = e.after  # clip came after backward j (1-based)
    if j > len(m.passes):
        return False
    return j == 1 or _is_zero(m.passes[j - 1].before)


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
        fix = ("GroupNorm/LayerNorm, larger micro-batches, or PreciseBN for the running statistics (chapters 1, 2); "
               "running statistics are also updated K times per step" if bn else
               "replace the layer by a per-sample one, or accept (and measure) the difference; larger micro-batches "
               "shrink it")
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


def _other_sizes(m: Measurements, out: _Findings, sizes: list[int]) -> None:
    """The step's forward passes saw batches of other sizes than the K equal micro-batches (another K)."""
    out.add("micro_batches_differ", "your step's micro-batches are not the K equal parts of the batch",
            f"its forward passes saw {len(m.forwards)} batch(es) of size(s) {sizes}; K = {m.k} micro-batches of "
            f"{m.b} were expected", "pass the K your loop uses (-k), and split the window into K equal, "
            "consecutive micro-batches", 6)


def _loop_findings(m: Measurements, out: _Findings, w: list[float], e: list[float], residual: float, cond: float,
                   clipped: torch.Tensor, loop_error: float) -> None:
    k = m.k
    events = m.events
    fit_tol = m.thr
    if any(c in out for c in ("optimizer_step_inside_window", "scaler_step_inside_window")):
        return  # the weights moved mid-window: the micro-batch gradients no longer describe the step
    seen: dict[int, int] = {}
    for offset, size in m.forwards:
        if size == m.b:
            seen[offset] = seen.get(offset, 0) + 1
    never = [j + 1 for j in range(k) if j * m.b not in seen]
    again = [offset // m.b + 1 for offset, count in sorted(seen.items()) if count > 1 and offset % m.b == 0]
    if m.has_step and never and again:  # e.g. a loop that never advances its iterator
        out.add("micro_batches_differ", "your step's micro-batches are not the K parts of the batch",
                f"its forward passes saw micro-batch(es) {ordinal_list(again)} more than once and never "
                f"{ordinal_list(never)}", "advance the data iterator once per micro-batch: each window must see each "
                "of its K micro-batches once", 6)
        return
    sizes = sorted({n for _, n in m.forwards})
    if m.has_step and sizes and sizes != [m.b] and loop_error > m.tol:  # e.g. a loop with its own, other K
        _other_sizes(m, out, sizes)
        return
    if residual > fit_tol:  # (a rank-deficient basis, e.g. duplicate micro-batches, still fits: min-norm weights)
        inside_zeros = [ev for ev in _inside(_counts(events, "zero_grad"), len(m.passes)) if ev.after > 0]
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
        return
    _backward_weight_findings(m, out, loop_error, cosine(clipped, m.applied))
    resets = [j + 1 for j in range(1, len(m.passes)) if _is_zero(m.passes[j].before)
              and not _is_zero(m.passes[j - 1].after)]
    zeros = [ev for ev in _inside(_counts(events, "zero_grad"), len(m.passes)) if ev.after > 0]
    if cond > 1e10:
        # micro-batch gradients linearly dependent (duplicate samples, tiny models): weights are not unique, so
        # read the buffer trace instead, and the scale along the ideal gradient
        last_clip = math.prod(ev.detail.get("factor", 1.0) for ev in _counts(events, "clip")
                              if ev.after == len(m.passes))  # a clip after the last backward rescales the buffer
        if resets and m.passes and rel(m.passes[-1].after * last_clip, m.applied) <= fit_tol:
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
        return
    missing = [j for j in range(k) if w[j] == 0 and e[j] != 0]  # exactly absent (rounding noise removed above)
    present = [j for j in range(k) if j not in missing and e[j] != 0]
    weights = f"weights {nums(w)} instead of {nums(e)}"
    late = [ev for ev in _counts(events, "zero_grad") if ev.after == len(m.passes)]
    if missing and not present and late and _is_zero(m.applied):  # emptied between the last backward and the step
        out.add("zero_grad_inside_window", ZERO_GRAD_CAUSE,
                f"zero_grad() called {len(late)}× after the last backward pass, before "
                f"your step's gradient was applied: the step applies an empty buffer ({weights})",
                "zero the gradients once per window, before the first micro-batch or after optimizer.step(); "
                "never between the last backward and the step", 6)
        return
    if missing:
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
    if not present:
        return
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
    clips = _counts(events, "clip")
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
        return
    if uniform:
        if abs(mean - 1) > m.thr:
            what = ("the weights of the micro-batches that reach the step are" if missing else
                    "the micro-batch weights are")
            _scale_findings(m, out, mean, loop_error, cosine(clipped, m.applied), clips, what=what)
        return
    # weights of different shape: clipping placements, scale changes, or something else
    if _clip_placement(m, out, clips, f"the micro-batches no longer weigh what they weigh in the full batch: "
                       f"{weights}"):
        _token_from_backwards(m, out, loop_error, cosine(clipped, m.applied), clips)
        return
    scales = [p.scale for p in m.passes if p.scale is not None]
    if len(scales) == k and len(set(scales)) > 1:
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


def _backward_weight_findings(m: Measurements, out: _Findings, loop_error: float, cos: float) -> None:
    r"""Missing or doubled 1/K read from what each backward pass added, :math:`\alpha_j` (before any clipping),
    against the full batch's weights :math:`f_j`: :math:`\alpha_j = K f_j` for all j is a missing 1/K,
    :math:`\alpha_j = f_j / K` a doubled one. Used only when the step applies the buffer the last backward left,
    rescaled by nothing but its clip calls, or each backward's contribution clipped on its own and added up (so a
    loop that divides the gradients after the window is not blamed)."""
    k = m.k
    alphas = _per_backward(m)
    if k < 2 or alphas is None or not m.passes:
        return
    p = m.passes[-1]
    left = p.after / p.scale if p.scale else p.after
    factor = 1.0
    for ev in _counts(m.events, "clip"):
        if ev.after == len(m.passes):
            factor *= ev.detail.get("factor", 1.0)
    pattern = _alpha_pattern(m)  # the weights each backward added, proportional to the full batch's
    if pattern is None or pattern[1]:
        return
    if rel(left * factor, m.applied) > m.thr and not _per_micro_with(m, alphas):
        return
    mean = pattern[0]
    clips = _counts(m.events, "clip")
    before = " (measured before any clipping)" if clips else ""
    evidence = (f"each backward added {nums(alphas)}× its micro-batch's gradient{before}; "
                f"the full batch weighs them {nums(m.f)}: the micro-batch weights are {num(mean)}× the full "
                "batch's")
    if not clips:
        kminus1 = " = K − 1" if abs(loop_error - (k - 1)) <= m.thr * (k - 1) else ""
        evidence += (f" (your step against the ideal accumulation Σ f_j h_j: relative error "
                     f"{num(loop_error)}{kminus1}, cosine {cos:.4f})")
    if clips:
        c = ", ".join(sorted({num(e.detail.get("max_norm", e.detail.get("clip_value", float("nan"))))
                              for e in clips}))
        evidence += (f"; your clipping (threshold {c}) rescales the step and hides part or all of this from it "
                     f"(your step against the ideal accumulation: relative error {num(loop_error)}), but the "
                     "weights hold whenever the threshold does not bite")
    if abs(mean - k) <= m.thr * k:
        out.add("missing_1_over_k", "missing 1/K: the micro-batch losses are not divided by K", evidence,
                "divide each micro-batch's loss by K before backward (or the gradients by K once, before the step)",
                6)
    elif abs(mean - 1 / k) <= m.thr / k:
        out.add("double_1_over_k", _DOUBLE_1_OVER_K, evidence, _DOUBLE_1_OVER_K_FIX, 6)


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


def _loop_clip(m: Measurements, clips: list[Event]) -> tuple[float | None, str, float]:
    if m.clip is not None:
        return m.clip, m.clip_kind, m.clip_norm_type
    for e in clips:
        if "max_norm" in e.detail:
            return e.detail["max_norm"], "norm", e.detail.get("norm_type", 2.0)
        if "clip_value" in e.detail:
            return e.detail["clip_value"], "value", 2.0
    return None, "norm", 2.0


def _per_backward(m: Measurements) -> list[float] | None:
    """How much of its micro-batch's gradient each backward pass added (divided by the loss scale in force)."""
    if len(m.passes) != m.k:
        return None
    alphas = []
    for j, p in enumerate(m.passes):
        h = m.basis[j]
        hh = float(h @ h)
        if hh == 0:  # all padding, say: it adds nothing whatever its weight
            alphas.append(math.nan)
            continue
        a = float((p.after - p.before) @ h) / hh
        alphas.append(a / p.scale if p.scale else a)
    return alphas


def _scale_findings(m: Measurements, out: _Findings, s: float, loop_error: float, cos: float, clips: list[Event],
                    token: bool = False, what: str = "the gradient is") -> None:
    """Findings for a gradient that is ``s`` times what it should be (same direction). ``what`` names the
    measured quantity ``s`` is read from (the fitted micro-batch weights, or the whole gradient)."""
    k = m.k
    close = lambda a, b: abs(a - b) <= m.thr * abs(b)  # noqa: E731
    # clip_grad_norm_ divides by the norm + 1e-6: a clip that bit moves the step by up to 1e-6 / norm of itself
    slack = sum(1e-6 / n for n in (e.detail.get("norm_before", math.nan) for e in clips) if n > 0)
    full = float(m.full.norm())
    if m.clip is not None and full > 0:  # the reference's own clip has the same term
        slack += 1e-6 / full
    if close(s, 1.0) or abs(s - 1) <= 2 * slack:
        return
    named = [c for c in ("missing_1_over_k", "double_1_over_k") if c in out]
    if named:  # already named from the per-backward weights (a clip may have rescaled the step): add the fit
        after = " after clipping" if clips else ""
        out.add(named[0], "", f"fitted on the step{after}, {what} {num(s)}× the full batch's", "", 6)
        return
    alphas = _per_backward(m)
    added = (f"; each backward added {nums(alphas)}× its micro-batch's gradient (the full batch weighs them "
             f"{nums(m.f)})" if alphas else "")
    kminus1 = " = K − 1" if k > 1 and abs(loop_error - (k - 1)) <= m.thr * (k - 1) else ""
    head = (f"{what} {num(s)}× the full batch's (your step against the ideal accumulation Σ f_j h_j of this model: "
            f"relative error {num(loop_error)}{kminus1}, cosine {cos:.4f})")
    scalers = [p.scale for p in m.passes if p.scale is not None]
    if k > 1 and close(s, k):
        out.add("missing_1_over_k", "missing 1/K: the micro-batch losses are not divided by K",
                head + added, "divide each micro-batch's loss by K before backward (or the gradients by K once, "
                "before the step)", 6)
    elif k > 1 and close(s, 1 / k):
        out.add("double_1_over_k", _DOUBLE_1_OVER_K, head + added, _DOUBLE_1_OVER_K_FIX, 6)
    elif scalers and close(s, scalers[-1]):
        out.add("loss_scale_not_removed", "the gradient still carries the loss scale",
                head + f"; the loss scale is {num(scalers[-1])}" + added,
                "scaler.unscale_(optimizer) (or scaler.step(optimizer), which unscales) before using the gradients",
                4)
    elif m.clip is not None and not clips and s > 1:
        out.add("clip_missing", "your loop does not clip", head + f"; the full-batch gradient's norm "
                f"{num(float(m.full.norm()))} exceeds the threshold {num(m.clip)} ({m.clip_source})",
                "clip once per window, after the last backward (after scaler.unscale_), or drop clip=", 3)
    elif any(e.detail.get("scaled") for e in clips):
        out.add("clip_before_unscale", "", f"the step applies {num(s)}× the gradient clipped once after unscaling",
                "", 3)
    elif not token:
        out.add("gradient_scaled", "the gradient is scaled by a constant factor", head + added,
                "find where your loop multiplies or divides the loss or the gradients", 6)

