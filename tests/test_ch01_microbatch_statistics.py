import itertools
import math

import numpy as np
import pytest
import torch
from torch import nn

from gradaccum import _validate, accumulate, bn_statistics
from gradaccum.book import ch01_microbatch_statistics as ch1
from gradaccum.book.models import make_cnn


def test_batch_moments_match_batchnorm():
    torch.manual_seed(0)
    x = torch.randn(6, 3, 4, 4, dtype=torch.float64)
    mean, biased, unbiased = bn_statistics.batch_moments(x)
    layer = nn.BatchNorm2d(3, affine=False, momentum=1.0).double().train()
    out = layer(x)
    expected = (x - mean[None, :, None, None]) / torch.sqrt(biased[None, :, None, None] + layer.eps)
    assert torch.allclose(out, expected, atol=1e-12)  # normalizes with the biased variance
    assert torch.allclose(layer.running_var, unbiased, atol=1e-12)  # stores the unbiased one
    assert torch.allclose(layer.running_mean, mean, atol=1e-12)


def test_batch_moments_errors():
    with pytest.raises(ValueError):
        bn_statistics.batch_moments(torch.zeros(5))
    with pytest.raises(ValueError):
        bn_statistics.batch_moments(torch.zeros(1, 3))


@pytest.mark.parametrize("b", [1, 2, 3, 5, 7])
def test_mean_variance_formula_is_exact_over_all_subsets(b):
    """Enumerate every micro-batch of size b from a population of 7: the formula is exact."""
    pop = np.array([0.3, -1.2, 2.5, 0.0, 4.1, -0.7, 1.9])
    n = len(pop)
    means = [pop[list(c)].mean() for c in itertools.combinations(range(n), b)]
    assert np.var(means) == pytest.approx(bn_statistics.predicted_mean_variance(pop.var(), b, n), rel=1e-12, abs=1e-15)


def test_biased_variance_factor_is_exact_over_all_pairs_with_replacement():
    pop = np.array([1.0, 4.0, -2.0, 0.5])
    b = 3
    vals = [np.var(pop[list(c)]) for c in itertools.product(range(len(pop)), repeat=b)]  # i.i.d. draws
    assert np.mean(vals) == pytest.approx(bn_statistics.biased_variance_factor(b) * pop.var(), rel=1e-12)


def test_predicted_mean_variance_errors():
    with pytest.raises(ValueError):
        bn_statistics.predicted_mean_variance(1.0, 0, 10)
    with pytest.raises(ValueError):
        bn_statistics.predicted_mean_variance(1.0, 11, 10)
    # found by review: a fractional b, a float n or a negative variance gave a number; a tensor with no
    # channels raised ZeroDivisionError
    for sigma2, b, n, match in (
        (1.0, 2.5, 10, "whole numbers"),
        (1.0, np.array([2, 2.5]), 10, "whole numbers"),
        (1.0, 2, 10.0, "int >= 2"),
        (-1.0, 2, 10, "variance"),
        (float("nan"), 2, 10, "variance"),
    ):
        with pytest.raises(ValueError, match=match):
            bn_statistics.predicted_mean_variance(sigma2, b, n)
    assert bn_statistics.predicted_mean_variance(1.0, np.array([2, 4]), 10) == pytest.approx([4 / 9, 1 / 6])
    for x, match in ((torch.ones(2, 0), "C >= 1"), (torch.ones(2, 3, dtype=torch.int64), "floating-point")):
        with pytest.raises(ValueError, match=match):
            bn_statistics.batch_moments(x)


@pytest.mark.parametrize("m, k", [(0.1, 8), (0.01, 3), (0.5, 1)])
def test_momentum_algebra(m, k):
    assert bn_statistics.effective_momentum(m, k) == pytest.approx(1 - (1 - m) ** k)
    m2 = bn_statistics.corrected_momentum(m, k)
    assert bn_statistics.effective_momentum(m2, k) == pytest.approx(m, rel=1e-12)
    w = bn_statistics.micro_batch_weights(m, k)
    assert sum(w) == pytest.approx(bn_statistics.effective_momentum(m, k)) and np.all(np.diff(w) >= 0)


