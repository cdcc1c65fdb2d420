"""The fingerprints read from the micro-batch weights: token counts, clip placements, a constant factor (1/K
missing or twice, the loss scale), the weights each backward added; see :mod:`.rules`."""

from __future__ import annotations

import math

from .measure import (
    Measurements,
    _counts,
    _is_zero,
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
    PLACEMENT_TEXT,
    _Findings,
    num,
    nums,
)


def _token_finding(m: Measurements, out: _Findings, e: list[float], w: list[float], how: str = "") -> None:
    """A loop that weighs micro-batches equally (``w``) where the full batch weighs them unequally (``e``): by
    their token counts (a mean of per-micro-batch token means), or by some other total the loss divides by (a
    class-weighted mean). ``how`` says where ``w`` was read."""
    total_e, total_t = sum(e), sum(m.tokens)
    by_tokens = bool(total_e and total_t) and all(
        abs(ej / total_e - tj / total_t) <= 1e-6 for ej, tj in zip(e, m.tokens)
    )
    if len(set(m.tokens)) > 1 and by_tokens:
        out.add(
            "token_normalization",
            "mean of per-micro-batch token means: micro-batches weighted equally, not by their token counts",
            f"tokens per micro-batch {m.tokens}: the full batch weighs "
            f"micro-batch gradients by their tokens, {nums(e)}; your loop weighs them equally, {nums(w)}{how}",
            "reduction='sum' and divide by the tokens of the whole window (num_items_in_batch), all-reduced "
            "across ranks",
            6,
        )
    else:
        # the same number of targets everywhere, yet the loss weighs micro-batches unequally: a weighted loss
        counted = (
            f"each micro-batch has {m.tokens[0]} target(s)"
            if len(set(m.tokens)) == 1
            else f"micro-batches have {m.tokens} target(s), not in proportion to these weights"
        )
        out.add(
            "token_normalization",
            "a mean of per-micro-batch weighted means: micro-batches weighted equally, not by their total weight",
            f"{counted}, yet the full batch weighs micro-batch "
            f"gradients {nums(e)}: the loss divides by a total that differs between micro-batches (e.g. "
            f"CrossEntropyLoss(weight=...) divides by the summed class weights of the targets); your loop "
            f"weighs them equally, {nums(w)}{how}",
            "sum each micro-batch's weighted loss (reduction='sum') and "
            "divide by the total weight of the whole window's targets",
            6,
        )


def _token_from_backwards(m: Measurements, out: _Findings, loop_error: float, cos: float, clips: list[Event]) -> None:
    r"""A clip inside the window rescales the buffer, so the step's fitted weights mix the clip with the loss's
    weighting. What each backward pass added, :math:`\alpha_j` (read before any clip), is the loss's alone: equal
    :math:`\alpha_j` where the full batch's :math:`f_j` differ is a per-micro-batch mean, named alongside the clip
    (and a mean :math:`\alpha` K or 1/K times the mean :math:`f` a missing or doubled 1/K)."""
    pattern = _alpha_pattern(m)
    if pattern is None or not pattern[1]:
        return
    if "token_normalization" not in out:
        _token_finding(m, out, list(m.f), pattern[2], " (what each backward added, read before your clip)")
    _scale_findings(
        m, out, pattern[0], loop_error, cos, clips, token=True, what="on average, the backward passes' weights are"
    )


def _clip_placement(m: Measurements, out: _Findings, clips: list[Event], weights: str) -> bool:
    """Whether the step equals one of chapter 3's clip placements (other than clipping once) computed from the
    micro-batch gradients at the loop's threshold; if so, the placement is named (the measured gradient decides
    between the running buffer and per micro-batch) and True returned."""
    c, kind, norm_type = _loop_clip(m, clips)
    inside = [e for e in clips if e.after < len(m.passes)]
    if c is None or not inside:  # no clip inside the window: none of these placements
        return False
    matches = [
        name
        for name, vec in placements(m.basis, m.f, c, kind, norm_type).items()
        if name != "once" and rel(vec, m.applied) <= m.thr
    ]
    if not matches:
        return False
    # several can match (duplicate micro-batches make the running buffer and raw per-micro-batch clips one
    # vector): then the placement the buffer trace shows stands
    traced = "clip_per_micro_batch" if _trace_per_micro(m, inside) else "clip_running_buffer"
    agreeing = [
        name for name in matches if ("clip_running_buffer" if name == "running" else "clip_per_micro_batch") == traced
    ]
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
    evidence = (
        f"each backward added {nums(alphas)}× its micro-batch's gradient{before}; "
        f"the full batch weighs them {nums(m.f)}: the micro-batch weights are {num(mean)}× the full "
        "batch's"
    )
    if not clips:
        kminus1 = " = K − 1" if abs(loop_error - (k - 1)) <= m.thr * (k - 1) else ""
        evidence += (
            f" (your step against the ideal accumulation Σ f_j h_j: relative error "
            f"{num(loop_error)}{kminus1}, cosine {cos:.4f})"
        )
    if clips:
        c = ", ".join(sorted({num(e.detail.get("max_norm", e.detail.get("clip_value", float("nan")))) for e in clips}))
        evidence += (
            f"; your clipping (threshold {c}) rescales the step and hides part or all of this from it "
            f"(your step against the ideal accumulation: relative error {num(loop_error)}), but the "
            "weights hold whenever the threshold does not bite"
        )
    if abs(mean - k) <= m.thr * k:
        out.add(
            "missing_1_over_k",
            "missing 1/K: the micro-batch losses are not divided by K",
            evidence,
            "divide each micro-batch's loss by K before backward (or the gradients by K once, before the step)",
            6,
        )
    elif abs(mean - 1 / k) <= m.thr / k:
        out.add("double_1_over_k", _DOUBLE_1_OVER_K, evidence, _DOUBLE_1_OVER_K_FIX, 6)


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


