r"""Floating-point formats and what a cast to one does: range and precision (:func:`format_info`), the values a
cast to fp16/bf16 loses (:func:`cast_report`), the largest power-of-two scale that still fits
(:func:`largest_fitting_log2`), and the rounding an accumulator of a given type adds to a sum of K
micro-gradients (:func:`accumulate_in`, :func:`accumulation_error`). Chapter 4 of the book.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch

from gradaccum import _tensors
from gradaccum._validate import require_vectors

LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class FormatInfo:
    """Range and precision of a floating-point format, from ``torch.finfo``."""

    name: str
    max: float
    smallest_normal: float
    smallest_subnormal: float
    eps: float
    mantissa_bits: int


def format_info(dtype: torch.dtype) -> FormatInfo:
    """Max, smallest normal, smallest subnormal (= smallest normal · eps) and eps of ``dtype``.

    The smallest subnormal is checked: it survives a cast to ``dtype``, half of it does not.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"{dtype!r} is not a torch floating-point dtype; pass e.g. torch.float16.")
    fi = torch.finfo(dtype)
    sub = fi.smallest_normal * fi.eps
    if float(torch.tensor(sub, dtype=dtype)) != sub or float(torch.tensor(sub / 2, dtype=dtype)) != 0.0:
        raise ValueError(
            f"{dtype}: torch.finfo's smallest normal × eps is not this format's smallest positive "
            "number (a format without subnormals, or one whose finfo disagrees with its casts, like "
            "float8_e5m2fnuz); use float16, bfloat16, float32, float64, float8_e4m3fn or "
            "float8_e5m2."
        )
    return FormatInfo(
        str(dtype).replace("torch.", ""), fi.max, fi.smallest_normal, sub, fi.eps, int(round(-math.log2(fi.eps)))
    )


@dataclass(frozen=True)
class CastReport:
    """Fractions of the nonzero values that a cast to a low-precision format would lose.

    ``underflow``: become 0; ``subnormal``: land below the smallest normal (fewer significant bits);
    ``overflow``: become ±inf.
    """

    underflow: float
    subnormal: float
    overflow: float


def _require_scale(scale: float) -> float:
    """A loss scale must be a positive number within float32's normal range, where GradScaler keeps it (its inverse
    must be a float32 number too): from 2^-126 to about 3.4e38."""
    info = torch.finfo(torch.float32)
    if (
        isinstance(scale, bool)
        or not isinstance(scale, numbers.Real)
        or not math.isfinite(scale)
        or not info.smallest_normal <= scale <= info.max
    ):
        raise ValueError(
            f"the loss scale must be a positive number in float32's normal range [2^-126, 3.4e38] "
            f"(GradScaler keeps it in float32; e.g. 2**16), got {scale!r}."
        )
    return float(scale)


def cast_report(values: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> CastReport:
    """What casting ``values · scale`` (computed in fp64) to ``dtype`` would do to the nonzero values. Like torch's
    own cast, the product is rounded to float32 on its way to ``dtype``: a float64 value within about 2^-24 of
    its own size from a rounding boundary can round twice (65520 − 2^-30 counts as overflow)."""
    _require_scale(scale)
    if dtype not in LOW_PRECISION:
        raise ValueError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}.")
    if not isinstance(values, torch.Tensor):
        raise ValueError(f"values must be a tensor, got {type(values).__name__}.")
    if values.is_complex():
        raise ValueError(
            "values are complex: fp16 and bf16 hold real numbers; report on the real and imaginary "
            "parts separately (values.real, values.imag)."
        )
    if not torch.isfinite(values).all():
        raise ValueError(
            "values contain inf or NaN: they have overflowed already; report on finite values (the "
            "gradients of a step that did not overflow)."
        )
    v = values[values != 0].double() * scale
    if v.numel() == 0:
        raise ValueError("no nonzero values to report on.")
    low = v.to(dtype)
    tiny = torch.finfo(dtype).smallest_normal
    return CastReport(
        float((low == 0).double().mean()),
        float(((low.abs() < tiny) & (low != 0)).double().mean()),
        float(torch.isinf(low).double().mean()),
    )


