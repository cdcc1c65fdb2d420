"""Checkers for the book's exercises: each says whether an answer is right and, if not, *why* not.

A checker recognizes the typical wrong answers (the ones a student gets by a known slip, such as adding
momenta instead of compounding them) and names the slip. Every checker returns a :class:`Feedback`, which
displays as one line starting with ✓ or ✗ and is truthy when the answer is right.

In a course (nbgrader), the set-up cell calls :func:`course_mode`: messages name the kind of a mistake without the
expected value and :func:`expected_answer` refuses; each locked test cell calls :func:`verify`, which grades with the
same checker as the answer cell's call (same tolerance, same reading of names) and fails with its message.
"""

from __future__ import annotations

from collections.abc import Callable

from gradaccum.book import graders_ch1_4, graders_ch5_8
from gradaccum.book.graders_ch1_4 import (
    grade_backoff_scale,
    grade_backoff_steps,
    grade_batch_coupled,
    grade_biased_variance_ratio,
    grade_clip_raw_micro,
    grade_clip_scaled_micro,
    grade_corrected_momentum,
    grade_effective_momentum,
    grade_effective_scale,
    grade_exact_sweeps,
    grade_frozen_bias_change,
    grade_ghost_virtual_size,
    grade_scaler_clip_order,
    grade_smallest_positive,
    layer_name,
)
from gradaccum.book.graders_ch5_8 import (
    grade_accelerate_token_factor,
    grade_accelerate_warmup_end,
    grade_allreduce_calls,
    grade_framework_partial_weight,
    grade_negatives_per_sample,
    grade_nosync_saving,
    grade_partial_scale,
    grade_recompute_momentum,
    grade_ring_bytes,
    grade_switch_aux,
    grade_warmup_end,
    grade_window_token_loss,
)
from gradaccum.book.grading import (
    NO_ANSWER,
    Feedback,
    agrees,
    course_messages,
    course_mode,
    grade_number,
    grading_plan,
    round_significant,
    tolerance,
)

__all__ = [
    "Feedback",
    "NO_ANSWER",
    "agrees",
    "course_mode",
    "expected_answer",
    "grade_accelerate_token_factor",
    "grade_accelerate_warmup_end",
    "grade_allreduce_calls",
    "grade_backoff_scale",
    "grade_backoff_steps",
    "grade_batch_coupled",
    "grade_biased_variance_ratio",
    "grade_clip_raw_micro",
    "grade_clip_scaled_micro",
    "grade_corrected_momentum",
    "grade_effective_momentum",
    "grade_effective_scale",
    "grade_exact_sweeps",
    "grade_framework_partial_weight",
    "grade_frozen_bias_change",
    "grade_ghost_virtual_size",
    "grade_negatives_per_sample",
    "grade_nosync_saving",
    "grade_number",
    "grade_partial_scale",
    "grade_recompute_momentum",
    "grade_ring_bytes",
    "grade_scaler_clip_order",
    "grade_smallest_positive",
    "grade_switch_aux",
    "grade_warmup_end",
    "grade_window_token_loss",
    "grading_plan",
    "layer_name",
    "round_significant",
    "tolerance",
    "verify",
]


def expected_answer(grader: Callable[..., Feedback], **kwargs: object) -> tuple[object, int | None]:
    """The answer ``grader`` accepts for the exercise ``kwargs`` describe, and the significant digits it checks
    (None for a non-numeric answer). Used for the instructors' solution cells (nbgrader) and by the tests; in course
    mode it raises RuntimeError, as :func:`grading_plan` does."""
    if grader is grade_batch_coupled:
        grading_plan(grade_effective_momentum)  # refuses in course mode
        return {name for name, (couples, _) in graders_ch1_4.LAYER_FACTS.items() if couples}, None
    expected, digits, _ = grading_plan(grader, **kwargs)
    return expected, digits


#: The checkers by name, as the grader modules define them (taken at import: :func:`verify` grades with these
#: functions whatever a notebook later binds to ``exercises`` or its attributes).
CHECKERS: dict[str, Callable[..., Feedback]] = {
    name: getattr(module, name)
    for module in (graders_ch1_4, graders_ch5_8)
    for name in dir(module)
    if name.startswith("grade_") and callable(getattr(module, name)) and name != "grade_number"
}


def verify(checker: str, answer: object, **kwargs: object) -> Feedback:
    """A course's locked test cell: grade ``answer`` with the checker named ``checker`` (the function the answer
    cell calls, with its keyword arguments ``kwargs``), its messages in course mode; return the ✓ feedback, or raise
    AssertionError with the ✗ (or ✎) message, which nbgrader shows the student."""
    if checker not in CHECKERS:
        raise ValueError(f"{checker!r} is not one of the book's checkers; use one of {sorted(CHECKERS)}.")
    with course_messages():
        feedback = CHECKERS[checker](answer, **kwargs)
    if not feedback:
        raise AssertionError(str(feedback))
    return feedback
