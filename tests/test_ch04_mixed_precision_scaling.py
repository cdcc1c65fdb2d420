import math

import pytest
import torch
from torch import nn

from gradaccum import precision
from gradaccum.accumulate import agreement
from gradaccum.book import ch04_mixed_precision_scaling as ch4
from gradaccum.book.models import make_cnn


@pytest.fixture(scope="module")
def f32(digits):
    model = make_cnn("group", dtype=torch.float32)
    return model, digits.x_train[:32].float(), digits.y_train[:32]


def test_format_info():
    f = precision.format_info(torch.float16)
    assert (f.max, f.smallest_normal, f.smallest_subnormal, f.eps, f.mantissa_bits) == (
        65504,
        2**-14,
        2**-24,
        2**-10,
        10,
    )
    b = precision.format_info(torch.bfloat16)
    assert b.mantissa_bits == 7 and b.smallest_subnormal == 2**-133
    with pytest.raises(ValueError):
        precision.format_info(torch.int32)


def test_cast_report_counts_exactly():
    v = torch.tensor([2.0**-30, 2.0**-20, 1.0, 1e6, 0.0])
    r = precision.cast_report(v, torch.float16)
    assert (r.underflow, r.subnormal, r.overflow) == (0.25, 0.25, 0.25)  # of the 4 nonzero values
    r = precision.cast_report(v, torch.float16, scale=2.0**10)
    assert (r.underflow, r.subnormal, r.overflow) == (0.0, 0.25, 0.25)
    assert precision.cast_report(v, torch.bfloat16).overflow == 0


@pytest.mark.parametrize("scale", [0, -1, float("inf"), float("nan"), True])
def test_bad_scale(scale):
    with pytest.raises(ValueError, match="loss scale"):
        precision.cast_report(torch.ones(2), torch.float16, scale)


def test_bad_dtypes_and_devices():
    with pytest.raises(ValueError, match="float16 or torch.bfloat16"):
        precision.cast_report(torch.ones(2), torch.float32)
    with pytest.raises(ValueError, match="float16 or torch.bfloat16"):
        precision._require_amp("cpu", torch.float64)
    with pytest.raises(ValueError, match="not available"):
        precision._require_amp("quantum", torch.float16)
    with pytest.raises(ValueError, match="nonzero"):
        precision.cast_report(torch.zeros(3), torch.float16)


def test_activation_gradients_scale_with_k(f32, loss_fn):
    model, x, y = f32
    a1 = precision.activation_gradients(model, loss_fn, x, y)
    a8 = precision.activation_gradients(model, loss_fn, x, y, k=8)
    assert torch.allclose(a8, a1 / 8, rtol=1e-5, atol=0) and a1.numel() > 1000
    assert all(p.grad is None for p in model.parameters())  # worked on a copy


def test_loss_grid_monotone(f32, loss_fn):
    model, x, y = f32
    grid = ch4.loss_grid(precision.activation_gradients(model, loss_fn, x, y), (0, 16, 24), (1, 64))
    assert grid["lost"][0, 1] >= grid["lost"][0, 0] and grid["overflow"][2, 1] <= grid["overflow"][2, 0]


def test_correct_recipe_matches_fp32(f32, loss_fn):
    model, x, y = f32
    ref = precision.reference_gradient(model, loss_fn, x, y)
    r = precision.amp_window(model, loss_fn, x, y, 4)
    assert r.steps == 1 and r.error is None and agreement(ref, r.update).rel_error < 5e-3
    assert r.scales == [2.0**16] * 4 and r.final_scale == 2.0**16


def test_overflow_skips_the_whole_step(f32, loss_fn):
    model, x, y = f32
    r = precision.amp_window(model, loss_fn, x, y, 4, overflow_micro=1)
    assert r.steps == 0 and r.update.abs().max() == 0 and r.final_scale == 2.0**15
    per_micro = precision.amp_window(model, loss_fn, x, y, 4, "step_per_micro", overflow_micro=1)
    assert per_micro.steps == 3


def test_wrong_patterns(f32, loss_fn):
    model, x, y = f32
    ref = precision.reference_gradient(model, loss_fn, x, y)
    assert "already been called" in precision.amp_window(model, loss_fn, x, y, 4, "unscale_per_micro").error
    moving = precision.amp_window(model, loss_fn, x, y, 4, "scale_changes_in_window")
    assert moving.scales == [2.0**16, 2.0**17, 2.0**18, 2.0**19]
    # .grad holds sum_k S_k g_k / K, unscaled by the final scale 2^20: weights 1/16, 1/8, 1/4, 1/2
    assert agreement(ref, moving.update).rel_error > 0.3
    nan = precision.amp_window(model, loss_fn, x, y, 4, "no_scaler", overflow_micro=0)
    assert not torch.isfinite(nan.update).all()
    with pytest.raises(ValueError, match="pattern"):
        precision.amp_window(model, loss_fn, x, y, 4, "sometimes")  # type: ignore[arg-type]


