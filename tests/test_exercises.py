import pytest

from gradaccum import exercises as ex


@pytest.mark.parametrize(
    "checker, right",
    [
        (ex.check_effective_momentum, 1 - 0.9**8),
        (ex.check_effective_momentum, 0.570),  # the value the solution states
        (ex.check_corrected_momentum, 1 - 0.9 ** (1 / 8)),
        (ex.check_corrected_momentum, 0.013084),  # five significant digits, as asked
        (ex.check_biased_variance_ratio, 0.75),
        (ex.check_ghost_virtual_size, 4),
        (ex.check_exact_sweeps, 4),
        (ex.check_frozen_bias_change, 0.0),
        (ex.check_clip_scaled_micro, 2.0),
        (ex.check_clip_raw_micro, 0.0),
        (ex.check_scaler_clip_order, 1 / 65536),
        (ex.check_scaler_clip_order, 1.53e-5),
        (ex.check_effective_scale, 8192),
        (ex.check_fp16_subnormal, 5.96e-8),
        (ex.check_fp16_subnormal, 2**-24),
        (ex.check_backoff_scale, 32768),
        (ex.check_fp16_subnormal, 6.0e-8),  # two significant digits, as asked (0.66% off)
        (ex.check_backoff_steps, 0),
        (ex.check_allreduce_calls, 24),
        (ex.check_ring_bytes, 175),
        (ex.check_window_token_loss, 40 / 110),
        (ex.check_warmup_end, 125),
        (ex.check_partial_scale, 0.375),
        (ex.check_nosync_saving, 122.5),
    ],
)
def test_right_answers_pass(checker, right):
    fb = checker(right)
    assert fb and str(fb).startswith("✓")


@pytest.mark.parametrize(
    "checker, wrong, phrase",
    [
        (ex.check_effective_momentum, 0.1, "every forward pass"),
        (ex.check_effective_momentum, 0.8, "added the K momenta"),
        (ex.check_effective_momentum, 0.9**8, "old* running value"),
        (ex.check_effective_momentum, 0.43, "(1 − m)^K rounded"),  # the slip, rounded as a reader writes it
        (ex.check_effective_momentum, 0.0125, "correct* the drift"),
        (ex.check_corrected_momentum, 0.0125, "first-order"),
        (ex.check_corrected_momentum, 1 - 0.9**8, "invert it"),
        (ex.check_corrected_momentum, 0.9 ** (1 / 8), "keeps"),
        (ex.check_corrected_momentum, 0.1, "unchanged"),
        (ex.check_biased_variance_ratio, 1.0, "unbiased"),
        (ex.check_biased_variance_ratio, 4 / 3, "upside down"),
        (ex.check_biased_variance_ratio, 0.25, "batch *mean*"),
        (ex.check_ghost_virtual_size, 64, "whole batch"),
        (ex.check_ghost_virtual_size, 16, "*number* of ghost batches"),
        (ex.check_exact_sweeps, 1, "plain accumulation"),
        (ex.check_exact_sweeps, 3, "one more sweep"),
        (ex.check_exact_sweeps, 2, "full-batch *forward*"),
        (ex.check_exact_sweeps, 7, "statistics pass does not count"),
        (ex.check_frozen_bias_change, 0.5, "cancel"),
        (ex.check_frozen_bias_change, -0.5, "cancels exactly"),
        (ex.check_clip_scaled_micro, 1.0, "correct step"),
        (ex.check_clip_scaled_micro, 8.0, "not g_k"),
        (ex.check_clip_raw_micro, 1.0, "*before* averaging"),
        (ex.check_clip_raw_micro, 0.5, "not clipped"),
        (ex.check_scaler_clip_order, 1.0, "right order"),
        (ex.check_scaler_clip_order, 4.0, "does act"),
        (ex.check_scaler_clip_order, 65536.0, "divides by S"),
        (ex.check_effective_scale, 65536, "divided by K"),
        (ex.check_effective_scale, 65536 * 8, "not multiplied"),
        (ex.check_fp16_subnormal, 2**-14, "*normal*"),
        (ex.check_fp16_subnormal, 2**-10, "epsilon"),
        (ex.check_fp16_subnormal, 2**-25, "rounds to 0"),
        (ex.check_backoff_scale, 65536, "backoff"),
        (ex.check_backoff_scale, 65536 * 0.5**8, "once per window"),
        (ex.check_backoff_steps, 7, "steps per micro-batch"),
        (ex.check_backoff_steps, 1, "skips"),
        (ex.check_allreduce_calls, 8, "*bucket*"),
        (ex.check_allreduce_calls, 3, "with no_sync"),
        (ex.check_ring_bytes, 100, "reduce-scatter *and*"),
        (ex.check_ring_bytes, 87.5, "one of the two phases"),
        (ex.check_window_token_loss, 0.65, "mean of the micro-batch means"),
        (ex.check_warmup_end, 1000, "should end"),
        (ex.check_warmup_end, 8000, "*faster*"),
        (ex.check_partial_scale, 8 / 3, "upside down"),
        (ex.check_partial_scale, 0.625, "*missing*"),
        (ex.check_nosync_saving, 140, "K − 1"),
        (ex.check_nosync_saving, 17.5, "one all-reduce"),
        (ex.check_nosync_saving, 70, "2(p − 1)/p"),
        (ex.check_allreduce_calls, 22, "very first step"),     # 1 + 7 · 3: the first step's single bucket
        (ex.check_ring_bytes, 200, "almost 2n"),              # the large-p limit 2n, not 2(p − 1)/p · n
        (ex.check_nosync_saving, 0.1225, "in seconds"),       # 122.5 ms written in seconds
    ],
)
def test_typical_mistakes_are_explained(checker, wrong, phrase):
    fb = checker(wrong)
    assert not fb and str(fb).startswith("✗") and phrase in fb.message


