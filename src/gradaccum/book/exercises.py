"""Checkers for the book's exercises: each says whether an answer is right and, if not, *why* not.

A checker recognizes the typical wrong answers (the ones a student gets by a known slip, such as adding
momenta instead of compounding them) and names the slip. Every checker returns a :class:`Feedback`, which
displays as one line starting with ✓ or ✗ and is truthy when the answer is right.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from decimal import ROUND_DOWN, ROUND_HALF_UP, Decimal

import torch

from gradaccum import bn_statistics, precision
from gradaccum._validate import (
    require_count,
    require_k,
    require_micro_batch,
    require_momentum,
    require_nonnegative,
    require_partial,
    require_positive,
)


@dataclass(frozen=True)
class Feedback:
    """The verdict on one answer."""

    correct: bool
    message: str

    def __bool__(self) -> bool:
        return self.correct

    def __str__(self) -> str:
        return ("✓ " if self.correct else "✗ ") + self.message

    __repr__ = __str__


#: What a checker says before an answer is given: the same words on the static page (where a reader opens a running
#: copy with the rocket button) and in a notebook.
NO_ANSWER = ("no answer yet: in a running notebook (the rocket button above opens one), assign your answer to "
             "`answer` and run this cell.")


def round_significant(x: float, digits: int) -> float:
    """``x`` rounded to ``digits`` significant digits (0 stays 0)."""
    return float(f"{x:.{digits - 1}e}")


def _is_rounded(value: float, x: float, digits: int) -> bool:
    """Whether ``value`` is ``x`` rounded to ``digits`` significant digits, a tie rounded either way (0.625 to two
    digits is 0.62 to Python, 0.63 to most people)."""
    return value == round_significant(x, digits) or value == _rounded_half_up(x, digits)


def _rounded_half_up(x: float, digits: int) -> float:
    """``x`` rounded to ``digits`` significant digits, a tie away from zero (0.625 to two digits is 0.63); 0 and
    non-finite values stay as they are."""
    if x == 0 or not math.isfinite(x):
        return x
    exact = Decimal(repr(float(x)))  # a NumPy float64 reprs as np.float64(...)
    unit = Decimal(1).scaleb(exact.adjusted() - digits + 1)
    return float(exact.quantize(unit, rounding=ROUND_HALF_UP))


def tolerance(target: float, digits: int, atol: float = 1e-12) -> float:
    """How far an answer may lie from ``target`` and still agree to ``digits`` significant digits: half a unit of
    the last of them (so ``target`` rounded to ``digits`` digits always agrees), plus a slack of 0.1% of that half
    unit and two float32 units in the last place of ``target`` (a rounded answer stored as float32 must still
    agree), at least ``atol``. So an answer up to about 0.1% of a half unit beyond it is accepted too."""
    if target == 0 or not math.isfinite(target):
        return atol
    half_unit = 0.5 * 10.0 ** (math.floor(math.log10(abs(target))) - digits + 1)
    # slack for an answer rounded to `digits` and then stored as float32: 0.1% of the half unit, plus two float32
    # units in the last place of the target (a relative 2**-23), which the rounded value may move by
    return max(half_unit * 1.001 + abs(target) * 2.0**-23, atol)


def agrees(value: float, target: float, digits: int, atol: float = 1e-12) -> bool:
    """Whether ``value`` agrees with ``target`` to ``digits`` significant digits (see :func:`tolerance`)."""
    return abs(value - target) <= tolerance(target, digits, atol)


#: While not None, :func:`grade_number` records what it would grade against instead of grading: the expected
#: value, the digits and the listed mistakes (see :func:`expected_answer`).
_RECORD: list[tuple[float, int, list[tuple[float, str]]]] | None = None


def _digits(x: float, digits: int) -> str:
    """``x`` written with ``digits`` significant digits, trailing zeros kept (1.1 to three digits is "1.10")."""
    text = f"{x:#.{digits}g}"
    mantissa, _, exponent = text.partition("e")
    return mantissa.rstrip(".") + ("e" + exponent if exponent else "")


def grade_number(
    answer: object,
    expected: float,
    mistakes: Iterable[tuple[float, str] | tuple[float, str, float]] = (),
    digits: int = 3,
    hint: str = "",
    atol: float = 1e-12,
    count: bool = False,
) -> Feedback:
    """Compare a numeric ``answer`` with ``expected`` to ``digits`` significant digits (:func:`agrees`; the
    exercise states the precision). Numbers, numpy and torch scalars are all accepted.

    ``mistakes`` pairs the value a known slip produces with the explanation of that slip (and, optionally, its
    own relative tolerance); an answer that agrees with one of them to ``digits`` digits, or equals it rounded to
    two, gets that explanation. An answer that equals ``expected`` rounded to fewer digits than asked is told so
    (and, when it is also a listed slip's value, told both). With ``count`` (the answer counts something) an answer
    that is not a whole number is refused as such, when ``expected`` is one. Otherwise the message gives ``hint``.
    """
    if _RECORD is not None:
        mistakes = list(mistakes)
        _RECORD.append((expected, digits, [(m[0], m[1]) for m in mistakes]))
        return Feedback(False, "recorded")
    if answer is None:
        return Feedback(False, NO_ANSWER)
    if isinstance(answer, str):
        return Feedback(False, f"expected a number, got the text {answer!r}: write the number without quotes "
                               "(a result you computed can be passed as it is).")
    if isinstance(answer, bool) or not hasattr(answer, "__float__"):
        return Feedback(False, f"expected a number, got {type(answer).__name__} {answer!r}.")
    try:  # one-element tensors and arrays alike (float() of a one-element NumPy array is deprecated)
        item = getattr(answer, "item", None)
        value = float(item() if callable(item) else answer)  # more than one element raises
    except (TypeError, ValueError, RuntimeError):
        return Feedback(False, f"expected one number, got {type(answer).__name__} {answer!r}: pass a single value.")
    if not math.isfinite(value):
        return Feedback(False, f"{value} is not a finite number.")
    # a count must be whole (up to float rounding: 0.1 * 3 * 20 is 6)
    fractional = count and float(expected).is_integer() and abs(value - round(value)) > 1e-9 * max(1.0, abs(value))
    fewer = None if count else next(  # a count is not rounded to significant digits
        (n for n in range(digits - 1, 0, -1) if expected != 0 and _is_rounded(value, expected, n)), None)
    too_few = (f"{value:g} agrees with the answer to {fewer} significant digit{'s' if fewer and fewer > 1 else ''}; "
               f"the exercise asks for {digits}: keep more digits (and do not round intermediate results).")
    whole = count and float(expected).is_integer()

    def same(a: float, b: float) -> bool:  # a count matches exactly (999 is not 1000); other answers to `digits`
        return abs(a - b) <= 1e-9 * max(1.0, abs(b)) if whole and float(b).is_integer() else agrees(a, b, digits, atol)

    if same(value, expected) and not fractional:
        if float(expected).is_integer() and abs(expected) < 1e15:
            return Feedback(True, f"correct: {int(expected)}.")
        shown = round_significant(expected, digits)
        up = _rounded_half_up(expected, digits)
        if up != shown:  # a tie: Python rounds it to even, most people up, and either is right
            return Feedback(True, f"correct: exactly {expected:.6g}, a tie at {digits} significant digits "
                                  f"({_digits(shown, digits)} and {_digits(up, digits)} both count).")
        exactly = "" if shown == expected else f"; exactly {expected:.6g}"
        return Feedback(True, f"correct: {_digits(shown, digits)} (to {digits} significant digits{exactly}).")
    mistakes = list(mistakes)
    # a count is whole: say so before a slip whose value is whole (125.5 is not the slip 126), not before a
    # slip that is itself a fraction (the answer a misplaced division gives)
    if fractional and not any(value == m[0] or (not float(m[0]).is_integer() and agrees(value, m[0], digits, atol))
                              for m in mistakes):
        return Feedback(False, f"{value!r} is not a whole number: the answer counts something; give the count.")
    for wrong, why, *own_rtol in mistakes:
        if same(wrong, expected):
            continue  # a "mistake" that equals the answer cannot be one
        if own_rtol:
            hit = math.isclose(value, wrong, rel_tol=own_rtol[0], abs_tol=atol)
        elif whole and float(wrong).is_integer():
            hit = same(value, wrong)
        else:
            hit = agrees(value, wrong, digits, atol) or (wrong != 0 and any(
                _is_rounded(value, wrong, n) for n in range(2, max(digits, 3))))
        if hit and fewer is not None and not count:  # both readings are possible: say both
            return Feedback(False, f"{too_few} If you did not round: {why}")
        if hit:
            return Feedback(False, why)
    if fractional:
        return Feedback(False, f"{value!r} is not a whole number: the answer counts something; give the count.")
    if fewer is not None:
        return Feedback(False, too_few)
    if not count and 0 < abs(expected) < 1 and agrees(value / 100, expected, digits, atol):
        return Feedback(False, f"{value:g} looks like a percentage: give the answer as a fraction, {value / 100:g}.")
    if not count and expected != 0 and math.isclose(value, _truncated(expected, digits), rel_tol=1e-9):
        return Feedback(False, f"{value:g} cuts the answer off after {digits} significant digits; round it to the "
                               "nearest instead.")
    return Feedback(False, f"{value:.12g} is not right. {hint}".rstrip())  # the answer as given, not rounded


def _truncated(x: float, digits: int) -> float:
    """``x`` cut off (towards zero) after ``digits`` significant digits, in decimal (0.29 stays 0.29)."""
    exact = Decimal(repr(float(x)))
    return float(exact.quantize(Decimal(1).scaleb(exact.adjusted() - digits + 1), rounding=ROUND_DOWN))


def grading_plan(grader: Callable[..., Feedback], **kwargs: object) -> tuple[float, int, list[tuple[float, str]]]:
    """What a numeric ``grader`` compares with for the exercise ``kwargs`` describe: the expected value (computed
    by the grader itself), the significant digits it checks and its typical mistakes ``(value, explanation)``."""
    global _RECORD
    _RECORD = []
    try:
        grader(0.0, **kwargs)
        recorded = _RECORD
    finally:
        _RECORD = None
    if len(recorded) != 1:
        raise ValueError(f"{getattr(grader, '__name__', grader)} does not grade one number.")
    return recorded[0]


def expected_answer(grader: Callable[..., Feedback], **kwargs: object) -> tuple[object, int | None]:
    """The answer ``grader`` accepts for the exercise ``kwargs`` describe, and the significant digits it checks
    (None for a non-numeric answer). Used for the instructors' solution cells (nbgrader) and by the tests."""
    if grader is grade_batch_coupled:
        return {name for name, (couples, _) in LAYER_FACTS.items() if couples}, None
    expected, digits, _ = grading_plan(grader, **kwargs)
    return expected, digits


# --------------------------------------------------------------------------------------- chapter 1


def grade_effective_momentum(answer: object, m: float = 0.05, k: int = 6) -> Feedback:
    """Exercise: the momentum per optimizer step of running statistics updated once per micro-batch."""
    expected = bn_statistics.effective_momentum(m, k)
    return grade_number(
        answer,
        expected,
        mistakes=[
            (m, "that is the momentum of a single update, but in training mode BatchNorm updates its running "
                f"statistics on every forward pass: K = {k} times per optimizer step."),
            (k * m, "you added the K momenta. Updates compound: each one keeps a share (1 − m) of the old value, "
                    "so after K updates the old value keeps (1 − m)^K."),
            ((1 - m) ** k, "(1 − m)^K is the weight the *old* running value keeps; the momentum is 1 minus that."),
            (m / k, "m/K is (about) the per-micro-batch momentum that would *correct* the drift; the question "
                    "asks what momentum results when m is used K times."),
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
            (1 - (1 - m) ** k, "that is the effective momentum *with* the drift; invert it instead: "
                               "(1 − m')^K = 1 − m."),
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
            (1.0, "1 is the ratio for the *unbiased* estimate, which PyTorch stores in running_var; training "
                  "normalizes with the biased one (divisor b)."),
            (b / (b - 1), "upside down: the biased estimate is *smaller* on average, by the factor (b − 1)/b."),
            (1 / b, "1/b is the variance of the batch *mean* in units of σ²; the question is about the batch "
                    "variance."),
        ],
        hint="Use E[Σ(xᵢ − x̄)²] = (b − 1)σ².",
    )


#: Layers offered in the "which layers couple the batch" exercise, and why each one does or doesn't.
LAYER_FACTS: dict[str, tuple[bool, str]] = {
    "BatchNorm2d": (True, "BatchNorm2d normalizes with statistics over the batch, so a sample's output depends on "
                          "the rest of its micro-batch."),
    "LayerNorm": (False, "LayerNorm's statistics are per sample; it computes the same function at any batch size."),
    "GroupNorm": (False, "GroupNorm's statistics are per sample (over channel groups and positions)."),
    "InstanceNorm2d": (False, "InstanceNorm2d (with its default track_running_stats=False) normalizes each sample's "
                              "channels on their own."),
    "Dropout": (False, "Dropout draws an independent mask per element: a sample's output does not depend on the "
                       "other samples, so it does not couple them. (Its masks do differ between one big batch and K "
                       "micro-batches — the same distribution, other draws — and chapter 6 shows the real dropout "
                       "pitfall, reused seeds.)"),
    "Linear": (False, "Linear acts on each sample separately."),
}


def grade_batch_coupled(answer: object) -> Feedback:
    """Exercise: which of :data:`LAYER_FACTS`' layers make an accumulated gradient differ from the full batch."""
    if answer is None:
        return Feedback(False, NO_ANSWER)
    if isinstance(answer, (str, Mapping)) or not isinstance(answer, Iterable):
        return Feedback(False, "give a set of layer names, e.g. {'Linear'}.")
    try:
        chosen = set(answer)
    except TypeError:  # unhashable items, e.g. a nested list
        return Feedback(False, "give a flat set of layer names, e.g. {'Linear'}, not a nested list.")
    # "nn.BatchNorm2d" and "torch.nn.BatchNorm2d" name the same class
    chosen = {c.rsplit(".", 1)[-1] if isinstance(c, str) and c.startswith(("nn.", "torch.nn.")) else c
              for c in chosen}
    unknown = chosen - LAYER_FACTS.keys()
    if unknown:
        classes = [u.__name__ for u in unknown if isinstance(u, type)]
        hint = f" (give class names as strings, e.g. {classes[0]!r})" if classes else ""
        return Feedback(False, f"unknown layer name(s) {sorted(map(repr, unknown))}{hint}; choose from "
                               f"{sorted(LAYER_FACTS)}.")
    wrong_in = [name for name in sorted(chosen) if not LAYER_FACTS[name][0]]
    missing = [name for name in sorted(LAYER_FACTS) if LAYER_FACTS[name][0] and name not in chosen]
    if not wrong_in and not missing:
        return Feedback(True, "correct: only BatchNorm2d couples the samples of a micro-batch.")
    reasons = [LAYER_FACTS[name][1] for name in wrong_in + missing]
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
            (float(k * b), "a virtual batch of K·b is the whole batch: that is ordinary BatchNorm over the full "
                           "batch, which accumulation does *not* compute."),
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
            (1.0, "one forward/backward sweep is plain accumulation (or the constants scheme): neither gives the "
                  "full-batch gradient."),
            (float(layers), "one collecting sweep per BatchNorm layer is right, but the gradient itself needs one "
                            "more sweep with every correction applied."),
            (2.0, "two sweeps (statistics, then forward/backward) give the full-batch *forward*, not its gradient; "
                  "and the statistics pass is forward-only, not a forward/backward sweep."),
            (float(2 * layers + 1), "the statistics pass does not count here: it runs forward only and stops at "
                                    "each layer."),
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
        raise ValueError(f"delta = {delta!r} is too small to tell the slip (a change of delta) from the answer (0) "
                         "at the grader's absolute tolerance of 1e-12; pick |delta| >= 1e-9.")
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


def grade_clip_scaled_micro(answer: object) -> Feedback:
    """Exercise: threshold c = 1, K = 4 identical micro-gradients of norm 2; norm of the step under (a1)."""
    return grade_number(
        answer,
        2.0,
        mistakes=[
            (1.0, "1 is what clipping once gives (the correct step). Under (a1) each contribution g_k/K has norm "
                  "0.5 < c, so nothing is clipped and the sum keeps its norm."),
            (0.5, "0.5 is one contribution g_k/K; there are four of them, all pointing the same way."),
            (4.0, "the contributions are g_k/K, not g_k: their sum is the average, of norm 2."),
            (8.0, "the contributions are g_k/K, not g_k: their sum is the average, of norm 2."),
        ],
        hint="Clip each g_k/K (does any exceed c?), then add the four.",
    )


def grade_clip_raw_micro(answer: object) -> Feedback:
    """Exercise: c = 1, K = 2, g_1 = (3, 0), g_2 = (−1, 0); norm of the step under (a2)."""
    return grade_number(
        answer,
        0.0,
        mistakes=[
            (1.0, "1 is the correct step: the average (1, 0) has norm 1 and is not clipped. Under (a2) g_1 is "
                  "clipped to (1, 0) *before* averaging, and then it cancels g_2."),
            (2.0, "2 is ‖g_1 + g_2‖ = ‖(2, 0)‖: the raw micro-gradients summed, neither clipped nor averaged. "
                  "Under (a2) each is clipped first, to (1, 0) and (−1, 0), and then averaged."),
            (0.5, "(1, 0)/2 leaves g_2 out: g_2 = (−1, 0) has norm 1 = c, so it is not clipped (beyond "
                  "clip_grad_norm_'s factor 1/(1 + 1e-6)), but it still enters the average."),
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
        return grade_number(answer, norm, mistakes=[
            (c / scale, f"here the scaled gradient has norm S·{norm:g} = {norm * scale:g}, not above c, so the clip "
                        "does nothing: unscaling gives back the gradient itself."),
        ], hint="Follow the norm: is the scaled gradient above c?")
    return grade_number(
        answer,
        c / scale,
        mistakes=[
            (c, "that is the right order (unscale_, then clip). Here the clip sees the *scaled* gradient."),
            (norm, f"the scaled gradient has norm S·{norm:g}, far above c, so the clip does act: it brings it to c, "
                   "and unscaling then divides by S."),
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
            *([(exponent, f"that is the factor's exponent: give the factor itself, 2^{exponent:g}.")]
              if exponent not in (scale, scale * k, 1 / k, k / scale, scale / k) else []),
        ],
        digits=6,  # an exact answer: six significant digits
        hint="The backward pass starts from (S/K)·L(θ; B_k).",
    )


def grade_smallest_positive(answer: object, dtype: str = "float8_e4m3fn") -> Feedback:
    """Exercise: the smallest positive number of the floating-point format ``dtype`` (a torch dtype name): its
    smallest normal number times its machine epsilon, the last subnormal (from ``torch.finfo``); three
    significant digits."""
    if not isinstance(dtype, str) or not isinstance(getattr(torch, dtype, None), torch.dtype) \
            or not getattr(torch, dtype).is_floating_point:
        raise ValueError(f"{dtype!r} is not a torch floating-point dtype name; use e.g. 'float16' or "
                         "'float8_e4m3fn'.")
    precision.format_info(getattr(torch, dtype))  # refuses a format whose finfo does not give its subnormals
    info, f16 = torch.finfo(getattr(torch, dtype)), torch.finfo(torch.float16)
    smallest = info.smallest_normal * info.eps
    bits = round(-math.log2(info.eps))
    mistakes: list[tuple[float, str] | tuple[float, str, float]] = [
        (0.0, "0 is not positive: the question asks for the smallest number above 0."),
        (info.smallest_normal, f"that is the smallest *normal* number; the subnormals below it go {bits} bits "
                               "further down."),
        (info.eps, "that is machine epsilon (the spacing just above 1), not the smallest number."),
        (smallest / 2, "that is half the smallest subnormal: a tie between 0 and it, which rounds to 0."),
    ]
    if dtype != "float16":
        mistakes.append((f16.smallest_normal * f16.eps, "that is float16's smallest number (2^-24); this format has "
                                                        "its own exponent range and mantissa bits."))
    return grade_number(answer, smallest, mistakes=mistakes,
                        hint="Smallest normal number times machine epsilon; give three significant digits (or the "
                             "exact power of two).")


def grade_backoff_scale(answer: object, scale: float = 8192.0, backoff: float = 0.5, k: int = 8,
                        overflowed: int = 5) -> Feedback:
    """Exercise: the loss scale after a window of ``k`` micro-batches in which micro-batch ``overflowed``
    (1-based) overflowed (correct recipe): one backoff, ``scale · backoff``."""
    require_positive(scale, "scale")
    if isinstance(backoff, bool) or not isinstance(backoff, (int, float)) or not 0 < backoff < 1:
        raise ValueError(f"backoff must lie in (0, 1), as GradScaler requires, got {backoff!r}.")
    require_k(k)
    if isinstance(overflowed, bool) or not isinstance(overflowed, int) or not 1 <= overflowed <= k:
        raise ValueError(f"overflowed is the overflowing micro-batch's number, an int from 1 to K = {k}, got "
                         f"{overflowed!r}.")
    # unscale_ + update() after every micro-batch: the inf stays in .grad, so the overflowing micro-batch's
    # update and every later one back off, and the window's own update once more (precision.amp_window's
    # "unscale_update_per_micro"; a test runs it)
    repeated = k - overflowed + 2
    return grade_number(
        answer,
        scale * backoff,
        mistakes=[
            (scale, "an inf/NaN found at the step makes update() multiply the scale by the backoff factor."),
            (scale * backoff**repeated,
             f"that is a loop that calls unscale_ and update() after every micro-batch: the inf stays in .grad, so "
             f"every update from micro-batch {overflowed} on backs off again ({repeated} times). The recipe "
             "updates once per window: one backoff."),
            (scale * 2, "growth happens after growth_interval steps *without* overflow; here there was one."),
            *([(scale * backoff ** (repeated - 1),
                "that is the per-micro-batch loop (unscale_ + update() after every micro-batch) without the window's "
                "own update(), which backs off once more; the recipe updates once per window: one backoff.")]
              if repeated > 2 else []),
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
            (float(k - 1), "that is a loop that steps per micro-batch; the recipe steps once per window, and "
                           "scaler.step skips that step when the accumulated gradient holds an inf."
                           + (" (Or, if you counted the window's one step: scaler.step finds the inf in the "
                              "accumulated gradient and skips it.)" if k == 2 else "")),
            (1.0, "scaler.step finds the inf in the accumulated gradient and skips the window's only step."),
            (float(k), "that is a step per micro-batch with none skipped; the recipe steps once per window, and "
                       "scaler.step skips that step when the accumulated gradient holds an inf."),
        ],
        atol=0.0,
        hint="How many times does scaler.step run per window, and what does it do after an overflow?",
        count=True,
    )


# --------------------------------------------------------------------------------------- chapter 5


def grade_allreduce_calls(answer: object, k: int = 8, buckets: int = 3) -> Feedback:
    """Exercise: all-reduce calls per optimizer step under naive accumulation (DDP, ``buckets`` buckets)."""
    require_k(k)
    require_count(buckets, "buckets")
    if isinstance(answer, (tuple, list)) and len(answer) == 2:
        return Feedback(False, f"give one number, the count without no_sync(), not {answer!r}: the count with "
                               "no_sync() is the second question, for you to check against the solution.")
    return grade_number(
        answer,
        float(k * buckets),
        mistakes=[
            (float(k), "each backward pass all-reduces every *bucket*, not the model as one message."),
            (float(1 + (k - 1) * buckets), "that is the very first step, whose first backward still has all "
                                           "parameters in one bucket (with find_unused_parameters=False); from the "
                                           "second step on every synchronized backward all-reduces each bucket."),
            (float(buckets), "that is the count with no_sync: one synchronized backward per step."),
            (1.0, "DDP all-reduces once per bucket per synchronized backward pass."),
            (float(k * (buckets + 1)), "that also counts the all-reduce of the map of used parameters "
                                       "(find_unused_parameters=True, one per synchronized backward): the question "
                                       "counts gradient all-reduces, one per bucket."),
            (float((k - 1) * buckets), "that is how many no_sync saves; without it each of the K backward passes "
                                       "all-reduces every bucket."),
            (float(2 + (k - 2) * buckets), "that is the very first step with static_graph=True, whose first two "
                                           "synchronized backward passes use one bucket; from the second step on "
                                           "every synchronized backward all-reduces each bucket."),
        ],
        hint="Count synchronized backward passes per step, and messages per backward pass.",
        count=True,
    )


def grade_ring_bytes(answer: object, p: int = 8, megabytes: float = 100.0) -> Feedback:
    """Exercise: megabytes each rank sends in a ring all-reduce of ``megabytes`` of gradients over p ranks."""
    require_count(p, "p (the number of ranks)", minimum=2)
    require_positive(megabytes, "megabytes")
    return grade_number(
        answer,
        2 * (p - 1) / p * megabytes,
        mistakes=[
            (megabytes, "a ring all-reduce is a reduce-scatter *and* an all-gather: each sends (p−1)/p of the data."),
            ((p - 1) / p * megabytes, "that is one of the two phases; the all-gather sends as much again."),
            (2 * (p - 1) * megabytes, "each round sends a 1/p chunk, not the whole buffer."),
            (2 * megabytes, "“almost 2n” is the limit for many ranks; with p ranks it is exactly 2(p − 1)/p · n."),
            (2 * (p - 1) / p * megabytes * 1e6, "right amount, wrong unit: the question asks for megabytes, not "
                                                "bytes."),
            (2 * (p - 1) / p * megabytes / 1e3, "right amount, wrong unit: the question asks for megabytes, not "
                                                "gigabytes."),
        ] + ([(2 * (p - 1) / p, f"that is the factor 2(p − 1)/p alone; multiply it by the {megabytes:g} MB.")]
             if megabytes != 1 else []),
        hint="2(p − 1) rounds, each sending one chunk of n/p.",
    )


def grade_nosync_saving(answer: object, k: int = 8, p: int = 8, megabytes: float = 100.0,
                        gb_per_s: float = 10.0) -> Feedback:
    """Exercise: milliseconds per optimizer step that no_sync saves (α–β model, latency and copies ignored)."""
    require_k(k)
    require_count(p, "p (the number of ranks)", minimum=2)
    require_positive(megabytes, "megabytes")
    require_positive(gb_per_s, "gb_per_s")
    one = 2 * (p - 1) / p * megabytes / gb_per_s  # ms per ring all-reduce (MB / (GB/s) is ms)
    k_slip = "no_sync saves K − 1 all-reduces, not K: one remains at the end of the window."
    large_p = (f"the ring sends 2(p − 1)/p · n = {2 * (p - 1) / p:g} n per all-reduce at p = {p}, not the "
               "large-p limit 2n.")
    two_n = (k - 1) * 2 * megabytes / gb_per_s
    # at K = p the two slips give the same number: name both
    both = math.isclose(k * one, two_n, rel_tol=1e-9)
    return grade_number(
        answer,
        (k - 1) * one,
        mistakes=[
            (k * one, f"either {k_slip[0].lower()}{k_slip[1:]} Or {large_p[0].lower()}{large_p[1:]} (Both slips "
                      f"give this number here.)" if both else k_slip),
            (two_n, large_p),
            (one, "that is one all-reduce; no_sync saves K − 1 of them per step."),
            ((k - 1) * megabytes / gb_per_s, "a ring all-reduce sends 2(p − 1)/p · n bytes, not n."),
            ((k - 1) * one / 2, "a ring all-reduce has two phases (reduce-scatter and all-gather): 2(p − 1)/p · n."),
            ((k - 1) * one / 1000, "right number, wrong unit: that is in seconds; the answer is asked in "
                                   "milliseconds."),
        ],
        hint="(K − 1) · 2(p − 1)/p · n / β.",
    )


# --------------------------------------------------------------------------------------- chapter 6


def grade_window_token_loss(answer: object, sums: tuple[float, ...] = (30.0, 10.0),
                            tokens: tuple[int, ...] = (100, 10)) -> Feedback:
    """Exercise: the loss of a window whose micro-batches have summed token losses ``sums`` over ``tokens``."""
    if len(sums) != len(tokens) or len(sums) < 2:
        raise ValueError(f"give one summed loss and one token count per micro-batch, at least two of each; got "
                         f"{len(sums)} sums and {len(tokens)} counts.")
    for n in tokens:
        require_count(n, "every micro-batch's token count")
    for s_ in sums:
        require_nonnegative(s_, "a summed token loss")
    mean_of_means = sum(s / n for s, n in zip(sums, tokens)) / len(sums)
    fewest, most = min(tokens), max(tokens)
    weights = (f"it weighs each of the {fewest} tokens of the shortest micro-batch {most / fewest:.3g} times as "
               f"much as a token of the longest." if fewest < most else
               "here every micro-batch holds as many tokens, so it happens to agree; it does not in general.")
    return grade_number(
        answer,
        sum(sums) / sum(tokens),
        mistakes=[
            (mean_of_means, f"that is the mean of the micro-batch means: {weights}"),
            (sum(sums), "divide by the number of tokens."),
            (sum(sums) / len(sums), "divide by tokens, not by micro-batches."),
            (mean_of_means * len(sums), "that is the sum of the micro-batch means (each divided by its own tokens, "
                                        "never by K); the window's loss divides the total by the window's "
                                        "tokens."),
        ],
        hint="Total loss over total tokens.",
    )


def grade_warmup_end(answer: object, warmup: int = 1000, k: int = 8) -> Feedback:
    """Exercise: the optimizer step after which a ``warmup``-step warmup has been counted when the scheduler steps
    once per micro-batch: ⌈warmup / K⌉ (each optimizer step counts K schedule steps)."""
    require_count(warmup, "warmup (schedule steps)")
    require_k(k)
    mistakes = [
        (float(warmup), "that is where it should end; the scheduler here advances K times per optimizer step."),
        (float(warmup * k), "the scheduler runs *faster*, not slower: K steps of the schedule per optimizer step."),
    ]
    if warmup % k:
        mistakes.append((float(warmup // k), f"after {warmup // k} optimizer steps the schedule has counted "
                                             f"{warmup // k * k} < {warmup} steps: round up."))
    end = -(-warmup // k)
    if end + 1 not in (warmup, warmup * k):
        mistakes.append((float(end + 1), f"{end + 1} can be the first optimizer step that *uses* the full rate "
                                         "(depending on the schedule's convention and on the order of the window's "
                                         f"optimizer and scheduler steps); the schedule has *counted* its {warmup} "
                                         f"step{'s' if warmup != 1 else ''} after {end}."))
    return grade_number(answer, float(end), mistakes=mistakes,
                        hint="Each optimizer step advances the schedule by K; count whole optimizer steps.",
                        count=True)


def grade_partial_scale(answer: object, present: int = 3, k: int = 16) -> Feedback:
    """Exercise: the factor by which a last window of ``present`` micro-batches is too small when divided by K."""
    require_k(k)
    require_partial(present, k)
    return grade_number(
        answer,
        present / k,
        mistakes=[
            (k / present, "upside down: that is how many times smaller the gradient is; the question asks for the "
                          "fraction that remains."),
            (1.0, "the last window holds fewer than K micro-batches but is still divided by K."),
            ((k - present) / k, "that is the share that is *missing*; the question asks for the factor that remains."),
        ] + ([(present / 8, f"that is {present}/8, the chapter's study (K = 8); here K = {k}.")]
             if k != 8 and present / 8 < 1 else []),
        hint="Sum of `present` terms, each divided by K, against the mean of those terms.",
    )


# --------------------------------------------------------------------------------------- chapter 7


def grade_accelerate_warmup_end(answer: object, warmup: int = 600, processes: int = 8, k: int = 4) -> Feedback:
    """Exercise: the optimizer step at which a ``warmup``-step warmup, prepared by Accelerate on ``processes``
    processes (``split_batches=False``) with ``k`` accumulation steps, reaches its peak: ⌈warmup / processes⌉."""
    require_count(warmup, "warmup (schedule steps)")
    require_count(processes, "processes")
    require_k(k)
    rounded_down = [(float(warmup // processes), f"after {warmup // processes} optimizer steps the schedule has "
                                                 f"counted {warmup // processes * processes} < {warmup} steps: round "
                                                 "up.")] if warmup % processes else []
    return grade_number(
        answer,
        float(-(-warmup // processes)),
        mistakes=rounded_down + [
            (float(warmup), "that is where it would end in one process; the prepared scheduler steps num_processes "
                            "times per optimizer step."),
            (float(warmup * processes), "the schedule runs *faster* on several processes, not slower."),
            (warmup / (processes * k), "the prepared scheduler does not step on micro-batches that only accumulate: "
                                       "K does not enter."),
            (warmup / k, "K does not enter (the prepared scheduler skips accumulation steps); the number of "
                         "processes does."),
        ],
        hint="Count the calls that reach the wrapped scheduler per optimizer step.",
        count=True,
    )


def grade_framework_partial_weight(answer: object, micro_batches: int = 90, k: int = 16) -> Feedback:
    """Exercise: the weight Lightning gives the last (partial) window of an epoch of ``micro_batches``
    micro-batches with ``accumulate_grad_batches = k``: its gradient over the mean gradient of its micro-batches."""
    require_k(k)
    require_count(micro_batches, "micro_batches")
    if not 0 < micro_batches % k:
        raise ValueError(f"{micro_batches} micro-batches fill windows of {k} exactly: pick a count that leaves a "
                         "partial window.")
    present = micro_batches % k
    return grade_number(
        answer,
        present / k,
        mistakes=[
            (1.0, "that is what the Transformers Trainer and the timm-style loop do (they divide by the micro-batches "
                  "present); Lightning divides every loss by accumulate_grad_batches."),
            ((k - present) / k, "that is the share that is *missing*; the question asks for the weight."),
            (k / present, "upside down: that is how many times too small the step is."),
            (micro_batches / k, "that is how many windows the epoch holds, not the last one's weight."),
        ],
        hint="How many micro-batches does the last window hold, and what does each loss get divided by?",
    )


def grade_accelerate_token_factor(answer: object,
                                  rank_tokens: tuple[tuple[int, ...], ...] = ((30, 50, 20, 40), (40, 40, 10, 30)),
                                  ) -> Feedback:
    """Exercise: the factor by which Accelerate's token recipe multiplies a micro-batch's summed token loss, for
    one window of K micro-batches per process with the given target-token counts (``rank_tokens[p][k]``)."""
    if not isinstance(rank_tokens, (tuple, list)) or not rank_tokens \
            or not all(isinstance(r, (tuple, list)) and r for r in rank_tokens):
        raise ValueError("give one tuple of token counts per process, each with at least one micro-batch.")
    k, processes = len(rank_tokens[0]), len(rank_tokens)
    if any(len(r) != k for r in rank_tokens) or any(isinstance(t, bool) or not isinstance(t, int) or t < 1
                                                     for r in rank_tokens for t in r):
        raise ValueError("give every process the same number of micro-batches, each with a whole number (>= 1) of "
                         "tokens.")
    total = sum(sum(r) for r in rank_tokens)
    own = sum(rank_tokens[0])
    return grade_number(
        answer,
        k * processes / total,
        mistakes=[
            (1 / total, "that would be right if nothing divided afterwards, but Accelerate's backward divides by K "
                        "and DDP averages over the processes: the recipe multiplies by K · num_processes."),
            (k / total, "DDP averages the gradients over the processes: multiply by num_processes too."),
            (processes / total, "Accelerate's backward divides every loss by K: multiply by K too."),
            (k * processes / own, "count the tokens of *all* processes' micro-batches (the recipe gathers the "
                                  "counts), not only this process's."),
            (k / own, "count the tokens of all processes (gather), and multiply by K · num_processes."),
        ],
        hint="The recipe: summed loss × K × num_processes / (tokens of the whole window, all processes).",
    )


# --------------------------------------------------------------------------------------- chapter 8


def grade_negatives_per_sample(answer: object, k: int = 12, b: int = 7) -> Feedback:
    """Exercise: in-batch negatives each sample sees under plain accumulation of ``k`` micro-batches of ``b``."""
    require_k(k)
    require_count(b, "b (pairs per micro-batch)", minimum=2)
    return grade_number(
        answer,
        float(b - 1),
        mistakes=[
            (float(k * b - 1), "that is what the full batch gives; plain accumulation computes the loss inside each "
                               "micro-batch."),
            (float(b), "the sample's own partner is its positive, not a negative."),
            (float(k * b), "that counts the whole window, positive included; the loss sees one micro-batch."),
            (float(k - 1), "negatives come from the other samples of the micro-batch, not from other micro-batches."),
            *([(float(k), "that is K, the number of micro-batches"
                          + (" (and, here, also NT-Xent's count 2(b − 1), both views of every other sample)"
                             if k == 2 * (b - 1) else "")
                          + "; the negatives are the other documents of one micro-batch.")]
              if k not in (b - 1, k * b - 1, b, k * b, k - 1) else []),
            *([(float(2 * (b - 1)), "that is NT-Xent's count (both views of every other sample); this exercise is "
                                    "one-directional InfoNCE over query–document pairs: the other documents of "
                                    "the micro-batch.")] if 2 * (b - 1) not in (b - 1, k * b - 1, b, k * b, k - 1, k)
              else []),
            *([(float(2 * (k * b - 1)), "that is NT-Xent's count over the full batch; this is one-directional "
                                        "InfoNCE within one micro-batch.")]
              if 2 * (k * b - 1) not in (b - 1, k * b - 1, b, k * b, k - 1, k, 2 * (b - 1)) else []),
        ],
        hint="Which samples share a softmax with a given sample under plain accumulation?",
        count=True,
    )


def grade_recompute_momentum(answer: object, m: float = 0.02, k: int = 5) -> Feedback:
    """Exercise: the effective BatchNorm momentum per optimizer step under activation checkpointing."""
    require_k(k)
    require_momentum(m)
    return grade_number(
        answer,
        1 - (1 - m) ** (2 * k),
        mistakes=[
            (1 - (1 - m) ** k, "that is accumulation without checkpointing: the rerun updates the statistics again."),
            (1 - (1 - m) ** 2, "that is per micro-batch; an optimizer step has K of them."),
            (2 * k * m, "that is the first-order approximation; compound the 2K updates: 1 − (1 − m)^(2K)."),
            ((1 - m) ** (2 * k), "that is the weight the old statistics keep after the 2K updates; the new ones get "
                                 "1 minus that."),
            (m, "the momentum applies per forward pass, and there are 2K of them per step."),
        ],
        hint="Each forward in training mode multiplies the old value's weight by (1 − m). How many per step?",
    )


def _numbers(values: object, name: str) -> tuple[object, ...]:
    """``values`` (a list, tuple, NumPy array or tensor) as a tuple of its entries; anything else is refused."""
    tolist = getattr(values, "tolist", None)
    if callable(tolist) and not isinstance(values, (list, tuple)):
        values = tolist()
    if not isinstance(values, (list, tuple)):
        raise ValueError(f"{name} must be a sequence of numbers, one per expert, got {type(values).__name__} "
                         f"{values!r}.")
    return tuple(v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v for v in values)


def grade_switch_aux(answer: object, fractions: tuple[float, ...] = (0.75, 0.25),
                     probs: tuple[float, ...] = (0.6, 0.4)) -> Feedback:
    """Exercise: the Switch load-balancing loss N Σ f_i P_i for given fractions and mean probabilities."""
    fractions, probs = _numbers(fractions, "fractions"), _numbers(probs, "probs")  # type: ignore[assignment]
    if len(fractions) != len(probs) or not fractions:
        raise ValueError("give one fraction and one mean probability per expert.")
    for name, values in (("fractions", fractions), ("probs", probs)):
        if any(isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v < 0
               for v in values) or not abs(sum(values) - 1) <= 1e-6:
            raise ValueError(f"{name} must be finite non-negative numbers summing to 1, got {tuple(values)}.")
    fractions, probs = tuple(float(v) for v in fractions), tuple(float(v) for v in probs)
    n = len(fractions)
    # 12 significant digits: binary noise (1.0999999999999999 for 1.1) would make 1.09 read as a truncation
    value = float(f"{n * math.fsum(f * p for f, p in zip(fractions, probs)):.12g}")
    swapped = float(f"{n * math.fsum(f * p for f, p in zip(fractions, reversed(probs))):.12g}")
    return grade_number(
        answer,
        value,
        mistakes=[
            (value / n, "multiply by the number of experts N: a perfectly balanced router then scores 1."),
            (1.0, "1 is the value of a perfectly balanced router; this one is not balanced."),
            *([(swapped, "that pairs each expert's fraction with another expert's probability: f_i goes with P_i.")]
              if n == 2 and swapped not in (value, value / n, 1.0) else []),
        ],
        hint="N Σ_i f_i P_i.",
    )
