"""gradaccum._tensors: the one copy of each tensor helper (cutting a batch, reading gradients, the relative error,
clipping a vector) does what torch and the book's definitions say."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradaccum import _tensors


def test_micro_batches_are_consecutive_equal_views():
    x, y = torch.arange(24.0).reshape(12, 2), torch.arange(12)
    parts = _tensors.micro_batches(x, y, 4)
    assert len(parts) == 4 and all(isinstance(p, tuple) and len(p) == 2 for p in parts)
    for j, (xb, yb) in enumerate(parts):
        assert torch.equal(xb, x[3 * j : 3 * j + 3]) and torch.equal(yb, y[3 * j : 3 * j + 3])
        assert xb.data_ptr() == x[3 * j :].data_ptr()  # a view, no copy
    three = _tensors.split_tensors((x, y, y * 2), 3)
    assert [len(t) for t in three] == [3, 3, 3] and torch.equal(three[2][2], (y * 2)[8:])


def test_flat_grads_zero_fills_and_reads_in_float64_on_request():
    net = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1)).half()
    net(torch.ones(4, 3, dtype=torch.float16)).sum().backward()
    net[1].bias.grad = None
    native = _tensors.flat_grads(net.parameters())
    assert native.dtype == torch.float16 and native.numel() == 3 * 2 + 2 + 2 + 1 and float(native[-1]) == 0.0
    wide = _tensors.flat_grads(net.parameters(), float64=True)
    assert wide.dtype == torch.float64 and not wide.requires_grad and torch.equal(wide, native.double())


def test_relative_error_is_float64_and_absolute_against_zero():
    a, b = torch.tensor([3.0, 4.0]), torch.tensor([0.0, 4.0])
    assert _tensors.relative_error(a, b) == pytest.approx(3 / 4)
    assert _tensors.relative_error(b, torch.zeros(2)) == pytest.approx(4.0)  # no scale: the absolute difference
    tiny = torch.tensor([1e-30, 0.0], dtype=torch.float32)
    assert _tensors.relative_error(tiny * 2, tiny) == pytest.approx(1.0)  # float32 squares would underflow


@pytest.mark.parametrize("c", [0.1, 1.0, 100.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_clip_vector_is_torch_clip_grad_norm_and_value(c, dtype):
    v = torch.linspace(-2, 3, 7, dtype=dtype)
    p = nn.Parameter(torch.zeros(7, dtype=dtype))
    p.grad = v.clone()
    torch.nn.utils.clip_grad_norm_([p], c)
    assert torch.equal(_tensors.clip_vector(v, c), p.grad)
    p.grad = v.clone()
    torch.nn.utils.clip_grad_value_([p], c)
    assert torch.equal(_tensors.clip_vector(v, c, "value"), p.grad)
    one = _tensors.clip_vector(v, c, norm_type=1.0)
    assert float(one.abs().sum()) == pytest.approx(min(float(v.abs().sum()), c), rel=1e-5)
