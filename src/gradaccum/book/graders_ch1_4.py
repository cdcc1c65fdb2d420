"""The exercise checkers of chapters 1–4 (micro-batch statistics, Ghost BatchNorm, clipping, loss scaling); each
names the slip behind a typical wrong answer. Read them through :mod:`gradaccum.book.exercises`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping

import torch

from gradaccum import bn_statistics, precision
from gradaccum._validate import (
    require_count,
    require_k,
    require_micro_batch,
    require_positive,
)
from gradaccum.book.grading import COURSE_NO_ANSWER, NO_ANSWER, Feedback, Reveals, grade_number, in_course_mode

# --------------------------------------------------------------------------------------- chapter 1


def grade_effective_momentum(answer: object, m: float = 0.05, k: int = 6) -> Feedback:
    """Exercise: the momentum per optimizer step of running statistics updated once per micro-batch."""
    expected = bn_statistics.effective_momentum(m, k)
    return grade_number(
        answer,
        expected,
        mistakes=[
            (
                m,
                "that is the momentum of a single update, but in training mode BatchNorm updates its running "
                f"statistics on every forward pass: K = {k} times per optimizer step.",
            ),
            (
                k * m,
                "you added the K momenta. Updates compound: each one keeps a share (1 − m) of the old value, "
                "so after K updates the old value keeps (1 − m)^K.",
            ),
            ((1 - m) ** k, "(1 − m)^K is the weight the *old* running value keeps; the momentum is 1 minus that."),
            (
                m / k,
                "m/K is (about) the per-micro-batch momentum that would *correct* the drift; the question "
                "asks what momentum results when m is used K times.",
            ),
        ],
        hint="Write the update K times in a row and collect the weight left on the old value.",
    )


def grade_corrected_momentum(answer: object, m: float = 0.05, k: int = 6) -> Feedback:
    """Exercise: the per-micro-batch momentum whose K updates decay the old value like one update with m."""
    expected = bn_statistics.corrected_momentum(m, k)
    return grade_number(
        answer,
        expected,
        mistakes=[
            (m / k, f"m/K = {m / k:.6g} is only the first-order approximation; solve (1 − m')^K = 1 − m exactly."),
            (
                1 - (1 - m) ** k,
                "that is the effective momentum *with* the drift; invert it instead: (1 − m')^K = 1 − m.",
            ),
            ((1 - m) ** (1 / k), "(1 − m)^(1/K) is the weight each update *keeps*; the momentum is 1 minus that."),
            (m, "that leaves the momentum unchanged, so the running statistics still move K updates per step."),
        ],
        hint="Require that K updates with m' keep the same weight on the old value as one update with m.",
        digits=5,
    )


def grade_biased_variance_ratio(answer: object, b: int = 4) -> Feedback:
    """Exercise: E[biased batch variance] / population variance for a micro-batch of b i.i.d. samples."""
    expected = bn_statistics.biased_variance_factor(b)
    return grade_number(
        answer,
        expected,
        mistakes=[
            (
                1.0,
                "1 is the ratio for the *unbiased* estimate, which PyTorch stores in running_var; training "
                "normalizes with the biased one (divisor b).",
            ),
            (b / (b - 1), "upside down: the biased estimate is *smaller* on average, by the factor (b − 1)/b."),
            (
                1 / b,
                "1/b is the variance of the batch *mean* in units of σ²; the question is about the batch variance.",
            ),
        ],
        hint="Use E[Σ(xᵢ − x̄)²] = (b − 1)σ².",
    )


#: Layers offered in the "which layers couple the batch" exercise, and why each one does or doesn't.
LAYER_FACTS: dict[str, tuple[bool, str]] = {
    "BatchNorm2d": (
        True,
        "BatchNorm2d normalizes with statistics over the batch, so a sample's output depends on "
        "the rest of its micro-batch.",
    ),
    "LayerNorm": (False, "LayerNorm's statistics are per sample; it computes the same function at any batch size."),
    "GroupNorm": (False, "GroupNorm's statistics are per sample (over channel groups and positions)."),
    "InstanceNorm2d": (
        False,
        "InstanceNorm2d (with its default track_running_stats=False) normalizes each sample's channels on their own.",
    ),
    "Dropout": (
        False,
        "Dropout draws an independent mask per element: a sample's output does not depend on the "
        "other samples, so it does not couple them. (Its masks do differ between one big batch and K "
        "micro-batches — the same distribution, other draws — and chapter 6 shows the real dropout "
        "pitfall, reused seeds.)",
    ),
    "Linear": (False, "Linear acts on each sample separately."),
}


def layer_name(name: object) -> object:
    """A layer name as :data:`LAYER_FACTS` spells it: without a ``nn.`` or ``torch.nn.`` prefix, in any case
    (``"torch.nn.batchnorm2d"`` is ``"BatchNorm2d"``); anything else as it is."""
    if not isinstance(name, str):
        return name
    bare = name.strip()
    for prefix in ("torch.nn.", "nn."):
        if bare.lower().startswith(prefix):
            bare = bare[len(prefix) :]
            break
    return next((known for known in LAYER_FACTS if known.lower() == bare.lower()), name)


def grade_batch_coupled(answer: object) -> Feedback:
    """Exercise: which of :data:`LAYER_FACTS`' layers make an accumulated gradient differ from the full batch (names
    read by :func:`layer_name`)."""
    if answer is None:
        return Feedback(False, COURSE_NO_ANSWER if in_course_mode() else NO_ANSWER)
    if isinstance(answer, (str, Mapping)) or not isinstance(answer, Iterable):
        return Feedback(False, "give a set of layer names, e.g. {'Linear'}.")
    try:
        chosen = set(answer)
    except TypeError:  # unhashable items, e.g. a nested list
        return Feedback(False, "give a flat set of layer names, e.g. {'Linear'}, not a nested list.")
    chosen = {layer_name(c) for c in chosen}  # "nn.BatchNorm2d", "torch.nn.batchnorm2d": the same class
    unknown = chosen - LAYER_FACTS.keys()
    if unknown:
        classes = [u.__name__ for u in unknown if isinstance(u, type)]
        hint = f" (give class names as strings, e.g. {classes[0]!r})" if classes else ""
        return Feedback(
            False, f"unknown layer name(s) {sorted(map(repr, unknown))}{hint}; choose from {sorted(LAYER_FACTS)}."
        )
    wrong_in = [name for name in sorted(chosen) if not LAYER_FACTS[name][0]]
    missing = [name for name in sorted(LAYER_FACTS) if LAYER_FACTS[name][0] and name not in chosen]
    if not wrong_in and not missing:
        return Feedback(
            True, "correct." if in_course_mode() else "correct: only BatchNorm2d couples the samples of a micro-batch."
        )
    reasons = [LAYER_FACTS[name][1] for name in wrong_in]
    if missing and in_course_mode():  # which layer is missing is the answer: say only that one is
        reasons.append(
            f"Your set leaves out {len(missing)} layer{'s' if len(missing) > 1 else ''} whose output "
            "depends on the other samples of its micro-batch."
        )
    elif missing:
        reasons += [LAYER_FACTS[name][1] for name in missing]
    return Feedback(False, " ".join(reasons))


# --------------------------------------------------------------------------------------- chapter 2


def grade_ghost_virtual_size(answer: object, k: int = 16, b: int = 4) -> Feedback:
    """Exercise: which Ghost BatchNorm virtual batch size reproduces plain accumulation of K micro-batches of b."""
    require_k(k)
    require_micro_batch(b)  # GhostBatchNorm refuses v = 1
    return grade_number(
        answer,
        float(b),
        mistakes=[
            (
                float(k * b),
                "a virtual batch of K·b is the whole batch: that is ordinary BatchNorm over the full "
                "batch, which accumulation does *not* compute.",
            ),
            (float(k), "K is the *number* of ghost batches; the question asks for their size."),
            (1.0, "a ghost batch of one sample has zero variance; BatchNorm cannot train on it."),
        ],
        hint="Each micro-batch is normalized with its own statistics: how many samples does it hold?",
        count=True,
    )


def grade_exact_sweeps(answer: object, layers: int = 3) -> Feedback:
    """Exercise: forward/backward sweeps over the K micro-batches of the exact full-batch-statistics scheme."""
    require_count(layers, "layers (BatchNorm layers)")
    return grade_number(
        answer,
        float(layers + 1),
        mistakes=[
            (
                1.0,
                "one forward/backward sweep is plain accumulation (or the constants scheme): neither gives the "
                "full-batch gradient.",
            ),
            (
                float(layers),
                "one collecting sweep per BatchNorm layer is right, but the gradient itself needs one "
                "more sweep with every correction applied.",
            ),
            (
                2.0,
                "two sweeps (statistics, then forward/backward) give the full-batch *forward*, not its gradient; "
                "and the statistics pass is forward-only, not a forward/backward sweep.",
            ),
            (
                float(2 * layers + 1),
                "the statistics pass does not count here: it runs forward only and stops at each layer.",
            ),
        ],
        hint="Corrections must be known for every later layer before a layer's sums can be gathered.",
        count=True,
    )


def grade_frozen_bias_change(answer: object, delta: float = 0.5) -> Feedback:
    """Exercise (Ioffe & Szegedy's example): how much the normalized output moves when a bias c before the
    normalization changes by ``delta`` and the mean is recomputed, x̂ = u + c − E[u + c]."""
    if isinstance(delta, bool) or not isinstance(delta, numbers.Real) or not math.isfinite(delta) or delta == 0:
        raise ValueError(f"delta (the bias change) must be a finite nonzero number, got {delta!r}.")
    # the answer 0 is checked to an absolute 1e-12: the slip ±delta must lie far outside it to be told apart
    if abs(delta) < 1e-9:
        raise ValueError(
            f"delta = {delta!r} is too small to tell the slip (a change of delta) from the answer (0) "
            "at the grader's absolute tolerance of 1e-12; pick |delta| >= 1e-9."
        )
    return grade_number(
        answer,
        0.0,
        mistakes=[
            (delta, "the mean E[u + c] moves by the same amount as c, so the two changes cancel."),
            (-delta, "the mean moves with c, so the change cancels exactly; nothing is left over."),
        ],
        hint="Write x̂ after the update and subtract the old x̂.",
    )


# --------------------------------------------------------------------------------------- chapter 3


_SUM_IS_AVERAGE = Reveals(
    "the contributions are g_k/K, not g_k: their sum is the average, of norm 2.",
    course="the contributions are g_k/K, not g_k: added up, they give the average of the "
    "micro-gradients, not their sum.",
)


def grade_clip_scaled_micro(answer: object) -> Feedback:
    """Exercise: threshold c = 1, K = 4 identical micro-gradients of norm 2; norm of the step under (a1)."""
    return grade_number(
        answer,
        2.0,
        mistakes=[
            (
                1.0,
                "1 is what clipping once gives (the correct step). Under (a1) each contribution g_k/K has norm "
                "0.5 < c, so nothing is clipped and the sum keeps its norm.",
            ),
            (0.5, "0.5 is one contribution g_k/K; there are four of them, all pointing the same way."),
            (4.0, _SUM_IS_AVERAGE),
            (8.0, _SUM_IS_AVERAGE),
        ],
        hint="Clip each g_k/K (does any exceed c?), then add the four.",
    )


def grade_clip_raw_micro(answer: object) -> Feedback:
    """Exercise: c = 1, K = 2, g_1 = (3, 0), g_2 = (−1, 0); norm of the step under (a2)."""
    return grade_number(
        answer,
        0.0,
        mistakes=[
            (
                1.0,
                "1 is the correct step: the average (1, 0) has norm 1 and is not clipped. Under (a2) g_1 is "
                "clipped to (1, 0) *before* averaging, and then it cancels g_2.",
            ),
            (
                2.0,
                "2 is ‖g_1 + g_2‖ = ‖(2, 0)‖: the raw micro-gradients summed, neither clipped nor averaged. "
                "Under (a2) each is clipped first, to (1, 0) and (−1, 0), and then averaged.",
            ),
            (
                0.5,
                Reveals(
                    "(1, 0)/2 leaves g_2 out: g_2 = (−1, 0) has norm 1 = c, so it is not clipped (beyond "
                    "clip_grad_norm_'s factor 1/(1 + 1e-6)), but it still enters the average.",
                    course="(1, 0)/2 leaves g_2 out: g_2 = (−1, 0) has norm 1 = c, so clipping leaves it as it "
                    "is (up to rounding), but it still enters the average.",
                ),
            ),
        ],
        hint="Clip g_1 and g_2 separately to norm ≤ 1, then average.",
        atol=1e-6,  # clip_grad_norm_'s + 1e-6 in max_norm / (norm + 1e-6) leaves ~3e-7, not 0
    )


def grade_scaler_clip_order(answer: object, scale: float = 65536.0, c: float = 1.0, norm: float = 4.0) -> Feedback:
    """Exercise: gradient norm the optimizer receives when clip_grad_norm_(c) runs *before* scaler.unscale_: the
    clip sees the scaled norm S·‖g‖; when that exceeds c it brings it to c and unscaling leaves c/S, otherwise the
    clip does nothing and ‖g‖ arrives."""
    scale, c, norm = (require_positive(v, name) for v, name in ((scale, "scale"), (c, "c"), (norm, "norm")))
    if norm * scale <= c:  # the clip does not act
        return grade_number(
            answer,
            norm,
            mistakes=[
                (
                    c / scale,
                    f"here the scaled gradient has norm S·{norm:g} = {norm * scale:g}, not above c, so the clip "
                    "does nothing: unscaling gives back the gradient itself.",
                ),
            ],
            hint="Follow the norm: is the scaled gradient above c?",
        )
    return grade_number(
        answer,
        c / scale,
        mistakes=[
            (c, "that is the right order (unscale_, then clip). Here the clip sees the *scaled* gradient."),
            (
                norm,
                f"the scaled gradient has norm S·{norm:g}, far above c, so the clip does act: it brings it to c, "
                "and unscaling then divides by S.",
            ),
            (c * scale, "unscaling divides by S; it does not multiply."),
            (norm / scale, f"after the clip the scaled gradient has norm c, not S·{norm:g}/S."),
        ],
        hint=f"Follow the norm: scaled gradient S·{norm:g} → clipped to c → divided by S.",
    )


# --------------------------------------------------------------------------------------- chapter 4


def grade_effective_scale(answer: object, scale: float = 65536.0, k: int = 32) -> Feedback:
    """Exercise: the factor every gradient inside micro-batch k's backward pass carries."""
    require_k(k)
    require_positive(scale, "scale")
    exponent = math.log2(scale / k)
    return grade_number(
        answer,
        scale / k,
        mistakes=[
            (scale, "S is the scale of the whole window; each micro-batch's loss is also divided by K."),
            (scale * k, "the loss is divided by K, not multiplied."),
            (1 / k, "that forgets the loss scale S."),
            (k / scale, "upside down: the factor is S/K, not K/S."),
            *(
                [(exponent, f"that is the factor's exponent: give the factor itself, 2^{exponent:g}.")]
                if exponent not in (scale, scale * k, 1 / k, k / scale, scale / k)
                else []
            ),
        ],
        digits=6,  # an exact answer: six significant digits
        hint="The backward pass starts from (S/K)·L(θ; B_k).",
    )


def grade_smallest_positive(answer: object, dtype: str = "float8_e4m3fn") -> Feedback:
    """Exercise: the smallest positive number of the floating-point format ``dtype`` (a torch dtype name): its
    smallest normal number times its machine epsilon, the last subnormal (from ``torch.finfo``); three
    significant digits."""
    if (
        not isinstance(dtype, str)
        or not isinstance(getattr(torch, dtype, None), torch.dtype)
        or not getattr(torch, dtype).is_floating_point
    ):
        raise ValueError(f"{dtype!r} is not a torch floating-point dtype name; use e.g. 'float16' or 'float8_e4m3fn'.")
    precision.format_info(getattr(torch, dtype))  # refuses a format whose finfo does not give its subnormals
    info, f16 = torch.finfo(getattr(torch, dtype)), torch.finfo(torch.float16)
    smallest = info.smallest_normal * info.eps
    bits = round(-math.log2(info.eps))
    mistakes: list[tuple[float, str] | tuple[float, str, float]] = [
        (0.0, "0 is not positive: the question asks for the smallest number above 0."),
        (
            info.smallest_normal,
            f"that is the smallest *normal* number; the subnormals below it go {bits} bits further down.",
        ),
        (info.eps, "that is machine epsilon (the spacing just above 1), not the smallest number."),
        (smallest / 2, "that is half the smallest subnormal: a tie between 0 and it, which rounds to 0."),
    ]
    if dtype != "float16":
        mistakes.append(
            (
                f16.smallest_normal * f16.eps,
                "that is float16's smallest number (2^-24); this format has its own exponent range and mantissa bits.",
            )
        )
    return grade_number(
        answer,
        smallest,
        mistakes=mistakes,
        hint="Smallest normal number times machine epsilon; give three significant digits (or the exact power of two).",
    )


def grade_backoff_scale(
    answer: object, scale: float = 8192.0, backoff: float = 0.5, k: int = 8, overflowed: int = 5
) -> Feedback:
    """Exercise: the loss scale after a window of ``k`` micro-batches in which micro-batch ``overflowed``
    (1-based) overflowed (correct recipe): one backoff, ``scale · backoff``."""
    require_positive(scale, "scale")
    if isinstance(backoff, bool) or not isinstance(backoff, (int, float)) or not 0 < backoff < 1:
        raise ValueError(f"backoff must lie in (0, 1), as GradScaler requires, got {backoff!r}.")
    require_k(k)
    if isinstance(overflowed, bool) or not isinstance(overflowed, int) or not 1 <= overflowed <= k:
        raise ValueError(
            f"overflowed is the overflowing micro-batch's number, an int from 1 to K = {k}, got {overflowed!r}."
        )
    # unscale_ + update() after every micro-batch: the inf stays in .grad, so the overflowing micro-batch's
    # update and every later one back off, and the window's own update once more (precision.amp_window's
    # "unscale_update_per_micro"; a test runs it)
    repeated = k - overflowed + 2
    return grade_number(
        answer,
        scale * backoff,
        mistakes=[
            (scale, "an inf/NaN found at the step makes update() multiply the scale by the backoff factor."),
            (
                scale * backoff**repeated,
                f"that is a loop that calls unscale_ and update() after every micro-batch: the inf stays in .grad, so "
                f"every update from micro-batch {overflowed} on backs off again ({repeated} times). The recipe "
                "updates once per window: one backoff.",
            ),
            (scale * 2, "growth happens after growth_interval steps *without* overflow; here there was one."),
            *(
                [
                    (
                        scale * backoff ** (repeated - 1),
                        "that is the per-micro-batch loop (unscale_ + update() after every micro-batch) without the "
                        "window's own update(), which backs off once more; the recipe updates once per window: one "
                        "backoff.",
                    )
                ]
                if repeated > 2
                else []
            ),
        ],
        digits=6,  # an exact answer: six significant digits
        hint="How many times does update() run in one window, and what does it do after an overflow?",
    )


def grade_backoff_steps(answer: object, k: int = 8) -> Feedback:
    """Exercise: the optimizer steps taken in a window of K micro-batches in which one overflowed (correct
    recipe)."""
    require_k(k)
    return grade_number(
        answer,
        0.0,
        mistakes=[
            (
                float(k - 1),
                "that is a loop that steps per micro-batch; the recipe steps once per window, and "
                "scaler.step skips that step when the accumulated gradient holds an inf."
                + (
                    " (Or, if you counted the window's one step: scaler.step finds the inf in the "
                    "accumulated gradient and skips it.)"
                    if k == 2
                    else ""
                ),
            ),
            (1.0, "scaler.step finds the inf in the accumulated gradient and skips the window's only step."),
            (
                float(k),
                "that is a step per micro-batch with none skipped; the recipe steps once per window, and "
                "scaler.step skips that step when the accumulated gradient holds an inf.",
            ),
        ],
        atol=0.0,
        hint="How many times does scaler.step run per window, and what does it do after an overflow?",
        count=True,
    )
