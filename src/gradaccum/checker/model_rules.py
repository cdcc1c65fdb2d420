r"""The rules that read the model and the loss, not the loop: whether the full batch equals the ideal
accumulation :math:`\sum_j f_j h_j` of this model. Where it does not, a loss that couples the samples of a batch
(in-batch negatives, a max over the batch, a batch-wide weight), a layer that does (BatchNorm in training), or
randomness the checker could not give each sample as the full batch gives it; the loop's findings are in
:mod:`.loop_rules` and the rules' notation in :mod:`.rules`."""

from __future__ import annotations

import torch

from .measure import (
    Measurements,
    rel,
)
from .report import (
    BN_FIX,
    _Findings,
    num,
    nums,
)


def _loss_findings(m: Measurements, out: _Findings) -> bool:
    """A loss that couples the samples of a batch (True when it does: the weights f then mean nothing)."""
    loss_thr = m.thr if m.loss_thr is None else min(m.thr, m.loss_thr)
    # a micro-batch with a gradient of its own that weighs nothing in the full batch: the loss selects samples
    # across the batch (a max, a min, the hardest examples); a weighted or token mean gives it its share
    top_f = max((abs(v) for v in m.f), default=0.0)
    unselected = [
        j + 1 for j, fj in enumerate(m.f) if top_f > 0 and abs(fj) <= m.wtol * top_f and float(m.basis[j].norm()) > 0
    ]
    coupled_loss = m.loss_residual > loss_thr or m.f_moved is not None or bool(unselected)
    fix = (
        "accumulation cannot reproduce such a loss; enlarge the micro-batch, or compute the full-batch gradient "
        "with GradCache (gradaccum.coupled.grad_cache_backward; for a loss of the model's outputs, the model as "
        "its one encoder and lambda out: loss_fn(out, y))"
    )
    cause = "the loss couples the samples of a batch: it is not a sum over micro-batches"
    if m.loss_residual > loss_thr:
        out.add(
            "loss_couples_samples",
            cause,
            f"the loss's gradient on a micro-batch inside the full batch is not a "
            f"multiple of its gradient on the micro-batch alone (relative residual {num(m.loss_residual)}); "
            "in-batch negatives or batch statistics in the loss do this",
            fix,
            8,
        )
    elif m.f_moved is not None:
        out.add(
            "loss_couples_samples",
            cause,
            f"the full batch weighs each micro-batch's gradient by a factor that "
            f"changes smoothly with the model's outputs ({nums(m.f)} here, {nums(m.f_moved)} with the outputs "
            "moved by a thousandth of their spread, a hundredth below float64): a batch-wide value of the "
            "outputs sets the weights (a logsumexp or softmax over the samples' losses, the square root of a "
            "mean as in RMSE, a power of the batch's mean loss), so no fixed normalization reproduces them",
            fix,
            8,
        )
    elif unselected:
        out.add(
            "loss_couples_samples",
            cause,
            f"micro-batch(es) {', '.join(map(str, unselected))} weigh nothing in "
            f"the full batch's gradient (weights {nums(m.f)}), yet have a gradient of their own: the loss "
            "selects samples across the batch (a max, a min, the hardest examples), so which micro-batch counts "
            "depends on the others",
            fix,
            8,
        )
    return coupled_loss


