import copy
import math

import pytest
import torch
from torch import nn

from gradaccum import clipping
from gradaccum.accumulate import agreement, flat_grad, full_batch_gradient
from gradaccum.book import ch03_clip_ordering as ch3
from gradaccum.book.models import make_cnn


@pytest.fixture(scope="module")
def setup_batch(digits):
    model = make_cnn("group").train()
    return model, digits.x_train[:32], digits.y_train[:32]


def test_clip_vector_matches_torch():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(10, dtype=torch.float64))
    p.grad = torch.randn(10, dtype=torch.float64) * 5
    expected = clipping.clip_vector(p.grad.clone(), 1.0)
    torch.nn.utils.clip_grad_norm_([p], 1.0)
    assert torch.allclose(p.grad, expected, atol=1e-15)
    short = torch.tensor([0.1, 0.2], dtype=torch.float64)
    assert torch.equal(clipping.clip_vector(short, 1.0), short)  # never lengthens
    assert torch.equal(clipping.clip_vector(torch.tensor([3.0, -5.0]), 2.0, "value"), torch.tensor([2.0, -2.0]))


@pytest.mark.parametrize("placement", clipping.PLACEMENTS)
@pytest.mark.parametrize("mode", ["norm", "value"])
def test_loop_computes_the_math(placement, mode, setup_batch, loss_fn):
    model, x, y = setup_batch
    c = 0.2 if mode == "norm" else 0.01
    work = copy.deepcopy(model)
    work.zero_grad(set_to_none=True)
    clipping.clipped_accumulation(work, loss_fn, x, y, 4, c, placement, mode)
    expected = clipping.combine(clipping.micro_gradients(model, loss_fn, x, y, 4), c, placement, mode)
    assert torch.allclose(flat_grad(work), expected, atol=1e-14)


@pytest.mark.parametrize("k", [1, 2, 8])
def test_clip_once_equals_clipping_the_full_batch(k, setup_batch, loss_fn):
    model, x, y = setup_batch
    full = clipping.clip_vector(full_batch_gradient(model, loss_fn, x, y), 0.2)
    once = clipping.combine(clipping.micro_gradients(model, loss_fn, x, y, k), 0.2, "once")
    assert agreement(full, once).rel_error < 1e-12


def test_worked_examples():
    g = torch.tensor([2.0, 0.0], dtype=torch.float64)
    assert float(clipping.combine([g] * 4, 1.0, "scaled_micro").norm()) == pytest.approx(2.0)
    assert float(clipping.combine([g] * 4, 1.0, "once").norm()) == pytest.approx(1.0, abs=1e-6)
    a2 = clipping.combine([torch.tensor([3.0, 0.0]), torch.tensor([-1.0, 0.0])], 1.0, "raw_micro")
    assert float(a2.norm()) == pytest.approx(0.0, abs=1e-6)
    b = clipping.combine([torch.tensor([2.0, 0.0]), torch.tensor([0.0, 2.0])], 1.0, "running")
    # with K = 2 the contributions are g/2: (1, 0) is not clipped, then (1, 1) is clipped to (1, 1)/√2
    assert torch.allclose(b, torch.tensor([1.0, 1.0]) / math.sqrt(2), atol=1e-6)


def test_bounds_from_the_triangle_inequality():
    for seed in range(5):
        grads = ch3.synthetic_micro_gradients(8, 0.3, norm=3.0, seed=seed)
        assert clipping.combine(grads, 1.0, "raw_micro").norm() <= 1 + 1e-9
        assert clipping.combine(grads, 1.0, "scaled_micro").norm() <= 8 + 1e-9
        assert clipping.combine(grads, 1.0, "once").norm() <= 1 + 1e-9


def test_running_weights_reconstruct_the_step():
    grads = ch3.synthetic_micro_gradients(6, 0.5, norm=2.0, seed=1)
    w = clipping.running_clip_weights(grads, 0.5)
    assert torch.allclose(sum(wi * g for wi, g in zip(w, grads)), clipping.combine(grads, 0.5, "running"), atol=1e-9)
    assert all(a <= b for a, b in zip(w, w[1:]))


def test_synthetic_alignment():
    assert clipping.mean_pairwise_cosine(ch3.synthetic_micro_gradients(6, 1.0)) == pytest.approx(1.0)
    assert abs(clipping.mean_pairwise_cosine(ch3.synthetic_micro_gradients(6, 0.5, dim=4096))) - 0.5 < 0.05
    assert clipping.mean_pairwise_cosine([torch.ones(3)]) == 1.0


