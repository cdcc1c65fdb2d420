"""How the book's exercise checkers grade: :class:`Feedback` (✓ or ✗ and one line; truthy when right) and
:func:`grade_number`, which compares a numeric answer to the significant digits the exercise asks for and names the
typical slip behind a wrong one. :func:`grading_plan` reads back what a checker compares with.

**Course mode** (:func:`course_mode`, switched on by the course's notebooks): the same verdicts, but no message
states the expected value (a slip is named by its kind; a :class:`Reveals` explanation gives its course wording,
and any other explanation that would state the value is replaced by a generic one), and :func:`grading_plan` (so
``exercises.expected_answer``) refuses to run. There is no call that switches it off again.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from decimal import ROUND_DOWN, ROUND_HALF_UP, Decimal


@dataclass(frozen=True)
class Feedback:
    """The verdict on one answer."""

    correct: bool
    message: str

    def __bool__(self) -> bool:
        return self.correct

    def __str__(self) -> str:
        if self.message in (NO_ANSWER, COURSE_NO_ANSWER):  # no answer yet, not a wrong one (the static page shows it)
            return "✎ " + self.message
        return ("✓ " if self.correct else "✗ ") + self.message

    __repr__ = __str__


#: What a checker says before an answer is given: the same words on the static page (where a reader opens a running
#: copy with the rocket button) and in a notebook.
NO_ANSWER = (
    "no answer yet. To try this exercise, open a running copy of the page (the rocket button above), set "
    "`answer` in this cell and run it."
)


#: What a checker says before an answer is given, in course mode (no rocket button in a course's notebook).
COURSE_NO_ANSWER = "no answer yet: set `answer` in this cell and run it."

#: Course mode (:func:`course_mode`): no message states the expected value, and :func:`grading_plan` refuses.
_COURSE = False


def course_mode() -> None:
    """Switch this process to course mode, for good: every checker keeps its verdicts, but its messages name the kind
    of a mistake without stating the expected value, and ``expected_answer``/:func:`grading_plan` refuse to run
    (the course's notebooks call this in their set-up cell; nothing switches it off)."""
    global _COURSE
    _COURSE = True


def in_course_mode() -> bool:
    """Whether :func:`course_mode` is on."""
    return _COURSE


@contextmanager
def course_messages() -> Iterator[None]:
    """Course mode for the duration of a ``with`` block (the locked test cells grade in it); afterwards, the mode
    that was on before."""
    global _COURSE
    before, _COURSE = _COURSE, True
    try:
        yield
    finally:
        _COURSE = before


class Reveals(str):
    """A slip's explanation that states the expected value (self-study wording), with ``course``: its wording for
    course mode, which names the same slip without the value."""

    course: str

    def __new__(cls, text: str, course: str) -> Reveals:
        made = super().__new__(cls, text)
        made.course = course
        return made


#: Course mode's explanation of a listed slip whose own wording would state the expected value.
COURSE_SLIP = "that is the value one of this exercise's typical slips gives; redo the calculation step by step."

#: A number as an explanation writes it (1,221 · 0.5 · 2e-05 · 1.1e+03), not inside a word or formula name.
NUMBER = re.compile(r"(?<![\w.^·/])[-−]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:e[-+]?\d+)?(?![\w^(/])")


def states_value(text: str, expected: float, digits: int, atol: float = 1e-12) -> bool:
    """Whether ``text`` writes a number that agrees with ``expected`` to ``digits`` significant digits (or, for a
    nonzero ``expected``, its first two digits): the test course mode holds every message to. Coordinates of a
    vector, ``(1, 0)``, are not read as statements of a value."""
    text = re.sub(r"\([^()]*,[^()]*\)", " ", text)  # (3, 0), (−1, 0): vectors, not values
    for match in NUMBER.finditer(text):
        x = float(match.group().replace("−", "-").replace(",", ""))
        if agrees(x, expected, digits, atol) or (expected != 0 and _is_rounded(x, expected, 2)):
            return True
    return False


def _course_text(text: str, expected: float, digits: int, atol: float, fallback: str) -> str:
    """``text`` as course mode says it: its course wording when it is a :class:`Reveals`, ``fallback`` when it would
    still state the expected value."""
    text = getattr(text, "course", text)
    return fallback if states_value(text, expected, digits, atol) else text


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
_RECORD: list[Plan] | None = None


@dataclass(frozen=True)
class Plan:
    """Everything :func:`grade_number` grades one exercise with (:func:`grading_plan` returns its first three)."""

    expected: float
    digits: int
    mistakes: list[tuple[float, str]]
    hint: str
    atol: float
    count: bool

    def accepts_within(self) -> float:
        """How far from ``expected`` an answer is still accepted: :func:`tolerance`, or for a count that is a whole
        number the float rounding of a whole number (9 is not 10)."""
        if self.count and float(self.expected).is_integer():
            return 1e-9 * max(1.0, abs(self.expected))
        return tolerance(self.expected, self.digits, self.atol)


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
        _RECORD.append(Plan(expected, digits, [(m[0], m[1]) for m in mistakes], hint, atol, count))
        return Feedback(False, "recorded")
    if answer is None:
        return Feedback(False, COURSE_NO_ANSWER if _COURSE else NO_ANSWER)
    value = _as_number(answer)
    if isinstance(value, Feedback):
        return value
    # a count must be whole (up to float rounding: 0.1 * 3 * 20 is 6)
    fractional = count and float(expected).is_integer() and abs(value - round(value)) > 1e-9 * max(1.0, abs(value))
    fewer = (
        None
        if count
        else next(  # a count is not rounded to significant digits
            (n for n in range(digits - 1, 0, -1) if expected != 0 and _is_rounded(value, expected, n)), None
        )
    )
    too_few = (
        f"{value:g} agrees with the answer to {fewer} significant digit{'s' if fewer and fewer > 1 else ''}; "
        f"the exercise asks for {digits}: keep more digits (and do not round intermediate results)."
    )
    same = _matcher(count and float(expected).is_integer(), digits, atol)
    if same(value, expected) and not fractional:
        return _correct(expected, digits)
    mistakes = list(mistakes)
    # a count is whole: say so before a slip whose value is whole (125.5 is not the slip 126), not before a
    # slip that is itself a fraction (the answer a misplaced division gives)
    if fractional and not any(
        value == m[0] or (not float(m[0]).is_integer() and agrees(value, m[0], digits, atol)) for m in mistakes
    ):
        return Feedback(False, f"{value!r} is not a whole number: the answer counts something; give the count.")
    why = _slip(value, expected, mistakes, same, digits, atol, count and float(expected).is_integer())
    if why is not None:
        why = _course_text(why, expected, digits, atol, COURSE_SLIP) if _COURSE else str(why)
        return Feedback(False, f"{too_few} If you did not round: {why}" if fewer is not None and not count else why)
    if fractional:
        return Feedback(False, f"{value!r} is not a whole number: the answer counts something; give the count.")
    if fewer is not None:
        return Feedback(False, too_few)
    return _near_miss(value, expected, digits, atol, count, hint)


def _as_number(answer: object) -> float | Feedback:
    """``answer`` as one finite float, or the Feedback that says why it is not one."""
    if isinstance(answer, str):
        return Feedback(
            False,
            f"expected a number, got the text {answer!r}: write the number without quotes "
            "(a result you computed can be passed as it is).",
        )
    if isinstance(answer, bool) or not hasattr(answer, "__float__"):
        return Feedback(False, f"expected a number, got {type(answer).__name__} {answer!r}.")
    try:  # one-element tensors and arrays alike (float() of a one-element NumPy array is deprecated)
        item = getattr(answer, "item", None)
        value = float(item() if callable(item) else answer)  # more than one element raises
    except (TypeError, ValueError, RuntimeError):
        return Feedback(False, f"expected one number, got {type(answer).__name__} {answer!r}: pass a single value.")
    if not math.isfinite(value):
        return Feedback(False, f"{value} is not a finite number.")
    return value


def _matcher(whole: bool, digits: int, atol: float) -> Callable[[float, float], bool]:
    """Whether two values match: a count exactly (999 is not 1000), other answers to ``digits`` digits."""

    def same(a: float, b: float) -> bool:
        return abs(a - b) <= 1e-9 * max(1.0, abs(b)) if whole and float(b).is_integer() else agrees(a, b, digits, atol)

    return same


def _correct(expected: float, digits: int) -> Feedback:
    """The ✓ message: the answer as the exercise states it (a tie at ``digits`` digits accepted either way); in course
    mode without the value."""
    if _COURSE:
        return Feedback(
            True, "correct." if float(expected).is_integer() else f"correct (to {digits} significant digits)."
        )
    if float(expected).is_integer() and abs(expected) < 1e15:
        return Feedback(True, f"correct: {int(expected)}.")
    shown = round_significant(expected, digits)
    up = _rounded_half_up(expected, digits)
    if up != shown:  # a tie: Python rounds it to even, most people up, and either is right
        return Feedback(
            True,
            f"correct: exactly {expected:.6g}, a tie at {digits} significant digits "
            f"({_digits(shown, digits)} and {_digits(up, digits)} both count).",
        )
    exactly = "" if shown == expected else f"; exactly {expected:.6g}"
    return Feedback(True, f"correct: {_digits(shown, digits)} (to {digits} significant digits{exactly}).")


def _slip(
    value: float,
    expected: float,
    mistakes: list,
    same: Callable[[float, float], bool],
    digits: int,
    atol: float,
    whole: bool,
) -> str | None:
    """The explanation of the first listed slip ``value`` matches (None: none does)."""
    for wrong, why, *own_rtol in mistakes:
        if same(wrong, expected):
            continue  # a "mistake" that equals the answer cannot be one
        if own_rtol:
            hit = math.isclose(value, wrong, rel_tol=own_rtol[0], abs_tol=atol)
        elif whole and float(wrong).is_integer():
            hit = same(value, wrong)
        else:
            hit = agrees(value, wrong, digits, atol) or (
                wrong != 0 and any(_is_rounded(value, wrong, n) for n in range(2, max(digits, 3)))
            )
        if hit:
            return why
    return None


def _near_miss(value: float, expected: float, digits: int, atol: float, count: bool, hint: str) -> Feedback:
    """The ✗ message for an answer that is no listed slip: a percentage, a truncation, or ``hint`` (in course mode,
    none of them with the expected value)."""
    if _COURSE:
        hint = _course_text(hint, expected, digits, atol, "")
    if not count and 0 < abs(expected) < 1 and agrees(value / 100, expected, digits, atol):
        fraction = "" if _COURSE else f", {value / 100:g}"
        return Feedback(False, f"{value:g} looks like a percentage: give the answer as a fraction{fraction}.")
    if not count and expected != 0 and math.isclose(value, _truncated(expected, digits), rel_tol=1e-9):
        return Feedback(
            False, f"{value:g} cuts the answer off after {digits} significant digits; round it to the nearest instead."
        )
    return Feedback(False, f"{value:.12g} is not right. {hint}".rstrip())  # the answer as given, not rounded


def _truncated(x: float, digits: int) -> float:
    """``x`` cut off (towards zero) after ``digits`` significant digits, in decimal (0.29 stays 0.29)."""
    exact = Decimal(repr(float(x)))
    return float(exact.quantize(Decimal(1).scaleb(exact.adjusted() - digits + 1), rounding=ROUND_DOWN))


def grading_plan(grader: Callable[..., Feedback], **kwargs: object) -> tuple[float, int, list[tuple[float, str]]]:
    """What a numeric ``grader`` compares with for the exercise ``kwargs`` describe: the expected value (computed
    by the grader itself), the significant digits it checks and its typical mistakes ``(value, explanation)``. Not in
    course mode (:func:`course_mode`): there it raises RuntimeError."""
    if _COURSE:
        raise RuntimeError(
            "the expected answers are not available in course mode (the course's notebooks grade with "
            "the checkers; ask your instructor for the solutions after the deadline)."
        )
    plan = _plan(grader, **kwargs)
    return plan.expected, plan.digits, plan.mistakes


def _plan(grader: Callable[..., Feedback], **kwargs: object) -> Plan:
    """The :class:`Plan` a numeric ``grader`` grades the exercise ``kwargs`` describe with (any mode: the tests')."""
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
