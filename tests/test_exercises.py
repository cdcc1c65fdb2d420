import pytest

from gradaccum.book import exercises as ex


@pytest.mark.parametrize(
    "checker, right",
    [
        (ex.grade_effective_momentum, 1 - 0.95**6),
        (ex.grade_effective_momentum, 0.265),  # the value the solution states
        (ex.grade_corrected_momentum, 1 - 0.95 ** (1 / 6)),
        (ex.grade_corrected_momentum, 0.0085124),  # five significant digits, as asked
        (ex.grade_biased_variance_ratio, 0.75),
        (ex.grade_ghost_virtual_size, 4),
        (ex.grade_exact_sweeps, 4),
        (ex.grade_frozen_bias_change, 0.0),
        (ex.grade_clip_scaled_micro, 2.0),
        (ex.grade_clip_raw_micro, 0.0),
        (ex.grade_scaler_clip_order, 1 / 65536),
        (ex.grade_scaler_clip_order, 1.53e-5),
        (ex.grade_effective_scale, 2048),
        (ex.grade_smallest_positive, 1.95e-3),  # three significant digits, as asked
        (ex.grade_smallest_positive, 2**-9),
        (ex.grade_backoff_scale, 4096),
        (ex.grade_backoff_steps, 0),
        (ex.grade_allreduce_calls, 24),
        (ex.grade_ring_bytes, 175),
        (ex.grade_window_token_loss, 40 / 110),
        (ex.grade_warmup_end, 125),
        (ex.grade_partial_scale, 0.1875),
        (ex.grade_nosync_saving, 122.5),
        (ex.grade_accelerate_warmup_end, 75),
        (ex.grade_framework_partial_weight, 0.625),
        (ex.grade_accelerate_token_factor, 8 / 260),
        (ex.grade_accelerate_token_factor, 0.0308),
        (ex.grade_negatives_per_sample, 6),
        (ex.grade_recompute_momentum, 1 - 0.98**10),
        (ex.grade_recompute_momentum, 0.183),
        (ex.grade_switch_aux, 1.1),
    ],
)
def test_right_answers_pass(checker, right):
    fb = checker(right)
    assert fb and str(fb).startswith("✓")