def test_scaler_order(setup_batch, loss_fn):
    model, x, y = setup_batch
    right = clipping.clip_with_scaler(model, loss_fn, x, y, 2, 0.1)
    wrong = clipping.clip_with_scaler(model, loss_fn, x, y, 2, 0.1, unscale_first=False)
    assert float(right.norm()) == pytest.approx(0.1, abs=1e-6)
    assert float(wrong.norm()) == pytest.approx(0.1 / 2**16, rel=1e-4)


@pytest.mark.parametrize("c", [0, -1.0, float("inf"), float("nan"), True])
def test_bad_threshold(c):
    with pytest.raises(ValueError, match="threshold"):
        clipping.combine([torch.ones(2)], c, "once")


def test_bad_placement_mode_k_and_alignment():
    with pytest.raises(ValueError, match="placement"):
        clipping.combine([torch.ones(2)], 1.0, "sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mode"):
        clipping.clip_vector(torch.ones(2), 1.0, "both")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="K"):
        clipping.combine([], 1.0, "once")
    with pytest.raises(ValueError, match="alignment"):
        ch3.synthetic_micro_gradients(2, 1.5)


def test_non_finite_gradients_name_the_parameter(setup_batch, loss_fn):
    model, x, y = setup_batch
    work = copy.deepcopy(model)
    bad_loss = lambda out, target: loss_fn(out, target) * float("inf")  # noqa: E731
    with pytest.raises(ValueError, match=r"parameter 'features\.0\.weight' contains (inf|NaN)"):
        clipping.clipped_accumulation(work, bad_loss, x, y, 2, 1.0, "once")


def test_train_placements_small(digits):
    runs = ch3.train_placements(digits, k=4, c=0.3, epochs=1, placements=("once", "scaled_micro"))
    by = {r.placement: r for r in runs}
    assert max(abs(a - b) for a, b in zip(by["once"].losses, by["full batch"].losses)) < 1e-10
    assert by["full batch"].k == 1 and by["scaled_micro"].k == 4


def test_widget_function_and_figures():
    import matplotlib

    matplotlib.use("Agg")
    rows = {r.placement: r for r in ch3.placement_effects(8, 0.125, 1.0)}
    assert rows["scaled_micro"].norm_over_c == pytest.approx(8, rel=1e-3) and rows["once"].cosine == pytest.approx(1)
    with pytest.raises(ValueError, match="threshold"):
        ch3.placement_effects(8, 0.0, 1.0)
    assert len(ch3.plot_placement_effects(4, 0.5, 0.5).axes) == 2


# ------------------------------------------------------------------ misplaced clips: bounds and both directions


def test_misplaced_clips_make_steps_too_long_too_short_or_reversed():
    cases = ch3.errata_cases()
    long_a1 = cases["(a1) too long: aligned"]
    assert long_a1.norm == pytest.approx(2.0) and long_a1.ratio == pytest.approx(2.0, rel=1e-5)
    short_a1 = cases["(a1) too short: opposing"]  # (10, 0), (−9, 0), c = 1: each g_k/2 is clipped to length 1
    # exactly 0 for the projection; clip_grad_norm_'s +1e-6 leaves ~2e-8, a zero step with no direction (NaN cosine)
    assert short_a1.norm < 1e-6 and short_a1.correct == pytest.approx(0.5) and math.isnan(short_a1.cosine)
    flip_a1 = cases["(a1) reversed, K = 3"]  # g = (0.1, 0) is not clipped; (a1) gives (−1, 0)
    assert flip_a1.ratio == pytest.approx(10.0, rel=1e-5) and flip_a1.cosine == pytest.approx(-1.0)
    short_a2 = cases["(a2) too short: orthogonal"]
    assert short_a2.ratio == pytest.approx(2**-0.5, rel=1e-5)
    long_a2 = cases["(a2) too long and reversed"]  # (−3, 0) and 3 × (0.95, 0), c = 1
    assert long_a2.norm == pytest.approx(0.4625, abs=1e-6) and long_a2.correct == pytest.approx(0.0375)
    assert long_a2.cosine == pytest.approx(-1.0) and long_a2.norm <= 1.0
    short_b = cases["(b) too short and turned"]  # (10, 0), (−2, 1), c = 1: buffer (1, 0), then (0, 0.5), not clipped
    assert short_b.norm == pytest.approx(0.5, abs=1e-6) and short_b.correct == pytest.approx(1.0, abs=1e-6)
    assert short_b.cosine == pytest.approx(0.25 / (0.5 * math.hypot(4.0, 0.5)), abs=1e-6)  # ≈ 0.124
    flip_b = cases["(b) reversed"]  # (10, 0), (−7, 0): ‖g‖ = 1.5 > c, yet (b) gives (−1, 0)
    assert flip_b.norm == pytest.approx(1.0, abs=1e-6) and flip_b.cosine == pytest.approx(-1.0)
    assert "n/a" in repr(ch3.format_errata_cases(cases))  # no cosine printed for the zero step