def largest_fitting_log2(values: torch.Tensor, dtype: torch.dtype = torch.float16) -> int:
    r"""The largest integer e for which :math:`2^e \max|v|` still rounds to a finite number in ``dtype``.

    A value rounds to infinity at or above :math:`\text{max} + \tfrac12 u`, where u is the spacing of the
    format's largest binade (for fp16, :math:`65504 + 16 = 65520`). A backward pass that writes ``values`` times
    :math:`S/K` in ``dtype`` stays finite for every :math:`S/K \le 2^e` — provided the loss itself leaves autocast
    in fp32 (a loss computed in fp16 is :math:`S/K` times the loss before any gradient, and overflows first).
    """
    if dtype not in LOW_PRECISION:
        raise ValueError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}.")
    if not isinstance(values, torch.Tensor):
        raise ValueError(f"values must be a tensor (torch.tensor(...) of the list), got {type(values).__name__}.")
    if values.is_complex():
        raise ValueError(
            "values are complex: fp16 and bf16 hold real numbers; pass the real and imaginary parts "
            "(torch.view_as_real(values))."
        )
    largest = float(values.detach().abs().max()) if values.numel() else 0.0
    if not math.isfinite(largest) or largest == 0:
        raise ValueError(f"need finite values with a nonzero entry, got max |v| = {largest}.")
    info = torch.finfo(dtype)
    top = info.max + 2.0 ** (math.floor(math.log2(info.max)) - round(-math.log2(info.eps)) - 1)
    # logarithms of each (top / largest overflows for a subnormal largest); ldexp is exact
    e = math.floor(math.log2(top) - math.log2(largest))
    while math.ldexp(largest, e + 1) < top:  # guard the logarithm's rounding
        e += 1
    while math.ldexp(largest, e) >= top:
        e -= 1
    return e


def accumulate_in(
    micro_grads: Sequence[torch.Tensor], accumulator: torch.dtype, produced_in: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Sum K micro-gradients (each divided by K and rounded to ``produced_in``, as a low-precision backward
    pass would hand them over) in an accumulator of type ``accumulator``, one addition at a time."""
    micro_grads = require_vectors(micro_grads)
    k = len(micro_grads)
    for name, dtype in (("accumulator", accumulator), ("produced_in", produced_in)):
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"{name} must be a floating-point dtype such as torch.float32, got {dtype!r}.")
    for i, g in enumerate(micro_grads):
        if not bool(torch.isfinite((g / k).to(produced_in)).all()):
            raise ValueError(
                f"micro_grads[{i}] / K overflows {produced_in} (largest |value| "
                f"{float((g / k).abs().max()):.3g}): a backward pass in that format would hold inf; "
                "scale the gradients down first (chapter 4's loss scale, the other way)."
            )
    acc = torch.zeros_like(micro_grads[0], dtype=accumulator)
    for g in micro_grads:
        acc = acc + (g / k).to(produced_in).to(accumulator)
    return acc


def accumulation_error(
    micro_grads: Sequence[torch.Tensor], accumulator: torch.dtype, produced_in: torch.dtype = torch.bfloat16
) -> float:
    """Relative error of :func:`accumulate_in` against the exact (fp64) sum of the same rounded inputs: the
    error added by the accumulator alone."""
    got = accumulate_in(micro_grads, accumulator, produced_in).double()
    if not bool(torch.isfinite(got).all()):
        raise ValueError(
            f"the running sum overflows the {accumulator} accumulator: its error is not a rounding "
            "error; accumulate in float32 (as autocast keeps .grad) or scale the gradients down."
        )
    k = len(micro_grads)
    exact = cast(torch.Tensor, sum((g / k).to(produced_in).double() for g in micro_grads))
    if not torch.linalg.vector_norm(exact) > 0:
        raise ValueError(
            f"the exact sum of the micro-gradients rounded to {produced_in} is zero: a relative "
            "error has no scale; pass gradients that do not cancel (or vanish in that format)."
        )
    return _tensors.relative_error(got, exact)