def test_bf16_window_without_scaler(f32, loss_fn):
    model, x, y = f32
    r = precision.amp_window(model, loss_fn, x, y, 2, "no_scaler", dtype=torch.bfloat16)
    assert agreement(precision.reference_gradient(model, loss_fn, x, y), r.update).cosine > 0.99


def test_accumulators():
    torch.manual_seed(0)
    grads = [torch.randn(1000, dtype=torch.float64) for _ in range(64)]
    assert precision.accumulation_error(grads, torch.float32) < 1e-6
    assert precision.accumulation_error(grads, torch.bfloat16) > 1e-3
    assert precision.accumulation_error(grads[:1], torch.bfloat16) == 0
    assert precision.accumulate_in(grads, torch.float32).dtype == torch.float32


def test_widget_function_errors_and_figure(f32, loss_fn):
    import matplotlib

    matplotlib.use("Agg")
    model, x, y = f32
    acts = precision.activation_gradients(model, loss_fn, x, y)
    assert tuple(ch4.plot_cast(acts, 16, 8).get_size_inches()) == (7.2, 3.4)
    with pytest.raises(ValueError, match="K"):
        ch4.plot_cast(acts, 16, 0)
    with pytest.raises(ValueError, match="log2"):
        ch4.plot_cast(acts, 99, 1)


def test_fp16_and_bf16_rounding_claims():
    as_ = lambda v, dt: float(torch.tensor(v, dtype=torch.float64).to(dt))  # noqa: E731
    assert as_(2**-25, torch.float16) == 0  # half the smallest subnormal is a tie: rounds to the even neighbour, 0
    assert as_(2**-25 * (1 + 2**-10), torch.float16) == 2**-24 and as_(1.5 * 2**-24, torch.float16) == 2**-23
    assert as_(1e-42, torch.float32) > 0 and as_(1e-42, torch.bfloat16) == 0  # fp32 keeps it, bf16 does not
    assert precision.format_info(torch.float32).smallest_subnormal == 2**-149


def test_divide_where(f32, loss_fn):
    model, x, y = f32
    at16 = precision.amp_window(model, loss_fn, x, y, 4)
    after = precision.amp_window(model, loss_fn, x, y, 4, divide="grads")
    assert after.steps == 1 and agreement(at16.update, after.update).rel_error < 1e-6  # no overflow: the same update
    edges = {d: precision.largest_safe_log2_scale(model, loss_fn, x, y, 4, divide=d) for d in ("loss", "grads")}
    assert edges["loss"] - edges["grads"] == 2  # log2 K
    s = edges["grads"] + 1
    assert precision.amp_window(model, loss_fn, x, y, 4, init_scale=2.0**s).steps == 1
    skipped = precision.amp_window(model, loss_fn, x, y, 4, init_scale=2.0**s, divide="grads")
    assert skipped.steps == 0 and skipped.final_scale == 2.0 ** (s - 1)
    with pytest.raises(ValueError, match="divide"):
        precision.amp_window(model, loss_fn, x, y, 4, divide="both")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not 'step_per_micro'"):
        precision.amp_window(model, loss_fn, x, y, 4, "step_per_micro", divide="grads")
    with pytest.raises(ValueError, match="raise hi"):
        precision.largest_safe_log2_scale(model, loss_fn, x, y, 4, hi=4)
    with pytest.raises(ValueError, match="lower lo"):
        precision.largest_safe_log2_scale(model, loss_fn, x, y, 4, lo=30, hi=40)


def test_scale_history_growth_and_backoff():
    assert precision.scale_history(7, 3, overflow_at=(4,)) == [
        2.0**16,
        2.0**16,
        2.0**17,
        2.0**17,
        2.0**16,
        2.0**16,
        2.0**16,
    ]
    assert precision.scale_history(4, 2000) == [2.0**16] * 4  # the default interval: no growth in a few steps
    with pytest.raises(ValueError, match="growth_interval"):
        precision.scale_history(3, 0)
    with pytest.raises(ValueError, match="overflow_at"):
        precision.scale_history(3, 2, overflow_at=(5,))