def test_running_reaches_c_exactly_when_its_final_buffer_exceeds_c():
    for name in ("(b) too short and turned", "(b) reversed"):
        _, vectors, c = ch3.ERRATA_CASES[name]
        grads = [torch.tensor(v, dtype=torch.float64) for v in vectors]
        buffers = clipping.running_buffer_norms(grads, c)
        step = float(clipping.combine(grads, c, "running").norm())
        assert step <= c + 1e-12
        assert (abs(step - c) < 1e-5) == (buffers[-1] > c)
    assert clipping.running_buffer_norms([torch.tensor([10.0, 0.0]), torch.tensor([-2.0, 1.0])], 1.0)[
        -1
    ] == pytest.approx(0.5, abs=1e-6)
    for seed in range(6):  # random cases: the equivalence holds both ways
        grads = ch3.synthetic_micro_gradients(6, 0.2 * seed, norm=2.0, dim=8, seed=seed)
        for c in (0.3, 1.0, 3.0):
            last = clipping.running_buffer_norms(grads, c)[-1]
            step = float(clipping.combine(grads, c, "running").norm())
            assert step == pytest.approx(min(last, c), abs=1e-5)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("alignment", [0.0, 0.3, 0.9])
@pytest.mark.parametrize("k, c, norm", [(2, 1.0, 3.0), (8, 0.5, 1.0), (16, 2.0, 1.0)])
def test_norm_bounds_always_hold(seed, alignment, k, c, norm):
    gen = torch.Generator().manual_seed(seed)
    scales = 0.1 + 3 * torch.rand(k, generator=gen, dtype=torch.float64)  # micro-gradients of unequal lengths
    grads = [s * g for s, g in zip(scales, ch3.synthetic_micro_gradients(k, alignment, norm, dim=16, seed=seed))]
    bounds = clipping.norm_bounds(grads, c)
    correct = float(clipping.combine(grads, c, "once").norm())
    assert correct == pytest.approx(bounds["once"], rel=1e-5)
    for placement in ("scaled_micro", "raw_micro", "running"):
        assert float(clipping.combine(grads, c, placement).norm()) <= bounds[placement] + 1e-12
    assert bounds["scaled_micro"] <= k * c + 1e-12 and bounds["raw_micro"] <= c + 1e-12
    if bounds["once"] >= c * (1 - 1e-5):  # the full-batch gradient is clipped: relative bounds K and 1
        assert float(clipping.combine(grads, c, "scaled_micro").norm()) <= k * correct * (1 + 1e-5)
        assert float(clipping.combine(grads, c, "raw_micro").norm()) <= correct * (1 + 1e-5)


def test_scaled_micro_is_raw_micro_at_threshold_kc():
    grads = ch3.synthetic_micro_gradients(8, 0.4, norm=5.0, seed=3)
    assert torch.allclose(
        clipping.combine(grads, 0.5, "scaled_micro"), clipping.combine(grads, 4.0, "raw_micro"), atol=1e-9
    )


@pytest.mark.parametrize("k, alignment", [(2, 0.5), (8, 0.0), (16, 0.8)])
def test_raw_micro_when_every_micro_gradient_is_clipped(k, alignment):
    grads = ch3.synthetic_micro_gradients(k, alignment, norm=3.0, dim=64, seed=1)
    predicted = clipping.raw_micro_all_clipped(clipping.mean_pairwise_cosine(grads), k, 3.0)
    assert float(clipping.combine(grads, 1.0, "raw_micro").norm()) == pytest.approx(predicted, rel=1e-5)
    with pytest.raises(ValueError, match="agreement"):
        clipping.raw_micro_all_clipped(1.5, k, 3.0)