def _coupling_findings(m: Measurements, out: _Findings, ideal: torch.Tensor, model_error: float) -> None:
    """The full batch differs from the ideal accumulation of this model by ``model_error``: the layers that couple
    samples, else randomness not replayed per sample, else coupling in the forward itself."""
    layers = _most_different(m, ideal)
    coupled = m.coupled()
    if m.random_draws and all(name == "(the model itself)" for name, _, _ in coupled):
        coupled = []  # only the model as a whole, and it draws random numbers: see the randomness case below
    if coupled:
        _coupled_layers(m, out, coupled, model_error, layers)
    elif m.unreplayed:
        out.add(
            "randomness_not_replayed",
            "randomness the checker could not replay per sample",
            f"{len(m.unreplayed)} random draw(s) without a batch dimension, e.g. {m.unreplayed[0]}; the full "
            f"batch and the micro-batches differ by {num(model_error)}",
            "rerun with that randomness switched off (dropout p = 0) to compare like with like",
            6,
            "inconclusive",
        )
    elif m.random_draws:
        # no layer couples samples, yet the model as a whole does, and its forward draws random numbers: the
        # draws were probably cut into samples wrongly (dropout on torch.cat([x, x]), on a reordered batch)
        out.add(
            "randomness_not_replayed",
            "randomness the checker could not give each sample reliably",
            f"no single layer couples samples, yet the full batch and the micro-batches differ by "
            f"{num(model_error)}, and the forward makes {m.random_draws} random draw(s): a draw whose rows are "
            "not the batch's samples in order (dropout after torch.cat([x, x]) or a flip of the batch) gets "
            "other masks in a micro-batch than in the full batch",
            "rerun with that randomness switched off (dropout p = 0) to compare like with like",
            6,
            "inconclusive",
        )
    else:
        out.add(
            "batch_coupled_layer",
            "batch coupling inside the model's forward: a sample's output depends on the other samples of its batch",
            f"no single layer couples samples, but the model as a whole does: "
            f"the ideal accumulation differs from the full batch by {num(model_error)} (most in {layers})",
            "look for operations across the batch dimension in forward (means, sorting, in-batch attention)",
            1,
        )


def _most_different(m: Measurements, ideal: torch.Tensor) -> str:
    """The three parameters whose full-batch gradient differs most from the ideal accumulation, with the relative
    difference of each (report text)."""
    diffs = []
    for name, sl in m.param_slices:
        a, b = m.full[sl], ideal[sl]
        if float(a.norm()) > 0:
            diffs.append((rel(a, b), name))
    diffs.sort(reverse=True)
    return ", ".join(f"{name} {num(d)}" for d, name in diffs[:3])


def _coupled_layers(
    m: Measurements, out: _Findings, coupled: list[tuple[str, str, float]], model_error: float, layers: str
) -> None:
    """Layers that give a sample another output in a micro-batch than in the full batch (``coupled``: name,
    class, and what was measured): BatchNorm's own finding when all are BatchNorm, else a batch-coupled layer."""
    names = ", ".join(f"{cls} '{name}'" for name, cls, _ in coupled[:4]) + (", …" if len(coupled) > 4 else "")
    bn = all("BatchNorm" in cls for _, cls, _ in coupled)
    cause = (
        "BatchNorm normalizes each micro-batch with its own statistics"
        if bn
        else "a batch-coupled layer: a sample's output depends on the other samples of its batch"
    )
    fix = (
        BN_FIX
        if bn
        else (
            "replace the layer by a per-sample one, or accept (and measure) the difference; "
            "larger micro-batches shrink it"
        )
    )
    out.add(
        "batch_coupled_layer",
        cause,
        f"{len(coupled)} layer(s) give a sample a different output in a micro-batch of {m.b} than in the "
        f"full batch of {m.n} (same inputs, same randomness): {names}; the ideal accumulation of this model "
        f"differs from the full batch by {num(model_error)} (relative), most in {layers}",
        fix,
        1,
    )


def _outside_randomness(m: Measurements, out: _Findings) -> None:
    """Random draws the checker could not replay per sample (no batch dimension, or outside the model's forward):
    the full batch and the micro-batches do not see the same random numbers, so no verdict."""
    if m.unreplayed:
        out.add(
            "randomness_not_replayed",
            "randomness the checker could not replay per sample",
            f"{len(m.unreplayed)} random draw(s) without a batch dimension, e.g. {m.unreplayed[0]}",
            "rerun with that randomness switched off (dropout p = 0) to compare like with like",
            6,
            "inconclusive",
        )
    if m.outside_draws:
        out.add(
            "randomness_not_replayed",
            "randomness in your step outside the model's forward (e.g. noise or "
            "augmentation added to the inputs), which the checker cannot replay",
            f"{len(m.outside_draws)} random draw(s) in your step outside model.forward, e.g. "
            f"{m.outside_draws[0]}: the full-batch reference does not draw them",
            "rerun with that randomness switched off (or moved into the data pipeline, before step) to compare "
            "like with like",
            6,
            "inconclusive",
        )
