"""PreciseBN over a DataLoader or any iterable of batches gives the statistics the tensor path gives (issue 39)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gradaccum.precise_bn import precise_bn


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 6), nn.BatchNorm1d(6)).double()


class _Keywords(nn.Module):
    """A model called with keyword arguments, as Hugging Face models are."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _model()

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        return self.net(pixel_values)


def _stats(model: nn.Module) -> list[torch.Tensor]:
    return [b.clone() for name, b in model.named_buffers() if "running" in name]


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(30, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (30,), generator=g)


def test_a_dataloader_gives_the_statistics_of_the_tensor_path():
    x, y = _data()
    by_tensor, by_loader, by_inputs_only = _model(), _model(), _model()
    precise_bn(by_tensor, x, 8)  # 30 samples: three batches of 8, the last 6 left out
    precise_bn(by_loader, DataLoader(TensorDataset(x, y), batch_size=8))  # (x, y) batches, a last batch of 6
    precise_bn(by_inputs_only, DataLoader(TensorDataset(x), batch_size=8), 8)  # [x] batches
    for a, b, c in zip(_stats(by_tensor), _stats(by_loader), _stats(by_inputs_only)):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert [m.momentum for m in by_loader.modules() if isinstance(m, nn.BatchNorm1d)] == [0.1, 0.1]
    before = _stats(_model())
    assert not torch.equal(before[0], _stats(by_loader)[0])  # the statistics were recomputed


def test_dict_batches_are_passed_as_keyword_arguments():
    x, y = _data()
    by_tensor, by_dicts = _model(), _Keywords()
    precise_bn(by_tensor, x, 10)
    precise_bn(by_dicts, [{"pixel_values": xb, "labels": yb} for xb, yb in zip(x.split(10), y.split(10))])
    for a, b in zip(_stats(by_tensor), _stats(by_dicts.net)):
        assert torch.equal(a, b)


def test_batches_of_another_size_are_refused_and_the_statistics_kept():
    x, _ = _data()
    model = _model()
    kept = _stats(model)
    with pytest.raises(ValueError, match="batch 1 holds 4 samples"):
        precise_bn(model, [x[:8], x[8:12], x[12:20]])
    assert all(torch.equal(a, b) for a, b in zip(kept, _stats(model)))
    assert [m.momentum for m in model.modules() if isinstance(m, nn.BatchNorm1d)] == [0.1, 0.1]
    for bad in ([], [x[:1]], [("not a tensor", 1)], [x[:8]] * 2 + [x[:9]]):
        with pytest.raises(ValueError):
            precise_bn(_model(), bad)
    with pytest.raises(ValueError, match="batch_size"):
        precise_bn(_model(), [x[:8]], 1)
    with pytest.raises(ValueError, match="as_tensor"):
        precise_bn(_model(), x.numpy(), 8)
