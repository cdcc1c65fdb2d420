import copy
import math

import pytest
import torch

from gradaccum import clipping
from gradaccum.accumulate import agreement, flat_grad, full_batch_gradient
from gradaccum.models import make_cnn


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
        grads = clipping.synthetic_micro_gradients(8, 0.3, norm=3.0, seed=seed)
        assert clipping.combine(grads, 1.0, "raw_micro").norm() <= 1 + 1e-9
        assert clipping.combine(grads, 1.0, "scaled_micro").norm() <= 8 + 1e-9
        assert clipping.combine(grads, 1.0, "once").norm() <= 1 + 1e-9


def test_running_weights_reconstruct_the_step():
    grads = clipping.synthetic_micro_gradients(6, 0.5, norm=2.0, seed=1)
    w = clipping.running_clip_weights(grads, 0.5)
    assert torch.allclose(sum(wi * g for wi, g in zip(w, grads)), clipping.combine(grads, 0.5, "running"), atol=1e-9)
    assert all(a <= b for a, b in zip(w, w[1:]))


def test_synthetic_alignment():
    assert clipping.mean_pairwise_cosine(clipping.synthetic_micro_gradients(6, 1.0)) == pytest.approx(1.0)
    assert abs(clipping.mean_pairwise_cosine(clipping.synthetic_micro_gradients(6, 0.5, dim=4096))) - 0.5 < 0.05
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
        clipping.synthetic_micro_gradients(2, 1.5)


def test_non_finite_gradients_name_the_parameter(setup_batch, loss_fn):
    model, x, y = setup_batch
    work = copy.deepcopy(model)
    bad_loss = lambda out, target: loss_fn(out, target) * float("inf")  # noqa: E731
    with pytest.raises(ValueError, match=r"parameter 'features\.0\.weight' contains (inf|NaN)"):
        clipping.clipped_accumulation(work, bad_loss, x, y, 2, 1.0, "once")


def test_train_placements_small(digits):
    runs = clipping.train_placements(digits, k=4, c=0.3, epochs=1, placements=("once", "scaled_micro"))
    by = {r.placement: r for r in runs}
    assert max(abs(a - b) for a, b in zip(by["once"].losses, by["full batch"].losses)) < 1e-10
    assert by["full batch"].k == 1 and by["scaled_micro"].k == 4


def test_widget_function_and_figures():
    import matplotlib

    matplotlib.use("Agg")
    rows = {r.placement: r for r in clipping.placement_effects(8, 0.125, 1.0)}
    assert rows["scaled_micro"].norm_over_c == pytest.approx(8, rel=1e-3) and rows["once"].cosine == pytest.approx(1)
    with pytest.raises(ValueError, match="threshold"):
        clipping.placement_effects(8, 0.0, 1.0)
    assert len(clipping.plot_placement_effects(4, 0.5, 0.5).axes) == 2