@pytest.mark.parametrize(
    "checker, wrong, phrase",
    [
        (ex.grade_effective_momentum, 0.05, "every forward pass"),
        (ex.grade_effective_momentum, 0.3, "added the K momenta"),
        (ex.grade_effective_momentum, 0.95**6, "old* running value"),
        (ex.grade_effective_momentum, 0.74, "old* running value"),  # the slip, rounded as a reader writes it
        (ex.grade_effective_momentum, 0.05 / 6, "correct* the drift"),
        (ex.grade_corrected_momentum, 0.05 / 6, "first-order"),
        (ex.grade_corrected_momentum, 1 - 0.95**6, "invert it"),
        (ex.grade_corrected_momentum, 0.95 ** (1 / 6), "keeps"),
        (ex.grade_corrected_momentum, 0.05, "unchanged"),
        (ex.grade_biased_variance_ratio, 1.0, "unbiased"),
        (ex.grade_biased_variance_ratio, 4 / 3, "upside down"),
        (ex.grade_biased_variance_ratio, 0.25, "batch *mean*"),
        (ex.grade_ghost_virtual_size, 64, "whole batch"),
        (ex.grade_ghost_virtual_size, 16, "*number* of ghost batches"),
        (ex.grade_exact_sweeps, 1, "plain accumulation"),
        (ex.grade_exact_sweeps, 3, "one more sweep"),
        (ex.grade_exact_sweeps, 2, "full-batch *forward*"),
        (ex.grade_exact_sweeps, 7, "statistics pass does not count"),
        (ex.grade_frozen_bias_change, 0.5, "cancel"),
        (ex.grade_frozen_bias_change, -0.5, "cancels exactly"),
        (ex.grade_clip_scaled_micro, 1.0, "correct step"),
        (ex.grade_clip_scaled_micro, 8.0, "not g_k"),
        (ex.grade_clip_raw_micro, 1.0, "*before* averaging"),
        (ex.grade_clip_raw_micro, 0.5, "not clipped"),
        (ex.grade_scaler_clip_order, 1.0, "right order"),
        (ex.grade_scaler_clip_order, 4.0, "does act"),
        (ex.grade_scaler_clip_order, 65536.0, "divides by S"),
        (ex.grade_effective_scale, 65536, "divided by K"),
        (ex.grade_effective_scale, 65536 * 32, "not multiplied"),
        (ex.grade_smallest_positive, 2**-6, "*normal*"),
        (ex.grade_smallest_positive, 2**-3, "epsilon"),
        (ex.grade_smallest_positive, 2**-10, "rounds to 0"),
        (ex.grade_smallest_positive, 2**-24, "float16's smallest number"),
        (ex.grade_backoff_scale, 8192, "backoff"),
        (ex.grade_backoff_scale, 8192 * 0.5**5, "after every micro-batch"),
        (ex.grade_backoff_steps, 7, "steps per micro-batch"),
        (ex.grade_backoff_steps, 1, "skips"),
        (ex.grade_allreduce_calls, 8, "*bucket*"),
        (ex.grade_allreduce_calls, 3, "with no_sync"),
        (ex.grade_ring_bytes, 100, "reduce-scatter *and*"),
        (ex.grade_ring_bytes, 87.5, "one of the two phases"),
        (ex.grade_window_token_loss, 0.65, "mean of the micro-batch means"),
        (ex.grade_warmup_end, 1000, "should end"),
        (ex.grade_warmup_end, 8000, "*faster*"),
        (ex.grade_partial_scale, 16 / 3, "upside down"),
        (ex.grade_partial_scale, 13 / 16, "*missing*"),
        (ex.grade_nosync_saving, 140, "K − 1"),
        (ex.grade_nosync_saving, 17.5, "one all-reduce"),
        (ex.grade_nosync_saving, 70, "2(p − 1)/p"),
        (ex.grade_allreduce_calls, 22, "very first step"),  # 1 + 7 · 3: the first step's single bucket
        (ex.grade_allreduce_calls, 32, "map of used parameters"),  # sixth review: the profiler's count
        (ex.grade_allreduce_calls, 21, "how many no_sync saves"),  # (K − 1) · 3
        (ex.grade_ring_bytes, 1.75, "the factor 2(p − 1)/p alone"),
        (ex.grade_partial_scale, 0.375, "the chapter's study (K = 8)"),
        (ex.grade_switch_aux, 1.09, "is not right"),  # sixth review: not "cuts the answer off" (1.1 was 1.0999…)
        (ex.grade_ring_bytes, 200, "almost 2n"),  # the large-p limit 2n, not 2(p − 1)/p · n
        (ex.grade_nosync_saving, 0.1225, "in seconds"),  # 122.5 ms written in seconds
        (ex.grade_accelerate_warmup_end, 600, "num_processes"),
        (ex.grade_accelerate_warmup_end, 4800, "*faster*"),
        (ex.grade_accelerate_warmup_end, 18.75, "K does not enter"),
        (ex.grade_accelerate_warmup_end, 150, "K does not enter"),
        (ex.grade_framework_partial_weight, 1.0, "Transformers Trainer"),
        (ex.grade_framework_partial_weight, 0.375, "*missing*"),
        (ex.grade_framework_partial_weight, 1.6, "upside down"),
        (ex.grade_framework_partial_weight, 90 / 16, "how many windows"),
        (ex.grade_accelerate_token_factor, 1 / 260, "K · num_processes"),
        (ex.grade_accelerate_token_factor, 4 / 260, "multiply by num_processes"),
        (ex.grade_accelerate_token_factor, 2 / 260, "multiply by K too"),
        (ex.grade_accelerate_token_factor, 8 / 140, "*all* processes"),
        (ex.grade_negatives_per_sample, 83, "full batch"),
        (ex.grade_negatives_per_sample, 7, "positive"),
        (ex.grade_recompute_momentum, 1 - 0.98**5, "rerun"),
        (ex.grade_recompute_momentum, 0.2, "first-order"),
        (ex.grade_switch_aux, 0.55, "multiply by the number of experts"),
        (ex.grade_switch_aux, 1.0, "perfectly balanced"),
        (ex.grade_accelerate_token_factor, 4 / 140, "count the tokens of all processes"),
    ],
)
def test_typical_mistakes_are_explained(checker, wrong, phrase):
    fb = checker(wrong)
    assert not fb and str(fb).startswith("✗") and phrase in fb.message