def test_micro_batch_weights_match_pytorch():
    m, k = 0.2, 5
    layer = nn.BatchNorm1d(2, momentum=m).double().train()
    torch.manual_seed(0)
    micro = [torch.randn(3, 2, dtype=torch.float64) * (j + 1) for j in range(k)]
    for x in micro:
        layer(x)
    predicted = sum(w * x.mean(0) for w, x in zip(bn_statistics.micro_batch_weights(m, k), micro))
    assert torch.allclose(layer.running_mean, predicted, atol=1e-14)


@pytest.mark.parametrize("m", [-0.1, 1.5, float("nan"), "0.1", True, None])
def test_bad_momentum(m):
    with pytest.raises(ValueError, match="momentum"):
        bn_statistics.effective_momentum(m, 2)


def test_momentum_zero_is_a_legal_frozen_average():
    """nn.BatchNorm accepts momentum=0 (the running statistics never move): the formulas give exactly 0, and
    set_bn_momentum sets it, as a layer run K times shows."""
    assert bn_statistics.effective_momentum(0.0, 8) == 0.0 and bn_statistics.corrected_momentum(0, 8) == 0.0
    assert bn_statistics.micro_batch_weights(0.0, 3) == [0.0, 0.0, 0.0]
    layer = torch.nn.BatchNorm1d(2).double()
    assert bn_statistics.set_bn_momentum(layer, 0.0) == 1 and layer.momentum == 0.0
    for _ in range(3):
        layer(torch.randn(4, 2, dtype=torch.float64) + 5)
    assert torch.equal(layer.running_mean, torch.zeros(2, dtype=torch.float64))


def test_set_bn_momentum():
    model = make_cnn("batch")
    assert bn_statistics.set_bn_momentum(model, 0.05) == 3
    assert all(mod.momentum == 0.05 for mod in model.modules() if isinstance(mod, nn.modules.batchnorm._BatchNorm))
    assert bn_statistics.set_bn_momentum(make_cnn("group"), 0.05) == 0
    # InstanceNorm with running statistics drifts the same way: its momentum is set too; without them it is not
    inst = nn.Sequential(nn.InstanceNorm1d(3, track_running_stats=True), nn.InstanceNorm1d(3))
    assert bn_statistics.set_bn_momentum(inst, 0.05) == 1 and inst[0].momentum == 0.05 and inst[1].momentum == 0.1
    x = torch.randn(8, 3, 5, dtype=torch.float64)
    full, micro = (
        nn.InstanceNorm1d(3, track_running_stats=True).double(),
        nn.InstanceNorm1d(3, track_running_stats=True).double(),
    )
    full(x)
    for xb in x.chunk(4):  # K forward calls: K updates of momentum m, as BatchNorm's
        micro(xb)
    assert not torch.allclose(full.running_mean, micro.running_mean)


def test_check_micro_batch():
    with pytest.raises(ValueError, match="GroupNorm"):
        _validate.require_micro_batch(1)
    assert _validate.require_micro_batch(1, batch_norm=False) == 1
    with pytest.raises(ValueError):
        _validate.require_micro_batch(0, batch_norm=False)


def test_layer_inputs_and_moment_spread(digits):
    model = make_cnn("batch").train()
    feats = bn_statistics.layer_inputs(model, digits.x_train, "head.1")
    assert feats.shape == (1221, 32) and model.training
    s = ch1.moment_spread(feats, 4, draws=3000, seed=1)
    assert abs(s.mean_var_ratio - 1) < 0.1 and abs(s.biased_var_ratio - 0.75) < 0.03
    with pytest.raises(ValueError, match="no submodule"):
        bn_statistics.layer_inputs(model, digits.x_train, "head.9")
    with pytest.raises(ValueError, match="available samples"):
        ch1.moment_spread(feats[:3], 4)
    with pytest.raises(ValueError, match=r"\(N, C\)"):
        ch1.moment_spread(feats[None], 4)