def test_raw_micro_all_clipped_refuses_when_a_micro_gradient_is_not_clipped():
    # (3, 0) and (0.5, 0) with c = 1: the formula would give sqrt(1/2 + 1/2) = 1, the true (a2) is 0.75
    grads = [torch.tensor([3.0, 0.0], dtype=torch.float64), torch.tensor([0.5, 0.0], dtype=torch.float64)]
    assert float(clipping.combine(grads, 1.0, "raw_micro").norm()) == pytest.approx(0.75, abs=1e-6)
    with pytest.raises(ValueError, match="longer than c"):
        clipping.raw_micro_all_clipped(1.0, 2, 0.5)


# ------------------------------------------------------------------ the numbers the exercise solutions state


def test_exercise_running_buffer_solution():
    """ex-ch3-running: (2, 0) then (0, 2) added to .grad without 1/K, clip_grad_norm_(·, 1) after each."""
    g1, g2 = torch.tensor([2.0, 0.0], dtype=torch.float64), torch.tensor([0.0, 2.0], dtype=torch.float64)
    forward = clipping.clip_running_buffer([g1, g2], 1.0)
    assert torch.allclose(forward, torch.tensor([1.0, 2.0], dtype=torch.float64) / math.sqrt(5), atol=1e-6)
    assert forward.tolist() == pytest.approx([0.447, 0.894], abs=5e-4)
    once = clipping.clip_vector(g1 + g2, 1.0)
    assert once.tolist() == pytest.approx([0.707, 0.707], abs=5e-4)
    reverse = clipping.clip_running_buffer([g2, g1], 1.0)
    assert reverse.tolist() == pytest.approx([0.894, 0.447], abs=5e-4)
    # the second micro-batch counts twice as much: the weights of g_1, g_2 (contributions g_k/K, K = 2)
    w = clipping.running_clip_weights([2 * g1, 2 * g2], 1.0)
    assert w[1] / w[0] == pytest.approx(2.0, rel=1e-5)
    assert torch.allclose(clipping.combine([2 * g1, 2 * g2], 1.0, "running"), forward)


def test_exercise_scaler_clip_before_unscale():
    """ex-ch3-scaler: S = 65536, true norm 4, c = 1, clip before unscale_: 1/65536 ≈ 1.53e-5."""
    wrong = clipping.scaler_clip_norm(4.0, 1.0, scale=65536.0, unscale_first=False)
    assert wrong == pytest.approx(1 / 65536, rel=1e-5) and f"{wrong:.3g}" == "1.53e-05"
    assert clipping.scaler_clip_norm(4.0, 1.0, scale=65536.0, unscale_first=True) == pytest.approx(1.0, abs=1e-6)
    with pytest.raises(ValueError, match="grad_norm"):
        clipping.scaler_clip_norm(0.0, 1.0)


def test_second_unscale_raises():
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    opt = torch.optim.SGD([p], lr=0.0)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(p.sum()).backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="unscale_"):
        scaler.unscale_(opt)


def test_clip_running_buffer_needs_contributions():
    with pytest.raises(ValueError, match="K"):
        clipping.clip_running_buffer([], 1.0)


# ------------------------------------------------------------------ sweeps (small)


def test_sweeps_small(digits):
    tables = ch3.table_sweep(digits, setups=(("layer", 0.3),), seeds=(1,), ks=(1, 4))
    row = tables[("layer", 0.3, 1)][4]
    assert row["smallest"][0] <= row["largest"][0] and row["full"][0] > 0
    assert "(a1) ‖step‖/c" in repr(ch3.format_table_sweep(tables))
    losses = ch3.train_sweep(digits, k=4, epochs=1, setups=(("group", 0.3),), seeds=(0,))
    assert set(losses[("group", 0.3, 0)]) == set(clipping.PLACEMENTS)
    assert "(a1)" in repr(ch3.format_train_sweep(losses))
    with pytest.raises(ValueError, match="per-sample"):
        ch3.train_placements(digits, k=2, c=0.3, epochs=1, norm="batch")