def test_unscale_divides_by_the_scale_at_the_boundary(f32, loss_fn, digits):
    from gradaccum.clipping import micro_gradients

    model, x, y = f32
    moved = precision.amp_window(model, loss_fn, x, y, 4, "scale_changes_in_window")
    assert moved.final_scale == 2.0**20
    micro = micro_gradients(make_cnn("group"), loss_fn, digits.x_train[:32], digits.y_train[:32], 4)
    applied = moved.update.double()
    assert agreement(precision.mixed_scale_sum(micro, moved.scales, moved.final_scale), applied).rel_error < 5e-3
    assert agreement(precision.mixed_scale_sum(micro, moved.scales, moved.scales[-1]), applied).rel_error > 0.4
    with pytest.raises(ValueError, match="one scale per"):
        precision.mixed_scale_sum(micro, moved.scales[:3], 1.0)


def test_backoff_exercise_solution(digits, loss_fn):
    """ex-ch4-backoff: K = 8, micro-batch 5 overflows, S = 65536 → no step and S = 32768; per micro-batch: 7 steps."""
    from gradaccum.book import exercises as ex

    model = make_cnn("group", dtype=torch.float32)
    x, y = digits.x_train[:32].float(), digits.y_train[:32]
    right = precision.amp_window(model, loss_fn, x, y, 8, overflow_micro=4)
    assert right.steps == 0 and right.final_scale == 32768
    assert precision.amp_window(model, loss_fn, x, y, 8, "step_per_micro", overflow_micro=4).steps == 7
    # the grader's mistake: unscale_ + update() per micro-batch backs off K − 5 + 2 = 5 times (8192 → 256)
    repeated = precision.amp_window(
        model, loss_fn, x, y, 8, "unscale_update_per_micro", init_scale=8192.0, overflow_micro=4
    )
    assert repeated.final_scale == 8192 * 0.5**5 == 256
    wrong = ex.grade_backoff_scale(256.0)
    assert not wrong.correct and "after every micro-batch" in wrong.message
    assert ex.grade_backoff_scale(4096.0).correct
    for kwargs in (dict(k=4, overflowed=5), dict(overflowed=0), dict(k=0)):
        with pytest.raises(ValueError):
            ex.grade_backoff_scale(1.0, **kwargs)


def test_bf16_accumulator_exercise_solution(digits, loss_fn):
    """ex-ch4-bf16-where: at K = 64 (micro-batches of 4) a bf16 running sum adds close to 1% relative error."""
    from gradaccum.clipping import micro_gradients

    grads = micro_gradients(make_cnn("group"), loss_fn, digits.x_train[:256], digits.y_train[:256], 64)
    assert abs(precision.accumulation_error(grads, torch.bfloat16) - 0.009) < 0.002
    assert precision.accumulation_error(grads, torch.float32) < 1e-6


def test_float64_model_is_refused(digits, loss_fn):
    """autocast leaves float64 alone: an fp16 'recipe' on a float64 model would silently run in float64."""
    model = make_cnn("group")  # float64, make_cnn's default
    x, y = digits.x_train[:16], digits.y_train[:16]
    with pytest.raises(ValueError, match="must be float32"):
        precision.amp_window(model, loss_fn, x, y, 2)
    with pytest.raises(ValueError, match="must be float32"):
        precision.largest_safe_log2_scale(model, loss_fn, x, y, 2)


def _mlp(inplace: bool) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(inplace=inplace), nn.Linear(32, 10)).double()


def test_activation_gradients_exact_with_inplace_relu(digits, loss_fn):
    x, y = digits.x_train[:16], digits.y_train[:16]
    plain = precision.activation_gradients(_mlp(False), loss_fn, x, y)
    inplace = precision.activation_gradients(_mlp(True), loss_fn, x, y)
    assert plain.numel() == 16 * (32 + 32 + 10) and torch.equal(plain, inplace)
    # the Linear slot holds dL/dz (pre-ReLU), which differs from the ReLU slot where z < 0
    assert not torch.equal(plain[: 16 * 32], plain[16 * 32 : 2 * 16 * 32])


