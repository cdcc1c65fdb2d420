"""Real data for the book's experiments: scikit-learn's bundled handwritten digits (no download).

The digits set holds 1,797 greyscale images of 8×8 pixels with values 0–16, labelled 0–9 (a copy of the
UCI "Optical Recognition of Handwritten Digits" test set that ships inside scikit-learn).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split


@dataclass(frozen=True)
class DigitsSplit:
    """A stratified train/validation split of the digits, as tensors of shape (N, 1, 8, 8) in [0, 1]."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor

    def to(self, device: torch.device | str) -> "DigitsSplit":
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
    digits = load_digits()
    x_tr, x_va, y_tr, y_va = train_test_split(
        digits.images / 16.0, digits.target, test_size=val_size, random_state=seed, stratify=digits.target
    )

    def images(a):  # (N, 8, 8) -> (N, 1, 8, 8)
        return torch.as_tensor(a, dtype=dtype, device=device).unsqueeze(1)

    def labels(a):
        return torch.as_tensor(a, dtype=torch.int64, device=device)

    return DigitsSplit(images(x_tr), labels(y_tr), images(x_va), labels(y_va))