def test_unrecognized_wrong_answer_gets_a_hint():
    fb = ex.grade_effective_momentum(0.33)
    assert not fb and "Write the update K times" in fb.message


@pytest.mark.parametrize(
    "answer, phrase",
    [
        (None, "no answer yet"),
        ("0.265", "without quotes"),
        (float("nan"), "not a finite"),
        (True, "expected a number"),
    ],
)
def test_non_answers(answer, phrase):
    fb = ex.grade_effective_momentum(answer)
    assert not fb and phrase in fb.message


def test_numpy_and_torch_numbers_are_accepted():
    import numpy as np
    import torch

    assert ex.grade_biased_variance_ratio(np.float64(0.75))
    assert ex.grade_biased_variance_ratio(torch.tensor(0.75))


def test_other_parameters():
    assert ex.grade_effective_momentum(1 - 0.99**4, m=0.01, k=4)
    assert ex.grade_biased_variance_ratio(0.5, b=2)


def test_batch_coupled():
    assert ex.grade_batch_coupled({"BatchNorm2d"})
    fb = ex.grade_batch_coupled({"BatchNorm2d", "Dropout"})
    assert not fb and "does not couple them" in fb.message
    fb = ex.grade_batch_coupled({"LayerNorm"})
    assert "per sample" in fb.message and "BatchNorm2d normalizes" in fb.message
    assert "unknown layer" in ex.grade_batch_coupled({"BatchNorm"}).message
    assert "set of layer names" in ex.grade_batch_coupled("BatchNorm2d").message
    assert "no answer yet" in ex.grade_batch_coupled(None).message


def test_smallest_positive_solution_is_computed():
    """ex-ch4-subnormal: the checker's value is torch's smallest positive float8_e4m3fn (bit pattern 0x01), 2^-9,
    and half of it rounds to 0; for float16 the same rule gives 2^-24."""
    import torch

    smallest = float(torch.tensor([1], dtype=torch.uint8).view(torch.float8_e4m3fn).float())
    assert smallest == 2**-9 and float(torch.tensor(smallest / 2).to(torch.float8_e4m3fn).float()) == 0
    assert ex.grade_smallest_positive(smallest) and abs(smallest - 1.95e-3) < 0.005e-3
    assert ex.grade_smallest_positive(2**-24, dtype="float16")
    with pytest.raises(ValueError, match="floating-point"):
        ex.grade_smallest_positive(0.1, dtype="int8")


def test_window_token_exercise_solution():
    """ex-ch6-tokens: 100 tokens with summed loss 30 and 10 with summed loss 10 → token mean 40/110 ≈ 0.364;
    the mean of the micro-batch means is (0.3 + 1.0)/2 = 0.65."""
    import torch

    from gradaccum import windows

    logits = torch.zeros(1, 110, 2, dtype=torch.float64)  # per-token cross-entropy: log(1 + e^{-m}) with margin m
    margins = torch.cat([torch.full((100,), 0.3, dtype=torch.float64), torch.full((10,), 1.0, dtype=torch.float64)])
    logits[0, :, 0] = torch.log(torch.expm1(margins))  # softplus^-1: per-token loss = margin
    y = torch.ones(1, 110, dtype=torch.long)
    per_token = torch.nn.functional.cross_entropy(logits[0], y[0], reduction="none")
    assert torch.allclose(per_token, margins)
    long, short = (slice(0, 100), slice(100, 110))
    token_mean = float(windows.token_loss(logits, y))
    mean_of_means = (
        float(windows.token_loss(logits[:, long], y[:, long]))
        + float(windows.token_loss(logits[:, short], y[:, short]))
    ) / 2
    assert round(token_mean, 3) == 0.364 and abs(mean_of_means - 0.65) < 1e-12
    assert (
        ex.grade_window_token_loss(token_mean)
        and "mean of the micro-batch means" in ex.grade_window_token_loss(mean_of_means).message
    )


def test_checkers_accept_what_torch_computes_and_refuse_arrays_politely():
    import numpy as np
    import torch

    from gradaccum import clipping

    value = float(clipping.combine([torch.tensor([3.0, 0.0]), torch.tensor([-1.0, 0.0])], 1.0, "raw_micro").norm())
    assert 0 < value < 1e-6 and ex.grade_clip_raw_micro(value).correct  # the +1e-6 term of clip_grad_norm_
    assert not ex.grade_clip_raw_micro(1e-3).correct
    fb = ex.grade_clip_raw_micro(np.array([0.0, 0.0]))
    assert not fb.correct and "one number" in fb.message