class _Tuple(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.inner = nn.GRU(8, 8, batch_first=True) if kind == "gru" else nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = x.reshape(-1, 8, 8)
        out = self.inner(z)[0] if isinstance(self.inner, nn.GRU) else self.inner(z, z, z)[0]
        return self.head(out[:, -1])


@pytest.mark.parametrize("kind, name", [("gru", "GRU"), ("mha", "MultiheadAttention")])
def test_activation_gradients_refuse_tuple_outputs(digits, loss_fn, kind, name):
    with pytest.raises(ValueError, match=f"'inner' \\({name}\\) returns tuple"):
        precision.activation_gradients(_Tuple(kind).double(), loss_fn, digits.x_train[:4], digits.y_train[:4])


def test_unscale_and_update_per_micro_raise_nothing_but_are_wrong(f32, loss_fn):
    model, x, y = f32
    ref = precision.reference_gradient(model, loss_fn, x, y)
    clean = precision.amp_window(model, loss_fn, x, y, 4, "unscale_update_per_micro")
    assert clean.error is None and clean.steps == 1 and agreement(ref, clean.update).rel_error > 0.99
    over = precision.amp_window(model, loss_fn, x, y, 4, "unscale_update_per_micro", overflow_micro=1)
    assert over.error is None and over.steps == 0
    assert over.scales == [2.0**16, 2.0**16, 2.0**15, 2.0**14] and over.final_scale == 2.0**12


def test_only_s_over_k_reaches_the_backward_pass(f32, loss_fn):
    """The identity behind 'where the 1/K goes': loss / 4 at S = 2^15 is bitwise loss at S = 2^13."""
    model, x, y = f32
    a = precision.scaled_window_grads(model, loss_fn, x, y, 4, 2.0**15, "loss")
    b = precision.scaled_window_grads(model, loss_fn, x, y, 4, 2.0**13, "grads")
    assert torch.equal(a, b) and torch.isfinite(a).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_largest_fitting_log2_is_the_overflow_edge(dtype):
    """Review: the edge of a window is set by the largest gradient an fp16 kernel writes; the helper that predicts
    it must agree with a real cast at the boundary (2^e · max finite, 2^(e+1) · max inf)."""
    gen = torch.Generator().manual_seed(0)
    top = 65520.0 if dtype == torch.float16 else None
    for _ in range(200):
        v = torch.randn(50, generator=gen, dtype=torch.float64) * 10.0 ** float(
            torch.empty(1).uniform_(-8, 8, generator=gen)
        )
        e = precision.largest_fitting_log2(v, dtype)
        m = v.abs().max()
        assert torch.isfinite((m * 2.0**e).to(dtype)) and torch.isinf((m * 2.0 ** (e + 1)).to(dtype)), (e, m)
    if top is not None:
        assert precision.largest_fitting_log2(torch.tensor([top]), dtype) == -1
        assert precision.largest_fitting_log2(torch.tensor([top - 1e-3], dtype=torch.float64), dtype) == 0
    for bad in (torch.zeros(3), torch.tensor([float("nan")]), torch.empty(0)):
        with pytest.raises(ValueError, match="nonzero"):
            precision.largest_fitting_log2(bad, dtype)
    with pytest.raises(ValueError, match="float16 or torch.bfloat16"):
        precision.largest_fitting_log2(torch.ones(1), torch.float32)


def test_exact_answers_are_checked_exactly():
    """Review: 2050 and 4100 were accepted as 2048 and 4096, which the exercises do not ask to round."""
    from gradaccum.book import exercises as ex

    assert ex.grade_effective_scale(2048) and ex.grade_backoff_scale(4096.0)
    for grader, near in ((ex.grade_effective_scale, 2050), (ex.grade_backoff_scale, 4100)):
        fb = grader(near)
        assert not fb and "agrees with the answer to 3 significant digits" in fb.message
    assert not ex.grade_effective_scale(2045)


def test_kernel_gradients_leave_out_fp32_normalization_parameters(digits, loss_fn):
    """Review: the overflow edge was predicted from every parameter gradient, but autocast gives a normalization
    layer's own parameters fp32 gradients; with a tiny GroupNorm scale its weight gradient was the largest and the
    prediction 3 binades low. Only the linear and convolution layers' gradients are written in fp16."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.GroupNorm(4, 32), nn.Linear(32, 10))
    with torch.no_grad():
        model[2].weight.fill_(0.01)
        model[3].weight.mul_(30)
    x, y = digits.x_train[:32].float(), digits.y_train[:32]
    grads = precision.kernel_gradients(model, loss_fn, x, y, 4)
    kernels = sum(p.numel() for m in (model[1], model[3]) for p in m.parameters())
    assert grads.numel() == 4 * kernels
    per_micro = [
        torch.autograd.grad(loss_fn(model(xb), yb), model[2].weight)[0] for xb, yb in zip(x.chunk(4), y.chunk(4))
    ]
    assert max(float(g.abs().max()) for g in per_micro) > float(grads.abs().max())  # GroupNorm's is the largest
    predicted = min(
        precision.largest_fitting_log2(grads),
        precision.largest_fitting_log2(
            torch.cat(
                [precision.activation_gradients(model, loss_fn, xb, yb) for xb, yb in zip(x.chunk(4), y.chunk(4))]
            )
        ),
    )
    measured = precision.largest_safe_log2_scale(model, loss_fn, x, y, 4) - 2
    assert predicted == measured
    with pytest.raises(ValueError, match="no linear or convolution"):
        precision.kernel_gradients(nn.Sequential(nn.GroupNorm(1, 4)), loss_fn, torch.ones(4, 4, 2), y[:4], 2)


def test_amp_tools_and_graders_refuse_what_they_cannot_do(digits):
    """Found by review: a model's own crash (a loss given wrong shapes) came back as the pattern's 'error',
    overflow_micro outside the window and lr = 0 were accepted, the smallest-positive grader expected 2^-18 for
    float8_e5m2fnuz (whose finfo eps is not its format's), and the graders took impossible parameters."""
    from gradaccum.book import exercises

    model = make_cnn("group", dtype=torch.float32)
    x, y = digits.x_train[:16].float(), digits.y_train[:16]
    wrong_shape = lambda out, target: nn.functional.mse_loss(out, out[:, :3])  # noqa: E731
    with pytest.raises(RuntimeError):  # the model's or loss's own error propagates
        precision.amp_window(model, wrong_shape, x, y, 4, "correct")
    for kwargs, message in (
        (dict(overflow_micro=4), "overflow_micro"),
        (dict(overflow_micro=True), "overflow_micro"),
        (dict(lr=0.0), "lr"),
        (dict(lr=float("nan")), "lr"),
    ):
        with pytest.raises(ValueError, match=message):
            precision.amp_window(model, nn.CrossEntropyLoss(), x, y, 4, "correct", **kwargs)
    assert precision.amp_window(model, nn.CrossEntropyLoss(), x, y, 4, "unscale_per_micro").error.startswith(
        "RuntimeError: unscale_() has already been called"
    )
    for dtype in ("float8_e5m2fnuz", torch.float16):
        with pytest.raises(ValueError):
            exercises.grade_smallest_positive(1e-5, dtype=dtype)
    for fmt in (torch.float8_e5m2fnuz, torch.float8_e8m0fnu):  # the message names the formats that work
        with pytest.raises(ValueError, match="use float16"):
            precision.format_info(fmt)
    for grader, kwargs in (
        (exercises.grade_effective_scale, dict(k=0)),
        (exercises.grade_effective_scale, dict(scale=-1.0)),
        (exercises.grade_backoff_scale, dict(backoff=2.0)),
        (exercises.grade_backoff_scale, dict(scale=0.0)),
        (exercises.grade_backoff_steps, dict(k=2.5)),
    ):
        with pytest.raises(ValueError):
            grader(1.0, **kwargs)


def test_precision_tools_refuse_what_has_no_answer():
    """Found by review: cast_report counted an inf or NaN as neither lost nor overflowed, largest_fitting_log2
    raised OverflowError for a subnormal maximum, accumulation_error returned NaN for a zero sum and took an integer
    accumulator, scale_history(-2) returned [] and mixed_scale_sum broadcast micro-gradients of different shapes."""
    with pytest.raises(ValueError, match="inf or NaN"):
        precision.cast_report(torch.tensor([1.0, float("inf")]), torch.float16)
    with pytest.raises(ValueError, match="inf or NaN"):
        precision.cast_report(torch.tensor([1.0, float("nan")]), torch.bfloat16)
    tiny = torch.tensor([1e-320], dtype=torch.float64)  # a float64 subnormal
    e = precision.largest_fitting_log2(tiny)
    assert math.ldexp(1e-320, e) < 65520 <= math.ldexp(1e-320, e + 1)
    assert torch.isfinite(torch.tensor(math.ldexp(1e-320, e)).to(torch.float16))
    assert torch.isinf(torch.tensor(math.ldexp(1e-320, e + 1)).to(torch.float16))
    with pytest.raises(ValueError, match="zero"):
        precision.accumulation_error([torch.ones(3), -torch.ones(3)], torch.float32)
    with pytest.raises(ValueError, match="floating-point dtype"):
        precision.accumulation_error([torch.ones(3)] * 2, torch.int32)
    with pytest.raises(ValueError, match="updates"):
        precision.scale_history(-2, 3)
    with pytest.raises(ValueError, match="overflow_at"):
        precision.scale_history(3, 3, overflow_at=(1.5,))
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        precision.mixed_scale_sum([torch.ones(3), torch.ones(2)], [1.0, 1.0], 1.0)


def test_kernel_gradients_read_layernorm_in_fp16_and_refuse_parameters_outside_kernels():
    """Second review: on the CPU, nn.LayerNorm's weight gradient is computed in fp16 from an fp16 input (inf where
    GroupNorm's stays finite), so kernel_gradients now reads it there; a parameter outside linear, convolution and
    normalization modules (MultiheadAttention's in_proj_weight) makes kernel_gradients refuse."""
    ln, gn = nn.LayerNorm([4, 8, 8]), nn.GroupNorm(2, 4)
    for layer, finite in ((ln, False), (gn, True)):
        with torch.autocast("cpu", dtype=torch.float16):
            out = layer(torch.randn(2, 4, 8, 8).half())
        out.backward((60000 * torch.sign(out.detach().float())).half())
        assert bool(torch.isfinite(layer.weight.grad).all()) == finite
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    with_ln = nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 3))
    assert precision.kernel_gradients(with_ln, nn.CrossEntropyLoss(), x, y, 2).numel() == 2 * (35 + 10 + 18)

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn, self.out = nn.MultiheadAttention(6, 2, batch_first=True), nn.Linear(6, 3)

        def forward(self, x):
            return self.out(self.attn(x[:, None], x[:, None], x[:, None])[0][:, 0])

    with pytest.raises(ValueError, match="in_proj_weight"):
        precision.kernel_gradients(Attention(), nn.CrossEntropyLoss(), x, y, 2)


