"""Property tests of the exercise checkers, over generated exercise parameters: the right answer rounded to the
precision the checker states always passes (as a number, a numpy or a torch scalar); every listed typical mistake,
exact or rounded, gets its own explanation; arrays and tensors of several values get feedback, never an
exception."""

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradaccum.book import exercises as ex

ints = st.integers
PARAMS = {
    ex.grade_effective_momentum: dict(m=st.floats(0.001, 0.5), k=ints(2, 64)),
    ex.grade_corrected_momentum: dict(m=st.floats(0.001, 0.5), k=ints(2, 64)),
    ex.grade_biased_variance_ratio: dict(b=ints(2, 256)),
    ex.grade_ghost_virtual_size: dict(k=ints(2, 64), b=ints(2, 64)),
    ex.grade_exact_sweeps: dict(layers=ints(2, 60)),
    ex.grade_frozen_bias_change: dict(delta=st.floats(0.01, 10)),
    ex.grade_clip_scaled_micro: {},
    ex.grade_clip_raw_micro: {},
    ex.grade_scaler_clip_order: dict(scale=st.sampled_from([2.0**e for e in range(8, 25)])),
    ex.grade_effective_scale: dict(scale=st.sampled_from([2.0**e for e in range(8, 25)]), k=ints(2, 512)),
    ex.grade_smallest_positive: dict(dtype=st.sampled_from(["float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"])),
    ex.grade_backoff_scale: dict(scale=st.sampled_from([2.0**e for e in range(8, 25)])),
    ex.grade_backoff_steps: dict(k=ints(2, 64)),
    ex.grade_allreduce_calls: dict(k=ints(2, 64), buckets=ints(1, 20)),
    ex.grade_ring_bytes: dict(p=ints(2, 1024), megabytes=st.floats(1, 10_000)),
    ex.grade_window_token_loss: {},
    ex.grade_warmup_end: dict(warmup=ints(100, 10_000), k=ints(2, 64)),
    ex.grade_partial_scale: dict(present=ints(1, 15), k=ints(16, 16)),
    ex.grade_nosync_saving: dict(
        k=ints(2, 64), p=ints(2, 512), megabytes=st.floats(1, 10_000), gb_per_s=st.floats(1, 1000)
    ),
    ex.grade_accelerate_warmup_end: dict(warmup=ints(100, 10_000), processes=ints(2, 64), k=ints(2, 64)),
    ex.grade_framework_partial_weight: dict(micro_batches=ints(17, 400).filter(lambda n: n % 16), k=ints(16, 16)),
    ex.grade_negatives_per_sample: dict(k=ints(2, 64), b=ints(2, 64)),
    ex.grade_recompute_momentum: dict(m=st.floats(0.001, 0.5), k=ints(1, 64)),
    ex.grade_switch_aux: dict(
        fractions=st.just((0.75, 0.25)), probs=st.tuples(st.floats(0.05, 0.95)).map(lambda t: (t[0], 1 - t[0]))
    ),
    ex.grade_accelerate_token_factor: dict(
        rank_tokens=ints(1, 8).flatmap(
            lambda p: ints(1, 8).flatmap(lambda k: st.tuples(*[st.tuples(*[ints(1, 500)] * k)] * p))
        )
    ),
}


#: Graders of a count: the answer is matched exactly (999 is not 1000), so no rounded form of it, or of a slip, is
#: the same answer.
COUNTS = {
    ex.grade_ghost_virtual_size,
    ex.grade_exact_sweeps,
    ex.grade_backoff_steps,
    ex.grade_allreduce_calls,
    ex.grade_warmup_end,
    ex.grade_accelerate_warmup_end,
    ex.grade_negatives_per_sample,
}


