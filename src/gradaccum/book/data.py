"""Real data for the book's experiments: scikit-learn's bundled handwritten digits (no download).

The digits set holds 1,797 greyscale images of 8×8 pixels with values 0–16, labelled 0–9 (a copy of the
UCI "Optical Recognition of Handwritten Digits" test set that ships inside scikit-learn).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources

import numpy as np
import torch

from gradaccum.windows import IGNORE


@dataclass(frozen=True)
class DigitsSplit:
    """A stratified train/validation split of the digits, as tensors of shape (N, 1, 8, 8) in [0, 1]."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor

    def to(self, device: torch.device | str) -> DigitsSplit:
        """The same split on another device."""
        return DigitsSplit(*(t.to(device) for t in (self.x_train, self.y_train, self.x_val, self.y_val)))


def load_digits_split(
    val_size: int = 576,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str = "cpu",
) -> DigitsSplit:
    """Load the digits, scale pixels to [0, 1] (divide by 16) and split them, stratified by label.

    Args:
        val_size: number of the 1,797 images held out for validation. The default, 576 = 9·64, is divisible
            by every micro-batch size the book uses, so that a validation set evaluated in micro-batches of b
            uses every image.
        seed: seed of the split (the same seed always gives the same split).
        dtype: floating-point type of the images (labels are int64).
        device: where the tensors live.
    """
    if not 10 <= val_size <= 1797 - 10:
        raise ValueError(f"val_size must be between 10 and 1787 images, got {val_size}; the default is 576.")
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point type such as torch.float64, got {dtype}.")
    # scikit-learn only here: a study's worker processes import this module for flat_digits, not sklearn (1-2 s)
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x_tr, x_va, y_tr, y_va = train_test_split(
        digits.images / 16.0, digits.target, test_size=val_size, random_state=seed, stratify=digits.target
    )

    def images(a):  # (N, 8, 8) -> (N, 1, 8, 8)
        return torch.as_tensor(a, dtype=dtype, device=device).unsqueeze(1)

    def labels(a):
        return torch.as_tensor(a, dtype=torch.int64, device=device)

    return DigitsSplit(images(x_tr), labels(y_tr), images(x_va), labels(y_va))


def flat_digits(x: torch.Tensor) -> torch.Tensor:
    """The 8×8 digits as 64 features (float64)."""
    return x.reshape(len(x), -1).double()


def load_corpus() -> list[str]:
    """The lines of the text shipped with the package (the Zen of Python and sentences of the book's
    introduction), 52 lines of 19 to 157 characters."""
    text = resources.files("gradaccum.book").joinpath("corpus.txt").read_text(encoding="utf-8")
    return [line for line in text.splitlines() if line and not line.startswith("#")]


@dataclass(frozen=True)
class Vocab:
    """Characters ↔ ids; id 0 is padding."""

    chars: str

    def encode(self, line: str) -> list[int]:
        return [self.chars.index(c) + 1 for c in line]

    @property
    def size(self) -> int:
        return len(self.chars) + 1


def make_vocab(lines: Sequence[str]) -> Vocab:
    return Vocab("".join(sorted(set("".join(lines)))))


def encode_batch(lines: Sequence[str], vocab: Vocab) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-character targets, right-padded to the longest line; padding targets are ``IGNORE``."""
    if not lines:
        raise ValueError("need at least one line.")
    width = max(len(line) for line in lines) - 1
    if width < 1:
        raise ValueError("every line needs at least two characters.")
    x = torch.zeros(len(lines), width, dtype=torch.long)
    y = torch.full((len(lines), width), IGNORE, dtype=torch.long)
    for i, line in enumerate(lines):
        ids = torch.tensor(vocab.encode(line))
        x[i, : len(ids) - 1] = ids[:-1]
        y[i, : len(ids) - 1] = ids[1:]
    return x, y


def spread_lines(
    lines: Sequence[str], n: int, center: int, spread: int, seed: int = 0, sort: bool = False
) -> list[str]:
    """n lines cut to lengths drawn uniformly from [center − spread, center + spread] (sorted by length if
    ``sort``, which makes micro-batches of similar length, as length-grouped batching does)."""
    if not 0 <= spread < center:
        raise ValueError(f"need 0 <= spread < center, got spread={spread}, center={center}.")
    long = [line for line in lines if len(line) >= center + spread]
    if not long:
        raise ValueError(f"no line is {center + spread} characters long; lower center or spread.")
    rng = np.random.default_rng(seed)
    lengths = rng.integers(center - spread, center + spread + 1, size=n)
    picks = rng.integers(0, len(long), size=n)
    cut = [long[p][:length] for p, length in zip(picks, lengths)]
    return sorted(cut, key=len) if sort else cut