def test_scales_exponents_and_inputs_out_of_range_are_refused(loss_fn):
    """Second review: scales outside float32's normal range gave NaN/inf updates or a RuntimeError, a model without
    parameters StopIteration, a float64 input a dtype RuntimeError, hi=2000 an OverflowError, a list
    AttributeError, overflow_at=1 TypeError; NumPy numbers are numbers."""
    import numpy as np

    from gradaccum.book import exercises as ex

    model = make_cnn("group", dtype=torch.float32)
    x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,))
    for scale in (2.0**-130, 1e-46, 1e39):
        with pytest.raises(ValueError, match="normal range"):
            precision.amp_window(model, loss_fn, x, y, 2, init_scale=scale)
    with pytest.raises(ValueError, match="normal range"):
        precision.scale_history(3, 1, init_scale=1e-46)
    with pytest.raises(ValueError, match="no trainable parameters"):
        precision.amp_window(nn.Sequential(nn.Flatten()), loss_fn, x, y, 2)
    with pytest.raises(ValueError, match="x.float"):
        precision.amp_window(model, loss_fn, x.double(), y, 2)
    with pytest.raises(ValueError, match="exponent"):
        precision.largest_safe_log2_scale(model, loss_fn, x, y, 2, hi=2000)
    with pytest.raises(ValueError, match="tensor"):
        precision.largest_fitting_log2([1.0, 2.0])
    with pytest.raises(ValueError, match="list of iterations"):
        precision.scale_history(3, 1, overflow_at=1)
    assert precision.scale_history(3, 1, overflow_at=(np.int64(1),)) == [2.0**17, 2.0**16, 2.0**17]
    assert precision.cast_report(torch.tensor([1.0]), torch.float16, np.float32(2.0)).overflow == 0
    assert ex.grade_effective_scale(2048, scale=np.float32(65536), k=32).correct
    assert (
        "exponent" in ex.grade_effective_scale(11).message
        and "upside down" in ex.grade_effective_scale(1 / 2048).message
    )
    assert "window's own update()" in ex.grade_backoff_scale(512).message