def _scale_findings(
    m: Measurements,
    out: _Findings,
    s: float,
    loop_error: float,
    cos: float,
    clips: list[Event],
    token: bool = False,
    what: str = "the gradient is",
) -> None:
    """Findings for a gradient that is ``s`` times what it should be (same direction). ``what`` names the
    measured quantity ``s`` is read from (the fitted micro-batch weights, or the whole gradient)."""
    if abs(s - 1) <= m.thr or abs(s - 1) <= 2 * _clip_slack(m, clips):
        return
    named = [c for c in ("missing_1_over_k", "double_1_over_k") if c in out]
    if named:  # already named from the per-backward weights (a clip may have rescaled the step): add the fit
        after = " after clipping" if clips else ""
        out.add(named[0], "", f"fitted on the step{after}, {what} {num(s)}× the full batch's", "", 6)
        return
    alphas = _per_backward(m)
    added = (
        f"; each backward added {nums(alphas)}× its micro-batch's gradient (the full batch weighs them {nums(m.f)})"
        if alphas
        else ""
    )
    k = m.k
    kminus1 = " = K − 1" if k > 1 and abs(loop_error - (k - 1)) <= m.thr * (k - 1) else ""
    head = (
        f"{what} {num(s)}× the full batch's (your step against the ideal accumulation Σ f_j h_j of this model: "
        f"relative error {num(loop_error)}{kminus1}, cosine {cos:.4f})"
    )
    _name_scale(m, out, s, head, added, clips, token)


def _clip_slack(m: Measurements, clips: list[Event]) -> float:
    """How far from 1 a correct step's scale can read: clip_grad_norm_ divides by the norm + 1e-6, so a clip that
    bit moves the step by up to 1e-6 / norm of itself (and the reference's own clip has the same term)."""
    slack = sum(1e-6 / n for n in (e.detail.get("norm_before", math.nan) for e in clips) if n > 0)
    full = float(m.full.norm())
    if m.clip is not None and full > 0:
        slack += 1e-6 / full
    return slack


def _name_scale(
    m: Measurements, out: _Findings, s: float, head: str, added: str, clips: list[Event], token: bool
) -> None:
    """The cause of a scale ``s`` (``head`` and ``added``: the evidence): 1/K missing or twice, the loss scale
    left in, a clip the loop does not make or makes before unscaling, else a constant factor (not for a token
    mean, which its own finding names)."""
    k = m.k
    close = lambda a, b: abs(a - b) <= m.thr * abs(b)  # noqa: E731
    scalers = [p.scale for p in m.passes if p.scale is not None]
    if k > 1 and close(s, k):
        out.add(
            "missing_1_over_k",
            "missing 1/K: the micro-batch losses are not divided by K",
            head + added,
            "divide each micro-batch's loss by K before backward (or the gradients by K once, before the step)",
            6,
        )
    elif k > 1 and close(s, 1 / k):
        out.add("double_1_over_k", _DOUBLE_1_OVER_K, head + added, _DOUBLE_1_OVER_K_FIX, 6)
    elif scalers and close(s, scalers[-1]):
        out.add(
            "loss_scale_not_removed",
            "the gradient still carries the loss scale",
            head + f"; the loss scale is {num(scalers[-1])}" + added,
            "scaler.unscale_(optimizer) (or scaler.step(optimizer), which unscales) before using the gradients",
            4,
        )
    elif m.clip is not None and not clips and s > 1:
        out.add(
            "clip_missing",
            "your loop does not clip",
            head + f"; the full-batch gradient's norm "
            f"{num(float(m.full.norm()))} exceeds the threshold {num(m.clip)} ({m.clip_source})",
            "clip once per window, after the last backward (after scaler.unscale_), or drop clip=",
            3,
        )
    elif any(e.detail.get("scaled") for e in clips):
        out.add(
            "clip_before_unscale", "", f"the step applies {num(s)}× the gradient clipped once after unscaling", "", 3
        )
    elif not token:
        out.add(
            "gradient_scaled",
            "the gradient is scaled by a constant factor",
            head + added,
            "find where your loop multiplies or divides the loss or the gradients",
            6,
        )


def _other_sizes(m: Measurements, out: _Findings, sizes: list[int]) -> None:
    """The step's forward passes saw batches of other sizes than the K equal micro-batches (another K)."""
    out.add(
        "micro_batches_differ",
        "your step's micro-batches are not the K equal parts of the batch",
        f"its forward passes saw {len(m.forwards)} batch(es) of size(s) {sizes}; K = {m.k} micro-batches of "
        f"{m.b} were expected",
        "pass the K your loop uses (-k), and split the window into K equal, consecutive micro-batches",
        6,
    )
