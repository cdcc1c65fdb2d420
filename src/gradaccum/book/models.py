"""Small models used across the book, with the normalization layer as a parameter.

The same architecture with ``norm="batch"``, ``"group"``, ``"layer"`` or ``"none"`` lets a chapter change
*only* the normalization and measure what that alone does under gradient accumulation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch
import torch.fx
import torch.nn.functional as F

if TYPE_CHECKING:  # models must not load scikit-learn (the DDP workers import this module)
    from gradaccum.book.data import Vocab
from torch import nn

NormKind = Literal["batch", "group", "layer", "none"]

NORM_KINDS: tuple[str, ...] = ("batch", "group", "layer", "none")

#: Modules whose output for one sample depends on the other samples of the batch (in training mode).
BATCH_COUPLED = (nn.modules.batchnorm._BatchNorm,)


def norm_layer(kind: NormKind, channels: int, dims: int = 2, groups: int = 4) -> nn.Module:
    """A normalization layer for ``channels`` feature maps (``dims=2``) or features (``dims=1``).

    * ``batch``: :class:`torch.nn.BatchNorm2d` / ``BatchNorm1d``; statistics per channel over the batch
      (and height and width), so a sample's output depends on the other samples of its batch;
    * ``group``: :class:`torch.nn.GroupNorm` with ``groups`` groups, statistics per sample;
    * ``layer``: ``GroupNorm(1, channels)``, LayerNorm over all of a sample's channels (and positions),
      with a per-channel affine transform;
    * ``none``: identity.
    """
    if dims not in (1, 2):
        raise ValueError(f"dims must be 1 (features) or 2 (feature maps), got {dims}.")
    if kind == "batch":
        return nn.BatchNorm2d(channels) if dims == 2 else nn.BatchNorm1d(channels)
    if kind == "group":
        if channels % groups:
            raise ValueError(f"GroupNorm needs channels ({channels}) divisible by groups ({groups}).")
        return nn.GroupNorm(groups, channels)
    if kind == "layer":
        return nn.GroupNorm(1, channels)
    if kind == "none":
        return nn.Identity()
    raise ValueError(f"unknown norm {kind!r}; choose one of {NORM_KINDS}.")


@torch.fx.wrap  # one node of a torch.fx trace (the cached full-batch scheme traces models), still run as a check
def _check_images(x: torch.Tensor) -> None:
    if x.dim() != 4 or tuple(x.shape[1:]) != (1, 8, 8):
        raise ValueError(f"SmallCNN expects images of shape (N, 1, 8, 8), got {tuple(x.shape)}.")


class SmallCNN(nn.Module):
    """A small CNN for 1×8×8 digit images with the normalization layer as a parameter.

    ``conv3×3(1→c1) → norm → ReLU → pool → conv3×3(c1→c2) → norm → ReLU → pool → linear(4·c2→h) → norm →
    ReLU → linear(h→10)``. Pooling halves the resolution (8×8 → 4×4 → 2×2), as late stages of real CNNs
    work on few positions; the hidden layer of the head is normalized per feature (``BatchNorm1d`` when
    ``norm="batch"``), so there a BatchNorm statistic is computed from just b numbers.
    """

    def __init__(self, norm: NormKind = "batch", widths: tuple[int, int, int] = (8, 16, 32), n_classes: int = 10):
        super().__init__()
        c1, c2, h = widths
        self.features = nn.Sequential(
            nn.Conv2d(1, c1, 3, padding=1, bias=False),
            norm_layer(norm, c1),
            nn.ReLU(),
            nn.AvgPool2d(2),
            nn.Conv2d(c1, c2, 3, padding=1, bias=False),
            norm_layer(norm, c2),
            nn.ReLU(),
            nn.AvgPool2d(2),
            nn.Flatten(),
        )
        self.head = nn.Sequential(
            nn.Linear(4 * c2, h, bias=False),
            norm_layer(norm, h, dims=1),
            nn.ReLU(),
            nn.Linear(h, n_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_images(x)
        return self.head(self.features(x))


def make_cnn(
    norm: NormKind = "batch",
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str = "cpu",
    widths: tuple[int, int, int] = (8, 16, 32),
) -> SmallCNN:
    """A :class:`SmallCNN` whose initial weights depend only on ``seed`` (not on the global RNG state)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = SmallCNN(norm, widths)
    return model.to(device=device, dtype=dtype)