def test_amp_window_update_is_exact_at_any_learning_rate_and_overflows_are_refused(loss_fn):
    """Second review: amp_window read the update back from the fp32 weights, so at lr = 1e-9 no weight moved and
    it reported 0 steps and a zero update; accumulation_error gave NaN when the inputs overflow the format they
    are produced in, and mixed_scale_sum inf for scales no GradScaler holds together."""
    model = make_cnn("group", dtype=torch.float32)
    x, y = torch.rand(32, 1, 8, 8), torch.randint(0, 10, (32,))
    ref = precision.reference_gradient(model, loss_fn, x, y)
    errors = []
    for lr in (0.1, 1e-9):
        window = precision.amp_window(model, loss_fn, x, y, 2, lr=lr)
        assert window.steps == 1
        errors.append(agreement(ref, window.update).rel_error)
    assert errors[0] == errors[1] < 1e-2
    with pytest.raises(ValueError, match="overflows torch.float16"):
        precision.accumulation_error([torch.tensor([2e5, 1.0])] * 2, torch.float32, produced_in=torch.float16)
    with pytest.raises(ValueError, match="overflows"):
        precision.mixed_scale_sum([torch.ones(2)], [2.0**38], 2.0**-100)


def test_widget_and_study_helpers_name_the_argument_at_fault(digits, loss_fn):
    """Second review: plot_cast with shift=200 or nan said the values had "overflowed already", and recipe_errors
    with a start past the data said "the reference gradient is zero"; each now names its own argument."""
    acts = torch.randn(100) * 1e-3
    for shift in (200, float("nan")):
        with pytest.raises(ValueError, match="shift"):
            ch4.plot_cast(acts, 0, 1, shift=shift)
    with pytest.raises(ValueError, match="start 5000"):
        ch4.recipe_errors(digits, loss_fn, seeds=(0,), starts=(5000,))