@pytest.mark.slow
def test_moment_spread_standard_errors_cover_the_theory():
    """Review: chapter 1 checked the measured spreads with a fixed ±0.03, about one Monte Carlo standard error at
    2,000 draws, so other seeds failed it. The spreads now carry standard errors; on normal features of known
    spread (skewed ones too), every measurement lies within 4.5 of them of the exact theory, and each standard
    error is the right size: the measurements of 20 independent seeds scatter as it says (a reviewer saw 0.83-1.3
    of it with 30 seeds; doubled standard errors fail this)."""
    gen = torch.Generator().manual_seed(0)
    normal = torch.randn(500, 6, generator=gen, dtype=torch.float64) * torch.linspace(0.5, 3.0, 6)
    skewed = torch.distributions.Exponential(1.0).sample((500, 6)).double()
    fields = (
        ("mean_var_ratio", "mean_var_se"),
        ("biased_var_ratio", "biased_var_se"),
        ("rel_mean_std", "rel_mean_std_se"),
    )
    for feats in (normal, skewed):
        for b in (2, 7, 64):
            spreads = [ch1.moment_spread(feats, b, draws=4000, seed=seed) for seed in range(20)]
            z = np.array([ch1.spread_deviations(s, 500) for s in spreads])
            assert np.abs(z).max() < 4.5, (b, z)
            for value, se in fields:
                scatter = np.std([getattr(s, value) for s in spreads], ddof=1)
                typical = np.median([getattr(s, se) for s in spreads])
                assert 0.65 < scatter / typical < 1.5, (b, value, scatter, typical)
    few = ch1.moment_spread(normal, 2, draws=30)  # one draw per group: no standard error
    assert math.isnan(few.mean_var_se) and not math.isnan(few.mean_var_ratio)
    assert ch1.moment_theory(2, 3) == pytest.approx((0.75, 0.5))
    with pytest.raises(ValueError, match="n"):
        ch1.moment_theory(4, 4)


