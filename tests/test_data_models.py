import pytest
import torch

from gradaccum.book.data import load_digits_split
from gradaccum.book.models import (
    NORM_KINDS,
    SmallCNN,
    batch_coupled_layers,
    make_cnn,
    norm_layer,
)


def test_digits_split_shapes_ranges_and_balance(digits):
    assert digits.x_train.shape == (1221, 1, 8, 8) and digits.x_val.shape == (576, 1, 8, 8)
    assert digits.x_train.dtype == torch.float64 and digits.y_train.dtype == torch.int64
    assert digits.x_train.min() >= 0 and digits.x_train.max() <= 1
    counts = torch.bincount(digits.y_val, minlength=10)
    assert counts.min() >= 55 and counts.max() <= 60  # stratified: about 57.6 per class


def test_digits_split_is_deterministic(digits):
    again = load_digits_split()
    assert torch.equal(again.x_val, digits.x_val) and torch.equal(again.y_train, digits.y_train)
    assert not torch.equal(load_digits_split(seed=1).y_val, digits.y_val)


@pytest.mark.parametrize("kwargs", [{"val_size": 0}, {"val_size": 1797}, {"dtype": torch.int64}])
def test_digits_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        load_digits_split(**kwargs)


@pytest.mark.parametrize("norm", NORM_KINDS)
def test_small_cnn_forward(norm, digits):
    model = make_cnn(norm)
    out = model(digits.x_train[:5])
    assert out.shape == (5, 10) and out.dtype == torch.float64


def test_make_cnn_ignores_global_rng():
    torch.manual_seed(123)
    a = make_cnn("batch", seed=7)
    torch.rand(10)
    b = make_cnn("batch", seed=7)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    c = make_cnn("batch", seed=8)
    assert not all(torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters()))


def test_batch_coupled_layers():
    assert batch_coupled_layers(make_cnn("batch")) == ["features.1", "features.5", "head.1"]
    for norm in ("group", "layer", "none"):
        assert batch_coupled_layers(make_cnn(norm)) == []


def test_norm_layer_errors():
    with pytest.raises(ValueError, match="unknown norm"):
        norm_layer("instance", 8)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="divisible by groups"):
        norm_layer("group", 6)
    with pytest.raises(ValueError, match="dims"):
        norm_layer("batch", 8, dims=3)


def test_wrong_image_shape_is_explained():
    with pytest.raises(ValueError, match=r"\(N, 1, 8, 8\)"):
        SmallCNN()(torch.zeros(2, 3, 8, 8))