def test_unrecognized_wrong_answer_gets_a_hint():
    fb = ex.check_effective_momentum(0.33)
    assert not fb and "Write the update K times" in fb.message


@pytest.mark.parametrize("answer, phrase", [(None, "no answer yet"), ("0.57", "expected a number"),
                                            (float("nan"), "not a finite"), (True, "expected a number")])
def test_non_answers(answer, phrase):
    fb = ex.check_effective_momentum(answer)
    assert not fb and phrase in fb.message


def test_numpy_and_torch_numbers_are_accepted():
    import numpy as np
    import torch

    assert ex.check_biased_variance_ratio(np.float64(0.75))
    assert ex.check_biased_variance_ratio(torch.tensor(0.75))


def test_other_parameters():
    assert ex.check_effective_momentum(1 - 0.99**4, m=0.01, k=4)
    assert ex.check_biased_variance_ratio(0.5, b=2)


def test_batch_coupled():
    assert ex.check_batch_coupled({"BatchNorm2d"})
    fb = ex.check_batch_coupled({"BatchNorm2d", "Dropout"})
    assert not fb and "does not couple them" in fb.message
    fb = ex.check_batch_coupled({"LayerNorm"})
    assert "per sample" in fb.message and "BatchNorm2d normalizes" in fb.message
    assert "unknown layer" in ex.check_batch_coupled({"BatchNorm"}).message
    assert "set of layer names" in ex.check_batch_coupled("BatchNorm2d").message
    assert "no answer yet" in ex.check_batch_coupled(None).message


def test_fp16_subnormal_solution_is_computed():
    """ex-ch4-subnormal: the checker's value is torch's smallest positive float16, and half of it rounds to 0."""
    import torch

    smallest = float(torch.tensor([1], dtype=torch.int16).view(torch.float16))  # bit pattern 0x0001
    assert smallest > 0 and float(torch.tensor(smallest / 2, dtype=torch.float16)) == 0
    assert ex.check_fp16_subnormal(smallest) and abs(smallest - 5.96e-8) < 0.005e-8


def test_window_token_exercise_solution():
    """ex-ch6-tokens: 100 tokens with summed loss 30 and 10 with summed loss 10 → token mean 40/110 ≈ 0.364;
    the mean of the micro-batch means is (0.3 + 1.0)/2 = 0.65."""
    import torch

    from gradaccum import silent

    logits = torch.zeros(1, 110, 2, dtype=torch.float64)  # per-token cross-entropy: log(1 + e^{-m}) with margin m
    margins = torch.cat([torch.full((100,), 0.3, dtype=torch.float64), torch.full((10,), 1.0, dtype=torch.float64)])
    logits[0, :, 0] = torch.log(torch.expm1(margins))  # softplus^-1: per-token loss = margin
    y = torch.ones(1, 110, dtype=torch.long)
    per_token = torch.nn.functional.cross_entropy(logits[0], y[0], reduction="none")
    assert torch.allclose(per_token, margins)
    long, short = (slice(0, 100), slice(100, 110))
    token_mean = float(silent.token_loss(logits, y))
    mean_of_means = (float(silent.token_loss(logits[:, long], y[:, long])) + float(silent.token_loss(logits[:, short], y[:, short]))) / 2
    assert round(token_mean, 3) == 0.364 and abs(mean_of_means - 0.65) < 1e-12
    assert ex.check_window_token_loss(token_mean) and "mean of the micro-batch means" in ex.check_window_token_loss(mean_of_means).message


def test_checkers_accept_what_torch_computes_and_refuse_arrays_politely():
    import numpy as np
    import torch

    from gradaccum import clipping

    value = float(clipping.combine([torch.tensor([3.0, 0.0]), torch.tensor([-1.0, 0.0])], 1.0, "raw_micro").norm())
    assert 0 < value < 1e-6 and ex.check_clip_raw_micro(value).correct  # the +1e-6 term of clip_grad_norm_
    assert not ex.check_clip_raw_micro(1e-3).correct
    fb = ex.check_clip_raw_micro(np.array([0.0, 0.0]))
    assert not fb.correct and "one number" in fb.message


@pytest.mark.parametrize("wrong, phrase", [(0, "not positive"), (1e-45, "2^-149"), (2.0**-149, "2^-149"),
                                           (1.18e-38, "smallest normal number"), (3e-9, "is not right")])
def test_fp16_subnormal_tiny_answers_get_true_feedback(wrong, phrase):
    """Answers far below 1e-12 must not all be read as 'float32's smallest normal number'."""
    fb = ex.check_fp16_subnormal(wrong)
    assert not fb and phrase in fb.message