def test_amp_window_records_scales_in_float32_and_cast_report_refuses_complex():
    """amp_window recorded the first micro-batch's scale as the Python float it was given and the others in
    float32; cast_report dropped a complex tensor's imaginary part with a warning only."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    r = precision.amp_window(model, nn.CrossEntropyLoss(), x, y, 4, init_scale=1e-3)
    assert len(set(r.scales)) == 1 and r.scales[0] == float(torch.tensor(1e-3, dtype=torch.float32))
    with pytest.raises(ValueError, match="complex"):
        precision.cast_report(torch.tensor([1 + 2j, 3 + 0j]), torch.float16)


# ------------------------------------------------------------------ the edge prediction, refusals and the model's mode


@pytest.mark.slow
def test_the_edge_prediction_is_exact_for_groupnorm_and_an_upper_bound_for_batchnorm(digits):
    """Review: on the CPU an fp16 convolution sums its weight gradient in fp16, so with BatchNorm (whose backward
    brings large terms of opposite sign together) a partial sum overflows where the total fits; the prediction is
    then one power of two above the measured edge, never below. With GroupNorm it is exact in every run.
    PyTorch's own kernel (oneDNN off) sums in fp16 on every CPU; oneDNN's fp16 path, where the processor has one
    (AVX512-FP16, AMX), may sum in fp32, and then the prediction can be exact in every run: never below, either way."""
    assert ch4.edge_prediction_gaps(digits, "group", seeds=range(4)) == [0] * 12
    with torch.backends.mkldnn.flags(enabled=False, allow_tf32=None):
        gaps = ch4.edge_prediction_gaps(digits, "batch", seeds=range(4))
    assert set(gaps) <= {0, 1} and gaps.count(1) >= 4
    assert set(ch4.edge_prediction_gaps(digits, "batch", seeds=range(2))) <= {0, 1}
    with pytest.raises(ValueError, match="power of two"):
        ch4.edge_prediction_gaps(digits, "group", seeds=[0], k=3)


def test_precision_tools_refuse_unknown_options_formats_and_impossible_inputs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))
    x, y = torch.randn(16, 1, 8, 8), torch.randint(0, 10, (16,))
    loss_fn = nn.CrossEntropyLoss()
    with pytest.raises(ValueError, match="divide must be"):
        precision.scaled_window_grads(model, loss_fn, x, y, 4, 2.0**10, divide="Loss")
    with pytest.raises(ValueError, match="float16"):
        precision.amp_window(model, loss_fn, x, y, 4, dtype=torch.bfloat16, overflow_micro=2)
    with pytest.raises(ValueError, match="needs no loss scale"):
        precision.largest_safe_log2_scale(model, loss_fn, x, y, 4, dtype=torch.bfloat16, hi=127)
    with pytest.raises(ValueError, match="complex"):
        precision.largest_fitting_log2(torch.tensor([1 + 1j]))
    with pytest.raises(ValueError, match="model's precision"):
        precision.kernel_gradients(model, loss_fn, x.double(), y, 4)
    with pytest.raises(ValueError, match="overflows"):
        grads = [torch.tensor([v, 1.0]) for v in (2e5, 2e5, -2e5, -2e5)]  # terms ±50000: a partial sum of 1e5 overflows
        precision.accumulation_error(grads, torch.float16, torch.float32)
    with pytest.raises(ValueError, match="float8_e5m2fnuz"):
        precision.format_info(torch.float8_e5m2fnuz)


def test_every_tool_runs_the_model_in_the_mode_it_is_in():
    """Review: amp_window and scaled_window_grads switched a copy to train mode while reference_gradient kept the
    caller's, so an eval-mode model with dropout compared at relative error 0.70."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 10)).eval()
    x, y = torch.randn(32, 1, 8, 8), torch.randint(0, 10, (32,))
    loss_fn = nn.CrossEntropyLoss()
    ref = precision.reference_gradient(model, loss_fn, x, y)
    window = precision.amp_window(model, loss_fn, x, y, k=4)
    assert agreement(ref, window.update).rel_error < 0.02
    grads = precision.scaled_window_grads(model, loss_fn, x, y, 4, 2.0**10) / 2.0**10
    assert agreement(ref, grads).rel_error < 0.02