@pytest.mark.parametrize(
    "wrong, phrase",
    [
        (0, "not positive"),
        (2.0**-24, "float16's smallest number"),
        (5.96e-8, "float16's smallest number"),
        (3e-9, "is not right"),
    ],
)
def test_smallest_positive_tiny_answers_get_true_feedback(wrong, phrase):
    """Answers far below the right one get the slip they come from, or a plain 'not right'."""
    fb = ex.grade_smallest_positive(wrong)
    assert not fb and phrase in fb.message


def test_float32_of_a_rounded_answer_near_the_half_unit_passes():
    """Found by hypothesis: 1 − (1 − m)^(1/7) at m = 0.0628068… is 0.00922374966…; rounded to five digits it is
    0.0092237, 4.97e-8 away (the half unit is 5e-8), and as float32 it moves 4e-10 further."""
    import numpy as np

    assert ex.grade_corrected_momentum(np.float32(0.0092237), m=0.06280683266861457, k=7)


def test_chapter_1_and_8_graders_refuse_impossible_exercises():
    """Found by review: k = 2, b = 0 was graded, a momentum of 0 or K = 2.5 accepted, fractions summing to 2
    graded, and a nested list answer raised TypeError."""
    import numpy as np

    from gradaccum import _validate

    for kwargs in (dict(k=2, b=0), dict(k=0, b=7), dict(k=2, b=1.5)):
        with pytest.raises(ValueError):
            ex.grade_negatives_per_sample(1, **kwargs)
    for kwargs in (dict(m=0.0), dict(k=2.5), dict(m=True)):
        with pytest.raises(ValueError):
            ex.grade_recompute_momentum(0.1, **kwargs)
    for kwargs in (dict(fractions=(1.0, 1.0)), dict(fractions=(1.5, -0.5)), dict(probs=(0.9, 0.9))):
        with pytest.raises(ValueError):
            ex.grade_switch_aux(1.0, **kwargs)
    feedback = ex.grade_batch_coupled([["BatchNorm2d"]])
    assert not feedback.correct and "flat set" in feedback.message
    assert _validate.require_momentum(np.float32(0.5)) == 0.5
    with pytest.raises(ValueError, match="cumulative average"):
        _validate.require_momentum(None)


def test_a_tie_at_the_asked_digits_names_both_roundings():
    """Review: 122.5 ms (exactly, at the book's parameters) was computed as 122.49999999999999, so 123 was accepted
    with "correct: 122"; an exact tie says that either rounding counts."""
    assert ex.expected_answer(ex.grade_nosync_saving) == (122.5, 3)
    for answer in (122, 122.5, 123):
        feedback = ex.grade_nosync_saving(answer)
        assert feedback.correct and "122 and 123 both count" in feedback.message
    assert not ex.grade_nosync_saving(121).correct
    assert "0.62 and 0.63" in ex.grade_number(0.63, 0.625, digits=2).message
    assert ex.grade_number(3.14, 3.14159).message == "correct: 3.14 (to 3 significant digits; exactly 3.14159)."


def test_a_fractional_count_is_told_so_before_a_near_slip():
    """Review of chapter 6: 125.5 for the warmup's end got the explanation of the slip 126; a count is whole."""
    assert "not a whole number" in ex.grade_warmup_end(125.5).message
    assert "first optimizer step that *uses*" in ex.grade_warmup_end(126).message


def test_graders_read_layer_names_with_their_module_and_refuse_a_dict():
    """grade_batch_coupled called "nn.BatchNorm2d" an unknown name and accepted a dict's keys as a set."""
    assert ex.grade_batch_coupled({"nn.BatchNorm2d"}) and ex.grade_batch_coupled(["torch.nn.BatchNorm2d"])
    assert not ex.grade_batch_coupled({"BatchNorm2d": 1})
    assert "LayerNorm" in ex.grade_batch_coupled({"nn.BatchNorm2d", "nn.LayerNorm"}).message
    fb = ex.grade_clip_raw_micro(2)
    assert not fb and "neither clipped nor averaged" in fb.message