@pytest.mark.parametrize("grader", list(PARAMS), ids=lambda g: g.__name__)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_rounded_right_answers_pass_and_every_mistake_is_named(grader, data):
    kwargs = {name: data.draw(strategy, label=name) for name, strategy in PARAMS[grader].items()}
    expected, digits, mistakes = ex.grading_plan(grader, **kwargs)
    count = grader in COUNTS
    shown = expected if count else ex.round_significant(expected, digits)
    for right in (
        expected,
        shown,
        np.float64(expected),
        torch.tensor(expected, dtype=torch.float64),
        np.float32(shown),
    ):
        fb = grader(right, **kwargs)
        assert fb, (right, kwargs, fb)
    if count and expected >= 100:  # a count is exact: its neighbour is wrong even where 3 digits cannot tell
        assert not grader(expected + 1, **kwargs) and not grader(expected - 1, **kwargs), (expected, kwargs)
    seen = [expected]
    for wrong, why in mistakes:
        given = (wrong,) if count else (wrong, ex.round_significant(wrong, digits))
        if any(
            ex.agrees(g, s, digits)
            or ex.agrees(s, g, digits)
            or ex.round_significant(g, 2) == ex.round_significant(s, 2)
            for g in given
            for s in seen
        ):
            continue  # for these parameters the slip gives a value another case already claims
        seen.append(wrong)
        for given_value in given:
            fb = grader(given_value, **kwargs)
            # the slip's explanation, alone or (when the value is also the answer rounded to fewer digits) after
            # the rounding one
            assert not fb and (fb.message == why or fb.message.endswith(f"If you did not round: {why}")), (
                given_value,
                kwargs,
                fb,
            )
    for not_a_number in (np.zeros(2), torch.zeros(2), "0.5", [0.5]):
        fb = grader(not_a_number, **kwargs)
        assert not fb and fb.message


def test_fewer_digits_than_asked_are_named_not_rejected_silently():
    expected, digits, _ = ex.grading_plan(ex.grade_corrected_momentum)
    assert digits == 5
    fb = ex.grade_corrected_momentum(ex.round_significant(expected, 3))
    assert not fb and "agrees with the answer to 3 significant digits; the exercise asks for 5" in fb.message
    assert ex.grade_corrected_momentum(ex.round_significant(expected, 5))


def test_a_value_both_rounded_and_a_slip_gets_both_readings_and_counts_must_be_whole():
    """Found by review: 0.2 for checkpointing's momentum (m = 0.02, K = 5: 0.183) is the answer rounded to one
    digit and also the first-order value 2Km; a count of 6.0004 negatives was accepted as 6."""
    fb = ex.grade_recompute_momentum(0.2)
    assert not fb and "agrees with the answer to 1 significant digit" in fb.message
    assert fb.message.endswith(
        "If you did not round: that is the first-order approximation; compound the 2K updates: 1 − (1 − m)^(2K)."
    )
    two_digits = ex.grade_recompute_momentum(0.18)
    assert not two_digits and "If you did not round" not in two_digits.message
    for grader, right in ((ex.grade_negatives_per_sample, 6), (ex.grade_warmup_end, 125)):
        assert grader(right) and grader(float(right)) and grader(np.int64(right))
        for off in (right + 0.0004, right - 0.5):
            fb = grader(off)
            assert not fb and "not a whole number" in fb.message, (grader.__name__, off)
    # review: a right count one rounding step off whole was refused; a count gets no advice on significant digits
    assert ex.grade_negatives_per_sample(0.1 * 3 * 20) and ex.grade_warmup_end(124.99999999999997)
    assert "124.9996 is not a whole number" in ex.grade_warmup_end(124.9996).message
    for near in (120, 130, 100):
        assert "significant" not in ex.grade_warmup_end(near).message


def test_expected_answers_of_every_checker_used_in_the_book():
    assert ex.expected_answer(ex.grade_batch_coupled) == ({"BatchNorm2d"}, None)
    value, digits = ex.expected_answer(ex.grade_scaler_clip_order)
    assert math.isclose(value, 2**-16) and digits == 3


def test_a_tie_rounded_half_up_is_read_as_rounding():
    """Review: 0.625 to two digits is 0.62 to Python and 0.63 to most students; both now get the rounding advice
    (0.63 got the generic hint)."""
    for near in (0.62, 0.63):
        fb = ex.grade_framework_partial_weight(near, micro_batches=90, k=16)
        assert not fb and "agrees with the answer to 2 significant digits" in fb.message, (near, fb)
    assert not ex.grade_framework_partial_weight(0.64, micro_batches=90, k=16).message.startswith("0.64 agrees")


def test_a_slip_written_to_fewer_digits_is_still_named():
    """Review: m/K written to three digits (0.00833) got the generic hint in a five-digit exercise."""
    for answer in (0.00833, 0.0083, 0.0083333):
        fb = ex.grade_corrected_momentum(answer)
        assert not fb and "first-order approximation" in fb.message, (answer, fb)