def test_a_layer_run_twice_and_an_overflow_that_does_not_happen_are_refused():
    """A shared layer's two fp16 weight gradients are added in fp16 (a part can overflow where the total fits: the
    prediction was up to 5 powers of two too high), and an input normalization removes overflow_micro's 10^6."""
    from gradaccum import precision

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.head = nn.Linear(8, 8), nn.Linear(8, 3)

        def forward(self, x):
            return self.head(self.lin(x) - 0.9 * self.lin(x))

    torch.manual_seed(0)
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    with pytest.raises(ValueError, match="more than once"):
        precision.kernel_gradients(Twice(), nn.CrossEntropyLoss(), x, y, 4)
    normed = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 3))
    with pytest.raises(ValueError, match="did not overflow fp16"):
        precision.amp_window(normed, nn.CrossEntropyLoss(), x, y, k=4, overflow_micro=1)


# ------------------------------------------------------------------------------------- FSDP2 on two processes


@pytest.fixture(scope="module")
def fsdp2():
    return ch4.fsdp2_ranks(k=4)


@pytest.mark.slow
def test_fsdp2_keeps_the_unsharded_window_sum_in_reduce_dtype(fsdp2):
    """Gradient sync off: the whole parameter's gradient waits on every rank, summed in reduce_dtype when set
    (FSDPParam.unsharded_accumulated_grad), else in param_dtype (the unsharded parameter's .grad); sync on every
    micro-batch leaves only the fp32 shard."""
    held = fsdp2[0].held
    off = "last micro-batch only"
    both = held[off, "param_dtype=bf16, reduce_dtype=fp32"]
    assert (both.holder, both.dtype) == ("FSDPParam.unsharded_accumulated_grad", "float32")
    assert both.bytes == 2 * both.shard_bytes  # the whole parameter, on each of the 2 ranks
    low = held[off, "param_dtype=bf16, reduce_dtype unset"]
    assert (low.holder, low.dtype) == ("the unsharded parameter's .grad", "bfloat16")
    assert low.bytes == low.shard_bytes  # half the bytes of fp32, twice the elements of a shard
    assert held[off, "no policy (fp32)"].dtype == "float32"
    synced = held["every micro-batch", "param_dtype=bf16, reduce_dtype=fp32"]
    assert synced.holder == "the sharded .grad" and synced.bytes == synced.shard_bytes


@pytest.mark.slow
def test_fsdp2_bf16_sum_adds_error_an_fp32_sum_does_not(fsdp2):
    errors = fsdp2[0].errors
    fp32, bf16 = errors["param_dtype=bf16, reduce_dtype=fp32"], errors["param_dtype=bf16, reduce_dtype unset"]
    assert fp32 < 1e-6 and bf16 > 1e-4 and bf16 > 100 * fp32


@pytest.mark.slow
def test_fsdp2_fp16_sum_overflows_where_each_backward_fits(fsdp2):
    fits, sums = fsdp2[0].headroom["fp32"], fsdp2[0].headroom["unset"]
    assert fits.shard_finite and fits.found_inf == 0 and fits.stepped and fits.scale_after == 2.0**16
    assert not sums.shard_finite and sums.found_inf >= 1 and not sums.stepped and sums.scale_after == 2.0**15


@pytest.mark.slow
def test_grad_scaler_skips_on_every_rank_when_one_ranks_shard_overflows(fsdp2):
    runs = [r.one_rank_overflow for r in fsdp2]
    assert [r.shard_finite for r in runs] == [True, False]  # the inf sits in rank 1's shard only
    assert all(r.found_inf >= 1 and not r.stepped and r.scale_after == 2.0**15 for r in runs)


def test_fsdp2_table_and_lines_say_what_was_held_and_done():
    from gradaccum.book.ch04_fsdp import Fsdp2Rank, Held, ScalerRun

    rank = Fsdp2Rank(8)
    rank.held["last micro-batch only", "p"] = Held("somewhere", "float32", 200, 100)
    rank.errors = {"param_dtype=bf16, reduce_dtype=fp32": 2e-9, "param_dtype=bf16, reduce_dtype unset": 0.004}
    rank.headroom = {"fp32": ScalerRun(True, 0.0, True, 2.0**16), "unset": ScalerRun(False, 1.0, False, 2.0**15)}
    rank.one_rank_overflow = ScalerRun(True, 1.0, False, 2.0**15)
    assert "2×" in repr(ch4.fsdp2_table(rank)) and "somewhere" in repr(ch4.fsdp2_table(rank))
    lines = ch4.fsdp2_lines([rank, rank])
    assert "K = 8" in lines[0] and "4e-03" in lines[0]
    assert "stepped, S = 2^16" in lines[1] and "overflows, step skipped, S = 2^15" in lines[1]
    assert lines[2].count("inf found, step skipped, S = 2^15") == 2