def test_with_two_micro_batches_neither_placement_exceeds_the_unclipped_gradient():
    """K = 2: clip is odd and nonexpansive, so ‖clip(u) + clip(w)‖ ≤ ‖u + w‖ for (a1) and (a2) alike."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(500):
        dim = int(torch.randint(1, 5, (1,), generator=gen))
        grads = [
            torch.randn(dim, generator=gen, dtype=torch.float64) * 4 * float(torch.rand(1, generator=gen))
            for _ in range(2)
        ]
        c = 0.05 + 2 * float(torch.rand(1, generator=gen))
        g = float(torch.linalg.vector_norm((grads[0] + grads[1]) / 2))
        assert float(clipping.combine(grads, c, "scaled_micro").norm()) <= g + 1e-12
        assert float(clipping.combine(grads, c, "raw_micro").norm()) <= min(g, c) + 1e-12


@pytest.mark.slow
def test_runs_in_two_processes_are_the_sequential_ones(digits):
    """The chapter trains in two spawned processes: the same runs, to the bit, as one after the other."""
    kwargs = dict(k=4, c=0.3, epochs=1, placements=("once", "raw_micro"))
    one = ch3.train_placements(digits, **kwargs)
    two = ch3.train_placements(digits, **kwargs, workers=2)
    assert [r.placement for r in two] == ["full batch", "once", "raw_micro"] and one == two
    sweep = dict(k=4, epochs=1, setups=(("group", 0.3), ("layer", 1.0)), seeds=(1,), placements=("running",))
    assert ch3.train_sweep(digits, **sweep) == ch3.train_sweep(digits, **sweep, workers=2)
    with pytest.raises(ValueError, match="unknown placement"):
        ch3.train_sweep(digits, placements=("twice",), workers=2)


def test_clipping_tools_refuse_impossible_input_and_the_order_grader_follows_the_norm():
    """Found by review: clip_vector reversed a vector for c = -1, raw_micro_all_clipped took a mean cosine no K
    unit vectors can have, the scaler tools took scale 0 (NaN) or -2, clipped_accumulation checked mode only after
    the window, and the scaler-order grader expected c/S even when the clip does not act."""
    from gradaccum.book import exercises

    v = torch.tensor([3.0, 4.0])
    for c in (-1.0, 0.0, float("nan")):
        for mode in ("norm", "value"):
            with pytest.raises(ValueError, match="threshold"):
                clipping.clip_vector(v, c, mode)
    with pytest.raises(ValueError, match="floating-point"):
        clipping.clip_vector(torch.tensor([3, 4]), 1.0)
    with pytest.raises(ValueError, match=r"\[-1/\(K-1\), 1\]"):
        clipping.raw_micro_all_clipped(-1.0, 3, 2.0)
    for kwargs in (dict(scale=0.0), dict(scale=-2.0), dict(grad_norm=True), dict(scale=1e300)):
        with pytest.raises(ValueError):
            clipping.scaler_clip_norm(**(dict(grad_norm=4.0, c=1.0) | kwargs))
    model = nn.Sequential(nn.Linear(3, 2)).double()
    x, y = torch.randn(8, 3, dtype=torch.float64), torch.randint(0, 2, (8,))
    with pytest.raises(ValueError, match="init_scale"):
        clipping.clip_with_scaler(model, nn.CrossEntropyLoss(), x, y, 2, 1.0, init_scale=0.0)
    with pytest.raises(ValueError, match="mode"):
        clipping.clipped_accumulation(model, nn.CrossEntropyLoss(), x, y, 2, 1.0, "once", mode="Value")
    assert all(p.grad is None for p in model.parameters())  # refused before any backward
    assert exercises.grade_scaler_clip_order(1e-6, scale=1.0, c=1.0, norm=1e-6).correct  # the clip does not act
    assert exercises.grade_scaler_clip_order(1.0 / 65536).correct
    with pytest.raises(ValueError):
        exercises.grade_scaler_clip_order(1.0, scale=0.0)


def test_vector_tools_refuse_mismatched_non_finite_or_directionless_micro_gradients():
    """Found by review: combine/norm_bounds broadcast micro-gradients of different shapes or summed a stacked
    tensor's rows, NaN gradients came back as NaN bounds, mean_pairwise_cosine returned NaN for a zero vector,
    Comparison.ratio divided by a zero correct step and synthetic_micro_gradients took norm=nan."""
    one, other = torch.ones(3), torch.ones(4)
    for call in (
        lambda g: clipping.combine(g, 1.0, "once"),
        lambda g: clipping.norm_bounds(g, 1.0),
        lambda g: clipping.running_buffer_norms(g, 1.0),
        lambda g: clipping.clip_running_buffer(g, 1.0),
        clipping.mean_pairwise_cosine,
    ):
        with pytest.raises(ValueError, match=r"shape \(4,\)"):
            call([one, other])
        with pytest.raises(ValueError, match="inf or NaN"):
            call([one, torch.tensor([1.0, float("nan"), 0.0])])
        with pytest.raises(ValueError, match="list of K tensors"):
            call(torch.ones(2, 3))
        with pytest.raises(ValueError, match="floating-point"):
            call([torch.ones(3, dtype=torch.int64)])
    with pytest.raises(ValueError, match="no direction"):
        clipping.mean_pairwise_cosine([one, torch.zeros(3)])
    assert clipping.mean_pairwise_cosine([one, -one]) == pytest.approx(-1.0)
    cancel = clipping.compare_to_once([torch.tensor([1.0, 0.0]), torch.tensor([-1.0, 0.0])], 1.0, "raw_micro")
    assert cancel.correct == 0 and math.isnan(cancel.ratio) and math.isnan(cancel.cosine)
    for kwargs in (dict(norm=float("nan")), dict(norm=0.0), dict(alignment=float("nan")), dict(dim=0)):
        with pytest.raises(ValueError):
            ch3.synthetic_micro_gradients(**(dict(k=2, alignment=0.5) | kwargs))


def test_clipping_tools_keep_tiny_steps_exact_and_refuse_nonfinite_or_string_inputs():
    """Third review of chapter 3: cosines of short steps were NaN (an absolute 1e-6 floor) or off (F.cosine_similarity's
    eps); NaN and overflowing norms passed through clip_vector; strings were truthy flags or TypeErrors; a tiny
    float32 vector was called zero; the 1-norm bracket said 'a third' where it is nearly twice."""
    t = lambda *v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    tiny = [t(1e-7, 0.0), t(2e-7, 1e-7)]
    for placement in clipping.PLACEMENTS:
        r = clipping.compare_to_once(tiny, 1.0, placement)
        assert abs(r.cosine - 1) < 1e-12 and abs(r.ratio - 1) < 1e-12
    same = clipping.compare_to_once([t(3.0, 4.0), t(3.0, 4.0)], 1e-7, "once")
    assert abs(same.cosine - 1) < 1e-12 and abs(same.ratio - 1) < 1e-12
    assert math.isnan(clipping.compare_to_once([t(10.0, 0.0), t(-9.0, 0.0)], 1.0, "scaled_micro").cosine)
    for effect in ch3.placement_effects(4, 1.0, 0.5, norm=1e-9):
        if effect.placement == "once":
            assert abs(effect.cosine - 1) < 1e-12
    for bad in (
        lambda: clipping.clip_vector(torch.tensor([float("nan"), 1.0]), 1.0),
        lambda: clipping.clip_vector(torch.tensor([float("inf"), 1.0]), 1.0),
        lambda: clipping.clip_vector(torch.tensor([60000.0, 60000.0], dtype=torch.float16), 1.0),
        lambda: clipping.raw_micro_all_clipped("0.3", 2, 2.0),
        lambda: clipping.scaler_clip_norm(2.0, 1.0, unscale_first="False"),
    ):
        with pytest.raises(ValueError):
            bad()
    assert clipping.mean_pairwise_cosine([torch.tensor([1e-25, 0.0]), torch.tensor([2e-25, 0.0])]) == 1.0
    pair = [(0.0, 2.0), (-0.01, -2.0)]
    assert ch3.torch_clip_ratio(pair, 1.0, "scaled_micro", norm_type=1) > 1.98


def test_clip_with_scaler_refuses_what_a_scaler_would_skip():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    with pytest.raises(ValueError, match="not finite"):
        clipping.clip_with_scaler(model, nn.CrossEntropyLoss(), x * float("nan"), y, 2, 0.1)
    with pytest.raises(ValueError, match="float32"):
        clipping.clip_with_scaler(model, nn.CrossEntropyLoss(), x, y, 2, 0.1, init_scale=1e300)
    with pytest.raises(ValueError, match="unscale_first"):
        clipping.clip_with_scaler(model, nn.CrossEntropyLoss(), x, y, 2, 0.1, unscale_first="False")


# ------------------------------------------------------------------ AdamW, near-zero steps and overflowing clips


@pytest.mark.slow
def test_adamw_reverses_the_order_of_a2(digits):
    """The page: with AdamW (torch's defaults) at learning rates 1e-3 and 1e-2, K = 8, c = 0.3, (a1) and (a2)
    both end below clipping once in the six runs on seeds 0-2, and (b) above it: SGD's order of (a2) reverses.
    Fifth review: on seeds 3-5 at 1e-2 (GroupNorm and LayerNorm) (b) stays above, but (a1) ends above clipping
    once in two LayerNorm runs: the order of (a1) and (a2) under AdamW depends on the seed."""
    for lr in (1e-3, 1e-2):
        sweep = ch3.train_sweep(digits, k=8, epochs=2, setups=(("group", 0.3),), lr=lr, optimizer="AdamW", workers=2)
        assert len(sweep) == 3
        for key, loss in sweep.items():
            assert max(loss["scaled_micro"], loss["raw_micro"]) < loss["once"] < loss["running"], (lr, key, loss)
    more = ch3.train_sweep(
        digits,
        k=8,
        epochs=2,
        setups=(("group", 0.3), ("layer", 0.3)),
        seeds=(3, 4, 5),
        lr=1e-2,
        optimizer="AdamW",
        workers=2,
    )
    assert len(more) == 6 and all(loss["once"] < loss["running"] for loss in more.values())
    above = [key for key, loss in more.items() if loss["scaled_micro"] > loss["once"]]
    assert above == [("layer", 0.3, 4), ("layer", 0.3, 5)], above
    with pytest.raises(ValueError, match="unknown optimizer"):
        ch3.train_sweep(digits, epochs=1, optimizer="Adam", placements=("once",), seeds=(0,))


def test_the_agreement_of_aligned_gradients_is_accepted():
    """Review: mean_pairwise_cosine of identical vectors came out 1 + 2e-16 in a third of the seeds, which
    raw_micro_all_clipped refused as outside [-1/(K-1), 1]."""
    for s in range(50):
        v = torch.randn(777, generator=torch.Generator().manual_seed(s), dtype=torch.float64) * 5
        a = clipping.mean_pairwise_cosine([v] * 8)
        assert 1 - 1e-14 < a <= 1.0 and clipping.raw_micro_all_clipped(a, 8, 2.0) == pytest.approx(1.0, abs=1e-14)
    assert clipping.mean_pairwise_cosine([torch.tensor([1.0, 0.0]), torch.tensor([-1.0, 0.0])]) == -1.0
    assert clipping.raw_micro_all_clipped(-1.0 - 1e-15, 2, 2.0) == 0.0
    with pytest.raises(ValueError, match="lies in"):
        clipping.raw_micro_all_clipped(1.001, 8, 2.0)


def test_a_small_step_that_no_clip_touched_keeps_its_direction():
    """Review: nothing clipped (c = 10, norms <= 1), the step 7.5e-7 is exact, yet the floor for clipping residue
    made its cosine and ratio NaN. The floor now applies only where a clip acted."""
    t = lambda *v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    r = clipping.compare_to_once([t(1.0, 0.0), t(-0.9999985, 0.0)], 10.0, "raw_micro")
    assert r.floor == 0.0 and r.cosine == pytest.approx(1.0) and r.ratio == pytest.approx(1.0)
    cancelled = clipping.compare_to_once([t(10.0, 0.0), t(-9.0, 0.0)], 1.0, "scaled_micro")  # a clip residue
    assert cancelled.floor > 0 and math.isnan(cancelled.cosine)
    exact_zero = clipping.compare_to_once([t(1.0, 0.0), t(-1.0, 0.0)], 10.0, "raw_micro")
    assert math.isnan(exact_zero.cosine) and math.isnan(exact_zero.ratio)


def test_overflowing_clips_name_the_wider_dtype_and_defaults_are_the_right_order():
    with pytest.raises(ValueError, match=r"float64 \(v.double\(\)\)"):
        clipping.clip_vector(torch.tensor([3e38, 3e38]), 1.0)
    with pytest.raises(ValueError, match=r"float64 \(v.double\(\)\)"):
        clipping.clip_vector(torch.tensor([3e38, 3e38], dtype=torch.bfloat16), 1.0)
    with pytest.raises(ValueError, match=r"float32 \(v.float\(\)\)"):
        clipping.clip_vector(torch.tensor([60000.0, 60000.0], dtype=torch.float16), 1.0)
    # "once" divides each micro-gradient by K before adding, as a loop does: no float16 overflow of the sum
    half = [torch.tensor([40000.0, 0.0], dtype=torch.float16)] * 2
    assert float(clipping.combine(half, 1.0, "once").norm()) == pytest.approx(1.0, abs=1e-3)
    # the default is the right order, as in clip_with_scaler
    assert clipping.scaler_clip_norm(4.0, 1.0) == pytest.approx(1.0, abs=1e-6)
    torch.manual_seed(0)
    model = nn.Linear(4, 2).half()
    with pytest.raises(ValueError, match="autocast"):
        clipping.clip_with_scaler(
            model, nn.CrossEntropyLoss(), torch.randn(4, 4).half(), torch.tensor([0, 1, 0, 1]), 2, 1.0
        )


def test_exercise_shrink_numbers():
    """ex-ch3-shrink's solution: the (a2) step is 0 up to about 3e-7, clipping once leaves (1, 0) up to 1/(1+1e-6)."""
    g = [torch.tensor([3.0, 0.0], dtype=torch.float64), torch.tensor([-1.0, 0.0], dtype=torch.float64)]
    a2 = float(clipping.combine(g, 1.0, "raw_micro").norm())
    assert 2.5e-7 < a2 < 3.5e-7
    assert float(clipping.combine(g, 1.0, "once").norm()) == pytest.approx(1 / (1 + 1e-6), rel=1e-12)


def test_torch_clip_ratio_refuses_what_has_no_ratio():
    """Fifth review: a negative threshold returned 0.7071 (torch's clip flips the sign), NaN, 0 and a norm below 1
    gave numbers, an empty list a ZeroDivisionError and cancelling vectors 0/0."""
    v = [[1.0, 0.0], [0.0, 2.0]]
    assert ch3.torch_clip_ratio(v, 0.5, "raw_micro", 2) == pytest.approx(0.7071068833, rel=1e-9)
    for args, message in (
        ((v, -1.0, "raw_micro", 2), "threshold"),
        ((v, float("nan"), "once", 2), "threshold"),
        ((v, 0.5, "raw_micro", 0.5), "norm_type"),
        (([], 0.5, "raw_micro", 2), "vectors"),
        (([[1.0], [1.0, 2.0]], 0.5, "raw_micro", 2), "vectors"),
        (([[1.0, 0.0], [-1.0, 0.0]], 0.5, "raw_micro", 2), "cancel"),
    ):
        with pytest.raises(ValueError, match=message):
            ch3.torch_clip_ratio(*args)


# ------------------------------------------------------------------ scales and sweeps that have no answer


def test_a_scale_whose_inverse_is_infinite_is_refused():
    """GradScaler unscales by 1/S rounded to float32: infinite below about 2.94e-39. clip_with_scaler said "use a
    smaller init_scale" there (the opposite of the fix) and scaler_clip_norm returned NaN; both refuse now, and
    the edge itself still works."""
    assert clipping.scaler_clip_norm(4, 1, 3e-39) == pytest.approx(1.0, abs=1e-6)
    for scale in (2.9e-39, 1e-40, 1e-300):
        with pytest.raises(ValueError, match="infinite"):
            clipping.scaler_clip_norm(4, 1, scale)
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    with pytest.raises(ValueError, match="at least 2.94e-39"):
        clipping.clip_with_scaler(model, nn.CrossEntropyLoss(), x, y, 2, 0.1, init_scale=1e-40)
    with pytest.raises(ValueError, match="finite number"):
        clipping.raw_micro_all_clipped(0.5, 4, float("inf"))


def test_sweep_tools_refuse_what_they_cannot_tabulate(digits):
    with pytest.raises(ValueError, match="BatchNorm"):
        ch3.table_sweep(digits, setups=(("batch", 0.3),), seeds=(0,), ks=(1, 2))
    with pytest.raises(ValueError, match="seeds below"):
        ch3.table_sweep(digits, setups=(("group", 0.3),), seeds=(50,), ks=(1, 2))
    with pytest.raises(ValueError, match="batch_size"):
        ch3.table_sweep(digits, setups=(("group", 0.3),), seeds=(0,), ks=(1, 2), batch_size=0)
    tables = ch3.table_sweep(digits, setups=(("group", 0.3),), seeds=(0,), ks=(1,))
    with pytest.raises(ValueError, match="K > 1"):
        ch3.format_table_sweep(tables)
    with pytest.raises(ValueError, match="seed"):
        ch3.synthetic_micro_gradients(4, 0.5, seed="a")
    model = make_cnn("group", seed=0)
    with pytest.raises(ValueError, match="ks is empty"):
        ch3.placement_table(model, nn.CrossEntropyLoss(), digits.x_train[:8], digits.y_train[:8], (), 0.3)
