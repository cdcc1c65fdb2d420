import copy

import pytest
import torch

from gradaccum._validate import require_k
from gradaccum.accumulate import (
    accumulated_gradient,
    accuracy,
    agreement,
    flat_grad,
    full_batch_gradient,
    split_batch,
    train,
)
from gradaccum.book.models import make_cnn


def test_split_batch_equal_consecutive_parts():
    x, y = torch.arange(12.0).reshape(12, 1), torch.arange(12)
    parts = split_batch(x, y, 3)
    assert [p[1].tolist() for p in parts] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


@pytest.mark.parametrize("k", [0, -1, 2.0, True, "4"])
def test_bad_k(k):
    with pytest.raises(ValueError, match="K"):
        require_k(k)


def test_indivisible_batch_says_what_to_do():
    with pytest.raises(ValueError, match="divisors of 10"):
        split_batch(torch.zeros(10, 1), torch.zeros(10), 4)


def test_mismatched_inputs():
    with pytest.raises(ValueError, match="matching"):
        split_batch(torch.zeros(8, 1), torch.zeros(6), 2)


@pytest.mark.parametrize("norm", ["group", "layer", "none"])
@pytest.mark.parametrize("k", [2, 4, 16])
def test_equivalence_theorem_holds_without_batchnorm(norm, k, digits, loss_fn):
    model = make_cnn(norm).train()
    x, y = digits.x_train[:64], digits.y_train[:64]
    a = agreement(full_batch_gradient(model, loss_fn, x, y), accumulated_gradient(model, loss_fn, x, y, k))
    assert a.rel_error < 1e-12 and a.cosine > 1 - 1e-12


def test_equivalence_fails_with_batchnorm(digits, loss_fn):
    model = make_cnn("batch").train()
    x, y = digits.x_train[:64], digits.y_train[:64]
    g = full_batch_gradient(model, loss_fn, x, y)
    assert agreement(g, accumulated_gradient(model, loss_fn, x, y, 1)).rel_error == 0.0
    assert agreement(g, accumulated_gradient(model, loss_fn, x, y, 8)).rel_error > 0.1


def test_batchnorm_in_eval_mode_is_exact(digits, loss_fn):
    """In eval mode BatchNorm uses fixed running statistics: per-sample again, so the theorem holds."""
    model = make_cnn("batch").eval()
    x, y = digits.x_train[:32], digits.y_train[:32]
    a = agreement(full_batch_gradient(model, loss_fn, x, y), accumulated_gradient(model, loss_fn, x, y, 8))
    assert a.rel_error < 1e-12


def test_gradient_helpers_leave_the_model_untouched(digits, loss_fn):
    model = make_cnn("batch").train()
    before = copy.deepcopy(model.state_dict())
    accumulated_gradient(model, loss_fn, digits.x_train[:16], digits.y_train[:16], 4)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # running stats included
    assert all(p.grad is None for p in model.parameters())


def test_flat_grad_zero_fills_missing():
    model = torch.nn.Linear(3, 2)
    assert torch.equal(flat_grad(model), torch.zeros(8))


def test_agreement_values_and_errors():
    a = agreement(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]))
    assert a.rel_error == pytest.approx(2**0.5) and a.cosine == pytest.approx(0.0)
    with pytest.raises(ValueError, match="zero"):
        agreement(torch.zeros(2), torch.ones(2))
    with pytest.raises(ValueError, match="shapes"):
        agreement(torch.ones(2), torch.ones(3))


def test_accuracy_uses_whole_chunks():
    model = torch.nn.Linear(2, 2)
    with torch.no_grad():
        model.weight.copy_(torch.eye(2))
        model.bias.zero_()
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    y = torch.tensor([0, 1, 1])
    assert accuracy(model, x, y) == pytest.approx(2 / 3)
    assert accuracy(model, x, y, batch_size=2) == 1.0  # the incomplete last chunk is left out
    with pytest.raises(ValueError):
        accuracy(model, x, y, batch_size=0)


def test_train_is_deterministic_and_learns(digits):
    kwargs = dict(batch_size=64, k=4, epochs=2, seed=0)
    args = (digits.x_train, digits.y_train, digits.x_val, digits.y_val)
    r1 = train(make_cnn("group"), *args, **kwargs)
    r2 = train(make_cnn("group"), *args, **kwargs)
    assert r1.optimizer_steps == 2 * (1221 // 64) and r1.micro_batch == 16
    assert r1.train_loss == r2.train_loss and r1.val_acc == r2.val_acc
    assert r1.val_acc > 0.8 and r1.train_loss[-1] < r1.train_loss[0]
    assert r1.train_eval_gap == 0.0  # GroupNorm: the same function in both modes


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"batch_size": 64, "k": 3, "epochs": 1}, "multiple of K"),
        ({"batch_size": 64, "k": 2, "epochs": 0}, "epochs"),
        ({"batch_size": 4096, "k": 2, "epochs": 1}, "exceeds"),
    ],
)
def test_train_bad_arguments(kwargs, match, digits):
    with pytest.raises(ValueError, match=match):
        train(make_cnn("none"), digits.x_train, digits.y_train, digits.x_val, digits.y_val, **kwargs)