def test_gradient_table_on_other_weights_and_batches(digits):
    """Chapter 1's sentence on the gradient table beyond seed 0 and the first batch: seeds 1-2, batches 64 and
    640 — the error at b = 32 ranges over 0.18-0.28, at b = 2 over 1.76-2.33, the cosine at b = 2 stays below
    0.34, and the error grows at every halving of b."""
    at32, at2, cos2 = [], [], []
    for seed, start in itertools.product((1, 2), (64, 640)):
        x, y = digits.x_train[start : start + 64], digits.y_train[start : start + 64]
        effects = [ch1.microbatch_effect(64 // b, b, x, y, norms=("batch",), seed=seed) for b in (32, 16, 8, 4, 2)]
        errors = [e.rel_error["batch"] for e in effects]
        assert all(a < b for a, b in zip(errors, errors[1:])), (seed, start, errors)
        at32.append(errors[0])
        at2.append(errors[-1])
        cos2.append(effects[-1].cosine["batch"])
    assert round(min(at32), 2) == 0.18 and round(max(at32), 2) == 0.28, at32
    assert round(min(at2), 2) == 1.76 and round(max(at2), 2) == 2.33, at2
    assert max(cos2) < 0.34 and min(at2) > 1, cos2


@pytest.mark.slow
def test_error_grid_on_other_initializations(digits):
    """Chapter 1's grid beyond seed 0: with seeds 1 to 5 the error falls at every step in b in every row with
    K > 1, at least 10-fold from b = 2 to b = 64, and K moves it by up to 2.7x (review: seeds 1 and 2 alone gave
    2.2x, seed 4 2.67x)."""
    falls, moves = [], []
    for seed in (1, 2, 3, 4, 5):
        grid = ch1.bn_error_grid((2, 4, 8, 16), (2, 4, 8, 16, 32, 64), digits.x_train, digits.y_train, seed=seed)
        assert np.all(np.diff(grid, axis=1) < 0) and np.all(grid > 0.05), (seed, grid)
        falls.append((grid[:, 0] / grid[:, -1]).min())
        moves.append((grid.max(axis=0) / grid.min(axis=0)).max())
    assert 10 < min(falls) < 11 and round(max(moves), 1) == 2.7, (falls, moves)
    # review 7: the next initializations break it; the chapter says so for seed 7
    grid = ch1.bn_error_grid((2, 4, 8, 16), (2, 4, 8, 16, 32, 64), digits.x_train, digits.y_train, seed=7)
    assert grid[0, 1] > grid[0, 0], grid  # K = 2: larger at b = 4 than at b = 2
    assert round(float((grid[:, 0] / grid[:, -1]).min()), 1) == 6.8, grid


def test_microbatch_effect(digits):
    e = ch1.microbatch_effect(1, 16, digits.x_train, digits.y_train)
    assert all(v == 0.0 for v in e.rel_error.values())
    e = ch1.microbatch_effect(4, 4, digits.x_train, digits.y_train)
    assert e.rel_error["batch"] > 0.3 and e.rel_error["group"] < 1e-12 and e.rel_error["layer"] < 1e-12
    assert 0.4 < e.rel_mean_std < 0.6  # ≈ 1/√4 with the finite-population correction
    with pytest.raises(ValueError, match="exceeds"):
        ch1.microbatch_effect(32, 64, digits.x_train, digits.y_train)
    with pytest.raises(ValueError, match="b >= 2"):
        ch1.microbatch_effect(4, 1, digits.x_train, digits.y_train)


@pytest.mark.slow
def test_run_fingerprint_in_two_processes_gives_the_runs_one_after_the_other(digits):
    """The chapter runs its table in two spawned processes: the same runs, to the bit (b = 2 included, whose
    digits are chaotic), in the same order."""
    plan = {"batch": (2,), "group": (64,)}
    one = ch1.run_fingerprint(digits, plan, seeds=(1,), epochs=1)
    two = ch1.run_fingerprint(digits, plan, seeds=(1,), epochs=1, workers=2)
    assert one == two and [(r.norm, r.b, r.seed) for r in two] == [("batch", 2, 1), ("group", 64, 1)]
    with pytest.raises(ValueError, match="does not divide"):  # refused before any process starts
        ch1.run_fingerprint(digits, {"batch": (64, 6)}, seeds=(0,), epochs=1, workers=2)


def test_run_fingerprint_small(digits):
    runs = ch1.run_fingerprint(digits, {"batch": (64, 8), "group": (8,)}, seeds=(0,), epochs=1)
    assert [(r.norm, r.b, r.k, r.steps) for r in runs] == [
        ("batch", 64, 1, 19),
        ("batch", 8, 8, 19),
        ("group", 8, 8, 19),
    ]
    table = ch1.summarize_fingerprint(runs)
    assert set(table) == {("batch", 64), ("batch", 8), ("group", 8)}
    assert table["group", 8]["gap"] == 0.0
    text = repr(ch1.format_fingerprint(table))
    assert text.count("\n") == 3 and "group" in text
    with pytest.raises(ValueError, match="does not divide"):
        ch1.run_fingerprint(digits, {"batch": (6,)}, seeds=(0,), epochs=1)
    with pytest.raises(ValueError, match="b >= 2"):
        ch1.run_fingerprint(digits, {"batch": (1,)}, seeds=(0,), epochs=1)


def test_figures_have_fixed_sizes(digits):
    import matplotlib

    matplotlib.use("Agg")
    fig = ch1.plot_microbatch_effect(2, 8, digits.x_train, digits.y_train)
    assert tuple(fig.get_size_inches()) == (9.6, 3.4)
    fig = ch1.plot_momentum_weights(0.1, 4)
    assert len(fig.axes[0].patches) == 12


def test_exercise_solutions_numbers():
    """Every number the chapter-1 exercise solutions state."""
    assert (1 - 0.05) ** 6 == pytest.approx(0.735, abs=5e-4) and bn_statistics.effective_momentum(
        0.05, 6
    ) == pytest.approx(0.265, abs=5e-4)
    assert bn_statistics.corrected_momentum(0.05, 6) == pytest.approx(0.0085124, abs=5e-8)
    assert 0.05 / 6 == pytest.approx(0.0083333, abs=5e-8)
    assert bn_statistics.biased_variance_factor(4) == 0.75
    assert bn_statistics.eval_train_mean_abs_ratio(4) == pytest.approx(0.92, abs=0.005)
    assert bn_statistics.eval_train_mean_abs_ratio(2) == pytest.approx(0.80, abs=0.005)
    assert bn_statistics.eval_train_mean_abs_ratio(2) == pytest.approx(
        math.sqrt(2 / math.pi), rel=1e-12
    )  # |z_train| = 1
    for b in (2, 4):
        rms_train, rms_eval, ratio = ch1.normalized_feature_sizes(b)
        assert rms_train == pytest.approx(1, abs=1e-6) and rms_eval == pytest.approx(1, abs=0.01)  # RMS 1 both
        assert ratio == pytest.approx(
            bn_statistics.eval_train_mean_abs_ratio(b), abs=0.01
        )  # the formula, by simulation
    # the old solution's claim, sqrt(3/4) ≈ 0.87 "as large in evaluation", is not what BatchNorm does:
    assert abs(ch1.normalized_feature_sizes(4)[1] / ch1.normalized_feature_sizes(4)[0] - math.sqrt(0.75)) > 0.1
    with pytest.raises(ValueError):
        bn_statistics.eval_train_mean_abs_ratio(1)


def test_layer_inputs_restores_every_modules_mode(digits):
    """Review: layer_inputs restored only the top-level mode, so a frozen BatchNorm came back in training mode."""
    model = make_cnn("batch", seed=0)
    model.features[1].eval()  # frozen inside a training model
    bn_statistics.layer_inputs(model, digits.x_train[:16], "head.1")
    assert model.training and not model.features[1].training


def test_momentum_none_is_a_cumulative_average_that_accumulation_does_not_speed_up():
    """Review: set_bn_momentum turned a momentum=None layer (a cumulative average) into an exponential one without
    a word. With momentum=None, K equal micro-batches leave the running mean equal to one full batch's."""
    torch.manual_seed(0)
    x = torch.randn(64, 6, dtype=torch.float64)
    full, micro = nn.BatchNorm1d(6, momentum=None).double(), nn.BatchNorm1d(6, momentum=None).double()
    full(x)
    for xb in x.chunk(8):
        micro(xb)
    assert torch.allclose(full.running_mean, micro.running_mean, atol=1e-15, rtol=0)
    model = nn.Sequential(
        nn.Linear(6, 6),
        nn.BatchNorm1d(6, momentum=None),
        nn.BatchNorm1d(6),
        nn.BatchNorm1d(6, track_running_stats=False),
    )
    with pytest.raises(ValueError, match="momentum=None"):
        bn_statistics.set_bn_momentum(model, 0.05)
    assert model[1].momentum is None and model[2].momentum == 0.1
    del model[1]
    assert bn_statistics.set_bn_momentum(model, 0.05) == 1 and model[1].momentum == 0.05


@pytest.mark.slow
def test_the_b2_collapse_is_the_heads_batchnorm1d_and_b16_ties_b64_on_other_seeds(digits):
    """Chapter 1's fingerprint claims beyond its seeds: without the head's BatchNorm1d (the layer that normalizes
    two values per channel at b = 2) the network trains at b = 2 (above 90%, against below 70% with it); and
    on seeds 3-5 b = 16 and b = 64 are within a point on average (b = 16 ahead by 0.3 points)."""
    from torch import nn

    from gradaccum.accumulate import train

    for seed in (0, 2):
        model = ch1.make_cnn("batch", seed=seed)
        model.head[1] = nn.Identity()
        r = train(
            model,
            digits.x_train,
            digits.y_train,
            digits.x_val,
            digits.y_val,
            batch_size=64,
            k=32,
            epochs=8,
            lr=0.05,
            seed=seed,
        )
        assert r.val_acc > 0.9, (seed, r.val_acc)
    runs = ch1.run_fingerprint(digits, {"batch": (64, 16)}, seeds=(3, 4, 5))
    mean = {b: sum(r.val_acc for r in runs if r.b == b) / 3 for b in (64, 16)}
    assert 0.0025 <= mean[16] - mean[64] < 0.0035 and mean[64] > 0.97, mean  # "within a point", "by 0.3"
    spread = min(max(r.val_acc for r in runs if r.b == b) - min(r.val_acc for r in runs if r.b == b) for b in (64, 16))
    assert mean[16] - mean[64] < spread, (mean, spread)  # "less than the seeds' spread"


def test_statistics_tools_refuse_what_they_cannot_measure():
    """Found by review: b = 1 crashed a grader with ZeroDivisionError; moment_spread returned inf or NaN."""
    from gradaccum.book import exercises

    with pytest.raises(ValueError, match="b must be an int >= 2"):
        exercises.grade_biased_variance_ratio(0.5, b=1)
    feats = torch.randn(10, 3, dtype=torch.float64)
    for kwargs, message in ((dict(b=10), "below the 10"), (dict(b=2, draws=1), "draws"), (dict(b=2, draws=0), "draws")):
        with pytest.raises(ValueError, match=message):
            ch1.moment_spread(feats, **kwargs)
    with pytest.raises(ValueError, match="constant"):
        ch1.moment_spread(torch.ones(10, 3), 2)
    with pytest.raises(ValueError, match="NaN"):
        ch1.moment_spread(torch.full((10, 3), float("nan")), 2)
    with pytest.raises(ValueError, match="draws"):
        ch1.normalized_feature_sizes(2, draws=0)


def test_agreement_is_exact_for_tiny_gradients_and_refuses_what_it_cannot_compare():
    """Found by review: cosine_similarity's 1e-8 clamp gave identical vectors of norm 1e-9 a cosine of 0.01."""
    from gradaccum.accumulate import agreement

    for scale in (1e-9, 1e-12, 1e-200):
        g = torch.randn(50, dtype=torch.float64) * scale
        same = agreement(g, g.clone())
        assert same.rel_error == 0.0 and same.cosine == pytest.approx(1.0, abs=1e-15)
    tiny = torch.randn(50) * 1e-30  # float32: the squared norm underflows without scaling
    assert agreement(tiny, 2 * tiny).cosine == pytest.approx(1.0) and agreement(tiny, 2 * tiny).rel_error == 1.0
    assert agreement(torch.ones(3), torch.zeros(3)).cosine == 0.0
    for bad, message in (
        (torch.ones(2, 3), "flat"),
        (torch.tensor([1.0, float("nan")]), "NaN"),
        (torch.tensor([1.0, float("inf")]), "inf"),
    ):
        with pytest.raises(ValueError, match=message):
            agreement(bad, bad)
    with pytest.raises(ValueError, match="zero"):
        agreement(torch.zeros(3), torch.ones(3))


def test_chapter_1_tools_stay_exact_at_the_extremes_and_refuse_what_has_no_answer():
    """Third review of chapter 1: agreement's cosine of parallel vectors 1e600 apart came out -1 or 0, the momentum
    formulas cancelled to 0 for tiny momenta and passed NumPy float32 through, predicted_mean_variance raised
    TypeError/RuntimeError, batch_moments returned NaN, accuracy divided by zero, an empty batch gave a zero
    gradient, and grade_batch_coupled crashed on layer classes."""
    from gradaccum.accumulate import accumulated_gradient, accuracy, agreement
    from gradaccum.book import exercises as ex

    d = torch.float64
    assert agreement(torch.tensor([1e300], dtype=d), torch.tensor([1e-300], dtype=d)).cosine == 1.0
    with pytest.raises(ValueError, match="not comparable"):
        agreement(torch.tensor([1e-300], dtype=d), torch.tensor([1e300], dtype=d))
    assert bn_statistics.corrected_momentum(1e-16, 2) == pytest.approx(5e-17, rel=1e-12)
    assert bn_statistics.effective_momentum(1e-20, 8) == pytest.approx(8e-20, rel=1e-12)
    assert type(bn_statistics.corrected_momentum(np.float32(0.1), 8)) is float
    assert bn_statistics.effective_momentum(0.1, 8) == pytest.approx(1 - 0.9**8, rel=1e-14)
    assert [float(v) for v in bn_statistics.predicted_mean_variance(1.0, [2, 4], 100)] == pytest.approx(
        [49 / 99, 24 / 99]
    )
    for args in (("1", 2, 100), (torch.ones(3), torch.tensor([2, 4]), 100)):
        with pytest.raises(ValueError, match="broadcast"):
            bn_statistics.predicted_mean_variance(*args)
    with pytest.raises(ValueError, match="inf or NaN"):
        bn_statistics.batch_moments(torch.tensor([[1.0, float("nan")], [2.0, 3.0]]))
    with pytest.raises(ValueError, match="exceeds"):
        accuracy(nn.Linear(3, 2), torch.randn(10, 3), torch.zeros(10, dtype=torch.long), batch_size=1000)
    with pytest.raises(ValueError, match="empty"):
        accumulated_gradient(
            nn.Linear(3, 2).double(),
            nn.CrossEntropyLoss(),
            torch.zeros(0, 3, dtype=d),
            torch.zeros(0, dtype=torch.long),
            2,
        )
    assert "'BatchNorm2d'" in ex.grade_batch_coupled({nn.BatchNorm2d, nn.Linear}).message


def test_numpy_sizes_non_modules_and_fractional_counts_are_refused_with_advice():
    """A NumPy b, a model that is not a module, fractional epochs and float batch sizes raised TypeError or
    AttributeError (or were refused without the NumPy hint); now ValueErrors that say what to pass."""
    from gradaccum.accumulate import train
    from gradaccum.bn_statistics import biased_variance_factor, set_bn_momentum

    with pytest.raises(ValueError, match=r"NumPy integer: pass int"):
        biased_variance_factor(np.int64(4))
    with pytest.raises(ValueError, match="must be an nn.Module"):
        set_bn_momentum("abc", 0.1)
    data = (torch.randn(8, 2), torch.zeros(8, dtype=torch.long), torch.randn(4, 2), torch.zeros(4, dtype=torch.long))
    for kwargs, match in (
        ({"batch_size": 4, "epochs": 1.5}, "epochs"),
        ({"batch_size": 4.0, "epochs": 1}, "batch_size"),
        ({"batch_size": 4, "epochs": 1, "seed": 0.5}, "seed"),
    ):
        with pytest.raises(ValueError, match=match):
            train(nn.Linear(2, 2), *data, k=2, **kwargs)


def test_tools_take_keyword_inputs_numpy_scalars_and_refuse_complex():
    """Review: layer_inputs raised IndexError for a layer called with a keyword input; agreement took complex
    tensors (dropping the imaginary part: relative error 0 for [1+1j, 2] against [1-1j, 2]) and bool ones;
    NumPy momenta leaked into results and layers; predicted_mean_variance refused n=np.int64."""
    from gradaccum.accumulate import agreement

    class Keyword(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(3, 3)

        def forward(self, x):
            return self.layer(input=x)

    class Attention(nn.Module):
        def forward(self, query, key, value):
            return query + key + value

    class Several(nn.Module):
        def __init__(self):
            super().__init__()
            self.att = Attention()

        def forward(self, x):
            zero = torch.zeros_like(x)
            return self.att(key=zero, query=x, value=zero)

    x = torch.randn(2, 3)
    assert torch.equal(bn_statistics.layer_inputs(Keyword(), x, "layer"), x)
    assert torch.equal(bn_statistics.layer_inputs(Several(), x, "att"), x)  # the first parameter, by name
    for g_ref, g in (
        (torch.tensor([1 + 1j, 2]), torch.tensor([1 - 1j, 2])),
        (torch.tensor([True, False]), torch.tensor([True, True])),
    ):
        with pytest.raises(ValueError, match="real"):
            agreement(g_ref, g)
    weights = bn_statistics.micro_batch_weights(np.float32(0.1), 2)
    assert all(type(w) is float for w in weights)
    model = nn.Sequential(nn.BatchNorm1d(2))
    bn_statistics.set_bn_momentum(model, np.float32(0.05))
    assert type(model[0].momentum) is float
    assert bn_statistics.predicted_mean_variance(1.0, 2, np.int64(10)) == pytest.approx(4 / 9)
    for b in (np.int8(64), np.uint8(64)):  # wrapped around, or overflowed, in the comparisons with n
        assert bn_statistics.predicted_mean_variance(1.0, b, 1221) == pytest.approx((1221 - 64) / (64 * 1220))
    for sigma2 in (True, 1 + 1j):
        with pytest.raises(ValueError, match="numbers"):
            bn_statistics.predicted_mean_variance(sigma2, 2, 10)


def test_graders_name_percentages_and_cut_off_digits():
    """Review: a percentage (26.5) and an answer cut off instead of rounded (0.264) got only the generic hint."""
    from gradaccum.book import exercises

    percent = exercises.grade_effective_momentum(26.5)
    assert not percent.correct and "percentage" in percent.message and "0.265" in percent.message
    cut = exercises.grade_effective_momentum(0.264)
    assert not cut.correct and "round it to the nearest" in cut.message
    assert exercises.grade_effective_momentum(0.265).correct
    assert "not right" in exercises.grade_effective_momentum(0.5).message
    for value in (0.28, 0.56):  # 0.29 * 100 is 28.999...: no cut-off digits seen in a plain wrong answer
        assert "cuts the answer off" not in exercises.grade_number(value, value + 0.01, digits=2).message


def test_tools_refuse_frozen_models_arrays_and_integer_gradients():
    """Fifth review: a frozen model gave torch's RuntimeError, NumPy inputs a TypeError or AttributeError, and
    agreement compared integer tensors without a word; each is a ValueError that says what to pass."""
    frozen = nn.Linear(3, 2).requires_grad_(False)
    cases = [
        (
            lambda: accumulate.accumulated_gradient(frozen, nn.MSELoss(), torch.zeros(4, 3), torch.zeros(4, 2), 2),
            "trainable",
        ),
        (
            lambda: accumulate.accumulated_gradient(
                nn.Linear(3, 2), nn.MSELoss(), np.zeros((4, 3)), torch.zeros(4, 2), 2
            ),
            "torch.as_tensor",
        ),
        (lambda: ch1.moment_spread(np.zeros((10, 3)), 2), "torch.as_tensor"),
        (lambda: accumulate.agreement(torch.tensor([1, 2, 3]), torch.tensor([1, 2, 4])), "floating-point"),
        (lambda: accumulate.agreement(torch.ones(3, device="meta"), torch.ones(3, device="meta")), "meta"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()


def test_conv_batchnorm_variance_factor_matches_a_simulation(digits):
    """Chapter 1: a convolutional BatchNorm's expected biased variance is 1 − Var(m_i)/(b σ²) of σ² (m_i an image's
    mean over its positions; here with the finite-population factor of drawing images without replacement):
    never below (b − 1)/b. Checked on the SmallCNN's first BatchNorm2d, by simulation."""
    model = make_cnn("batch", seed=0)
    f = bn_statistics.layer_inputs(model, digits.x_train, "features.1").double().flatten(2)  # (n, C, P)
    n, c = f.shape[0], f.shape[1]
    sigma2 = f.transpose(0, 1).reshape(c, -1).var(1, correction=0)
    var_m = f.mean(2).var(0, correction=0)
    gen = torch.Generator().manual_seed(1)
    for b in (2, 4):
        predicted = 1 - var_m / sigma2 * (1 - (b - 1) * n / (b * (n - 1)))
        picked = torch.rand(5000, n, generator=gen).topk(b).indices
        biased = f[picked].transpose(1, 2).reshape(5000, c, -1).var(2, correction=0)
        measured = biased.mean(0) / sigma2
        assert float((measured - predicted).abs().max()) < 0.005, (measured, predicted)
        assert bool((predicted >= (b - 1) / b).all()) and float(predicted.min()) > 0.98


def test_small_integer_sizes_are_widened_and_numpy_data_or_bad_rates_refused(digits):
    """predicted_mean_variance wrapped n − b in a uint8 tensor (300 − 2 = 42) and overflowed in a NumPy int8
    array; microbatch_effect took NumPy arrays and float labels to torch's own errors; train() trained with a NaN
    learning rate or momentum 1.5."""
    right = 0.5 * 298 / 299
    got = bn_statistics.predicted_mean_variance(1.0, torch.tensor([2, 64], dtype=torch.uint8), 300)
    assert float(got[0]) == pytest.approx(right)
    got = bn_statistics.predicted_mean_variance(1.0, np.array([2, 64], dtype=np.int8), 1221)
    assert float(got[0]) == pytest.approx(0.5 * 1219 / 1220)
    with pytest.raises(ValueError, match="torch.as_tensor"):
        ch1.microbatch_effect(2, 8, digits.x_train.numpy(), digits.y_train.numpy())
    with pytest.raises(ValueError, match="y.long"):
        ch1.microbatch_effect(2, 8, digits.x_train, digits.y_train.double())
    model = make_cnn("group", seed=0)
    for kwargs, match in (
        (dict(lr=float("nan")), "lr"),
        (dict(momentum=1.5), "momentum"),
        (dict(momentum=-0.1), "momentum"),
    ):
        with pytest.raises(ValueError, match=match):
            accumulate.train(
                model,
                digits.x_train,
                digits.y_train,
                digits.x_val,
                digits.y_val,
                batch_size=64,
                k=2,
                epochs=1,
                **kwargs,
            )
