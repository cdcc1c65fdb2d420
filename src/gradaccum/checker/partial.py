"""The last partial window of an epoch: a step run again on the first K − 1 micro-batches with k = K − 1, compared
with those micro-batches' own mean gradient (as the loss weighs them, clipped as the loop clips), and, where it
differs, named: a step that divides by K rather than by the micro-batches present, or weights of another shape.
A step that gives batch-coupled layers the whole window's statistics is right when it equals the partial window's
own full-batch gradient. :func:`.pipeline.check` runs it after a whole window with no bug."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

from .batch import narrow
from .clipping import _clipped_by_group, _measures_only
from .measure import clip_vec, cosine, fit_weights, rel
from .recorder import Event
from .references import _probe, _references, _Refs
from .report import Finding, num, nums
from .run import _Run, _run_step
from .run_rules import Clipping

if TYPE_CHECKING:  # (the pipeline runs this module: a type only)
    from .pipeline import _Job


def _partial_window(job: _Job, refs: _Refs, c: Clipping, decay: torch.Tensor | None = None) -> Finding | None:
    """Run the step on the first K − 1 micro-batches with k = K − 1 and compare with their mean gradient, without
    the weight ``decay`` the whole window showed (under autocast, and without a tolerance of the caller's, a
    difference of autocast's size, up to 10%, is no finding: the whole window's check reports it as inconclusive);
    ``c``: how the whole window's reference was clipped."""
    assert job.step is not None  # (only a step of the reader's has a partial window to check)
    m, b = job.k - 1, job.b
    xp, yp = narrow(job.x, 0, m * b), None if job.y is None else job.y[: m * b]
    run = _run_step(job.model, job.loss_fn, xp, yp, m, job.step, job.seed, plans=refs.plans)
    if run.error is not None:
        return Finding(
            "partial_window_not_checked",
            "the last partial window was not checked",
            f"your step raised {type(run.error).__name__} on a window of {m} micro-batch(es) with k = {m}",
            "if your loader can end an epoch with fewer than K micro-batches, make step accept k < K",
            6,
            "note",
        )
    if decay is not None:  # the weight decay the whole window's check took out
        run.applied = run.applied - fit_weights(torch.cat([refs.basis[:m], decay[None]]), run.applied)[0][-1] * decay
    # the model's own loss is read on the partial window's own passes (its normalization is the partial window's)
    whole = _references(job.model, job.loss_fn, xp, yp, m, job.seed) if job.loss_fn is None else None
    probe = _probe(job.loss_fn, whole, yp, m, b) if whole is not None else _probe(job.loss_fn, refs, yp, m, b, m * b)
    basis = refs.basis[:m]
    mean = cast(torch.Tensor, sum(fj * basis[j] for j, fj in enumerate(probe.weights)))
    clips = [e for e in run.events if e.kind == "clip" and not _measures_only(e)]
    by_group = _clipped_by_group(mean, clips, job.model, len(run.passes))
    ideal = mean
    if by_group is not None:
        ideal = by_group
    elif c.clip is not None:
        ideal = clip_vec(ideal, c.clip, c.kind, c.norm_type)
    error = rel(ideal, run.applied)
    if error <= job.tol or (not job.fixed_tol and error <= 0.1 and any(e.kind == "autocast" for e in run.events)):
        return None
    # a loop that gives batch-coupled layers the statistics of the whole window (e.g. the exact full-batch
    # BatchNorm scheme) is right when it equals the partial window's own full-batch gradient
    whole = whole or _references(job.model, job.loss_fn, xp, yp, m, job.seed)
    if whole.error is None and _equals_whole(job, whole, run, c, clips):
        return None
    return _partial_finding(job, run, basis, probe.weights, (mean, ideal), error, clips, by_group is None)


def _equals_whole(job: _Job, whole: _Refs, run: _Run, c: Clipping, clips: list[Event]) -> bool:
    """Whether the step's gradient on the partial window equals that window's own full-batch gradient (``whole``),
    clipped as the loop clips."""
    target = clip_vec(whole.full, c.clip, c.kind, c.norm_type) if c.clip is not None else whole.full
    grouped = _clipped_by_group(whole.full, clips, job.model, len(run.passes))
    return rel(grouped if grouped is not None else target, run.applied) <= job.tol


def _partial_finding(
    job: _Job,
    run: _Run,
    basis: torch.Tensor,
    expected: list[float],
    references: tuple[torch.Tensor, torch.Tensor],
    error: float,
    clips: list[Event],
    ungrouped: bool,
) -> Finding:
    """The finding for a partial window of ``len(basis)`` micro-batches whose gradient is off by ``error``: divided
    by K (the mean gradient scaled by (K − 1)/K, read before a single clip of every parameter bit), else the
    weights it gives against the ``expected`` ones. ``references``: the partial window's mean gradient and the
    same clipped as the loop clips."""
    m, k = len(basis), job.k
    mean, ideal = references
    w, _, _ = fit_weights(basis, run.applied)
    # one clip of every parameter: compare the gradient it was given (a clip that bites hides the scale)
    one = ungrouped and len(clips) == 1 and "max_norm" in clips[0].detail and clips[0].detail.get("factor", 0) > 0
    given = run.applied / clips[0].detail["factor"] if one else run.applied
    against = mean if one else ideal
    s = float(given @ against) / float(against @ against) if float(against.norm()) > 0 else float("nan")
    thr = max(1e-6 if job.wtol < 1e-6 else 1e-2, job.tol)
    straight = abs(cosine(against, given) - 1) <= thr
    if straight and abs(s - m / k) <= thr * (m / k):
        evidence = (
            f"a window of {m} micro-batches gets {num(s)}× its mean gradient = {m}/{k}: your step divides by "
            f"K = {k}, not by the {m} micro-batches present"
        )
        if one and clips[0].detail["factor"] < 1:
            evidence += (
                f"; here your clip then shrinks it to its threshold, so this step differs from the right "
                f"one by {num(error)} only (clip_grad_norm_ adds 1e-6 to the norm), but a window the clip "
                f"leaves alone gets {m}/{k} of its gradient"
            )
    else:
        evidence = (
            f"a window of {m} micro-batches gets weights {nums(w)} instead of {nums(expected)} "
            f"(relative error {num(error)})"
        )
    return Finding(
        "partial_window",
        "the last partial window is not normalized by its own size",
        evidence,
        "divide a window's loss by the micro-batches (or samples, or tokens) it holds, or never make one: "
        "keep the micro-batches per epoch a multiple of K (a DataLoader's drop_last drops only an "
        "incomplete micro-batch); if your loader never makes one, pass partial=False (--no-partial)",
        6,
    )