class NormMLP(nn.Sequential):
    """An MLP for the 8×8 digits with the normalization layer as a parameter, chapter 2's second network:

    ``flatten → linear(64→h1) → norm → ReLU → linear(h1→h2) → norm → ReLU → linear(h2→10)``. Every
    normalization is per feature (``BatchNorm1d`` when ``norm="batch"``), so a BatchNorm statistic comes from just
    b numbers at both hidden layers. It takes the images as SmallCNN does, (N, 1, 8, 8).
    """

    def __init__(self, norm: NormKind = "batch", widths: tuple[int, int] = (64, 32), n_classes: int = 10):
        h1, h2 = widths
        super().__init__(
            nn.Flatten(),
            nn.Linear(64, h1, bias=False),
            norm_layer(norm, h1, dims=1),
            nn.ReLU(),
            nn.Linear(h1, h2, bias=False),
            norm_layer(norm, h2, dims=1),
            nn.ReLU(),
            nn.Linear(h2, n_classes),
        )


def make_norm_mlp(
    norm: NormKind = "batch",
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str = "cpu",
    widths: tuple[int, int] = (64, 32),
) -> NormMLP:
    """A :class:`NormMLP` whose initial weights depend only on ``seed`` (not on the global RNG state)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = NormMLP(norm, widths)
    return model.to(device=device, dtype=dtype)


def batch_coupled_layers(model: nn.Module) -> list[str]:
    """Names of the submodules that couple the samples of a batch (BatchNorm of any dimension)."""
    return [name for name, m in model.named_modules() if isinstance(m, BATCH_COUPLED)]


class TinyLM(nn.Module):
    """A character model that predicts the next character from the last three (a causal convolution)."""

    def __init__(self, vocab_size: int, dim: int = 16, hidden: int = 64, context: int = 3):
        super().__init__()
        self.context = context
        self.embed = nn.Embedding(vocab_size, dim)
        self.conv = nn.Conv1d(dim, hidden, context)
        self.out = nn.Linear(hidden, vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x).transpose(1, 2)  # (N, dim, T)
        h = F.pad(h, (self.context - 1, 0))  # causal: position t sees t-2..t
        return self.out(torch.relu(self.conv(h)).transpose(1, 2))  # (N, T, vocab)


def make_lm(vocab: Vocab, seed: int = 0, dtype: torch.dtype = torch.float64) -> TinyLM:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TinyLM(vocab.size).to(dtype)


def dropout_mlp(layers: int, p: float = 0.3, hidden: int = 32, seed: int = 0) -> nn.Sequential:
    """An MLP for the 8×8 digits (float64) with ``layers`` = 1 or 2 dropout layers:
    Flatten → Linear(64, h) → ReLU → Dropout [→ Linear(h, h) → ReLU → Dropout] → Linear(h, 10).
    The weights depend only on ``seed``."""
    if layers not in (1, 2):
        raise ValueError(f"layers must be 1 or 2 (dropout layers in the MLP), got {layers!r}.")
    if not 0 < p < 1:
        raise ValueError(f"dropout probability must lie in (0, 1), got {p}.")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        mods: list[nn.Module] = [nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Dropout(p)]
        if layers == 2:
            mods += [nn.Linear(hidden, hidden), nn.ReLU(), nn.Dropout(p)]
        mods.append(nn.Linear(hidden, 10))
        return nn.Sequential(*mods).double().train()


def mlp(width: int, seed: int = 0) -> nn.Module:
    """A 3-layer MLP on the 64 pixels of a digit with hidden ``width`` (about width² + 74·width parameters)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(
            nn.Flatten(), nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)
        )
