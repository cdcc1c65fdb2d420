"""The pipeline :func:`check` runs: validate → the references (:mod:`.references`) → run the step on a copy
(:mod:`.run`, under the instruments of :mod:`.instrument` and :mod:`.recorder`) → the reference clipped as the loop
clips (:mod:`.clipping`) → :class:`~.measure.Measurements` → findings (:mod:`.rules`, :mod:`.run_rules`) → the
last partial window (:mod:`.partial`) → :class:`~.report.Report`."""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gradaccum.windows import token_loss

from .arguments import _allowed_codes, _check_outputs, _validate_arguments
from .batch import Batch, accumulate_plain, batch_size
from .clipping import _clipping
from .instrument import SampleRNG, coupled_modules, identical_draws
from .measure import Measurements, cosine, rel, tolerances
from .partial import _partial_window
from .references import _probe, _references, _Refs
from .report import COUNTED, PARTIAL_OK, Finding, Report
from .rules import diagnose
from .run import (
    CANCELLATION,
    CANCELLATION_LIMIT,
    Step,
    _Restore,
    _Run,
    _run_step,
    _trainable,
    _unpreserved_finding,
)
from .run_rules import RUN_RULES, Clipping, RunContext, resolve


def check(
    model: nn.Module,
    loss_fn: Callable | None,
    x: Batch,
    y: torch.Tensor | None,
    k: int,
    step: Step | None = None,
    clip: float | None = None,
    tolerance: float | None = None,
    seed: int = 0,
    partial: bool = True,
    allow: Sequence[str] = (),
) -> Report:
    """Compare one accumulated window (``step``, or plain accumulation) with one full-batch pass; name causes.

    ``x``: a tensor whose first dimension is the batch (``model(x)``), or a dict of such tensors, called as
    ``model(**x)`` (a Hugging Face batch: ``{"input_ids": ..., "attention_mask": ..., "labels": ...}``); every
    tensor is cut into micro-batches along its first dimension, and ``step`` receives the dict. ``loss_fn``:
    ``loss_fn(output, y)`` with ``output`` the model's tensor, or the ``logits`` of an output that is not one (a
    ``ModelOutput``, a dict); or None when the model computes its own loss from ``x`` (labels inside ``x``): the
    loss is then ``output.loss`` (or ``output["loss"]``), and ``y`` must be None. The full batch's reference is
    that loss on the whole batch: for a causal language model, its summed token loss over the batch's label tokens
    (``labels != -100`` after the model's shift), so a loop that passes ``num_items_in_batch`` (the window's label
    tokens) to every micro-batch and does not divide by K is right.
    ``clip``: the threshold your loop clips to (norm); when None and your loop calls ``clip_grad_norm_`` or
    ``clip_grad_value_``, the threshold it used is taken. The full-batch reference is then clipped once.
    ``tolerance``: relative error that counts as equal (default 1e-9 for float64 parameters, 1e-4 for float32,
    8 epsilons of the format for bf16 or fp16 parameters: 6.3e-2 and 7.8e-3; the format of the loss where it is
    coarser than the parameters', as transformers' losses compute in float32).
    ``seed``: seeds the per-sample randomness. ``partial``: also run ``step`` on a partial window of K − 1
    micro-batches (as the last window of an epoch) and report a gradient that is not that window's mean.
    ``allow``: finding codes you expect and accept (``"batch_coupled_layer"`` for a BatchNorm model under plain
    accumulation): they are still reported, marked allowed, and do not make the verdict fail; everything else is
    judged as usual. A ``torch.compile``'d model runs eagerly here (the loop and the model's code are checked, not
    the compiled kernels); weight decay in the step's gradient is named and left out of the comparison.

    Dropout is replayed per sample whether ``step`` calls the model or a module inside it (the inner model of a
    wrapper, ``wrapper.hf(**micro_batch)``), as long as that module's input is rows of ``x``.
    """
    _validate_arguments(model, loss_fn, x, y, k, step, clip, tolerance, seed)
    allowed = _allowed_codes(allow)
    devices = sorted({p.device.index or 0 for p in _trainable(model) if p.device.type == "cuda"})
    restore = _Restore(model)
    try:
        # a torch.compile'd model runs eagerly: the instruments are dispatch modes, and Dynamo, meeting one,
        # would mark the model's code eager for the rest of the process
        with torch.random.fork_rng(devices=devices), torch.compiler.set_stance("force_eager"):
            job, note = _job(model, loss_fn, x, y, k, step, clip, tolerance, seed, partial)
            report = _check(job)
            report.allowed = allowed
            if note is not None:
                report.notes.insert(0, note)
            if restore.grads_changed():
                raise ValueError(GRADIENTS_WRITTEN)
            return report
    finally:
        restore()


#: Why :func:`check` refuses a loss_fn or step that wrote gradients into the caller's model, and what to do.
GRADIENTS_WRITTEN = (
    "your loss_fn or step wrote gradients into the model you passed to check: the checker runs your "
    "step, and the full batch, on copies of it, so a term computed from that model's own parameters "
    "(a regularizer written over it in a closure, say) lands in a gradient nobody compares. Leave "
    "such a term out of the check: the reference is loss_fn on the batch, so a term of the "
    "parameters alone is not in it even when computed from the model your step is given, and the "
    "loop's structure, which the check tests, does not depend on it (weight decay belongs in the "
    "optimizer)."
)


def _job(
    model: nn.Module,
    loss_fn: Callable | None,
    x: Batch,
    y: torch.Tensor | None,
    k: int,
    step: Step | None,
    clip: float | None,
    tolerance: float | None,
    seed: int,
    partial: bool,
) -> tuple[_Job, str | None]:
    """The comparison :func:`check` makes, with the tolerances in force (from the parameters' and the loss's
    formats unless the caller gave one) and the note that says so (None when there is nothing to say)."""
    loss = _check_outputs(model, loss_fn, x, y)
    tol, wtol, note = tolerances(_trainable(model), loss.dtype, tolerance)
    n = batch_size(x)
    job = _Job(
        model, loss_fn, x, y, k, step, clip, tol, wtol, seed, partial, n, n // k, fixed_tol=tolerance is not None
    )
    return job, note


def _out_of_range(basis: torch.Tensor, model: nn.Module, k: int) -> str | None:
    """Why the micro-batch gradients (``basis``, float64, one row each) cannot be compared, or None: every entry
    below the parameters' smallest normal number (subnormal: fewer significant bits than the format, so a
    loss times 1e-42 in float32 reads as a pattern of weights), or squared norms of the K-term sums that
    overflow float64 (inner products and norms turn into inf and NaN)."""
    largest = float(basis.abs().max()) if basis.numel() else 0.0
    tiny = min(torch.finfo(p.dtype).tiny for p in _trainable(model))
    if 0.0 < largest < tiny:
        return (
            f"the largest micro-batch gradient entry is {largest:.3g}, below the smallest normal number of the "
            f"parameters' format ({tiny:.3g}): every entry is subnormal and rounded to fewer significant bits"
        )
    norm = float(basis.norm(dim=1).max()) if basis.numel() else 0.0
    if not math.isfinite(norm * norm * k * k):
        return (
            f"a micro-batch gradient's norm ({norm:.3g}) squared, over K = {k} micro-batches, overflows "
            "float64, the format the check compares in"
        )
    return None


@dataclass
class _Job:
    """One comparison: the caller's arguments, the batch's sizes and the tolerances in force (``switched``: the
    model's modes were set from the step's; ``fixed_tol``: the caller gave the tolerance)."""

    model: nn.Module
    loss_fn: Callable | None
    x: Batch
    y: torch.Tensor | None
    k: int
    step: Step | None
    clip: float | None
    tol: float
    wtol: float
    seed: int
    partial: bool
    n: int
    b: int
    switched: bool = False
    fixed_tol: bool = False


def _check(job: _Job) -> Report:
    """The pipeline: references → run the step → measurements → findings (rules, then precedence) → report."""
    report = Report(
        job.k, float("nan"), float("nan"), job.tol, micro_batch=job.b, batch=job.n, counts=dict.fromkeys(COUNTED, 0)
    )
    refs = _references(job.model, job.loss_fn, job.x, job.y, job.k, job.seed)
    early = _reference_findings(job, refs)
    if early is None:
        early = _cancellation(job, refs, report)
    if early is not None:
        report.findings = resolve(early)
        return report
    run = _run_step(
        job.model, job.loss_fn, job.x, job.y, job.k, job.step or accumulate_plain, job.seed, plans=refs.plans
    )
    if run.transformed:
        report.notes.append(
            f"torch.func: {run.transformed} forward pass(es) of your step ran inside torch.func "
            "transforms (vmap, grad); the gradient they produce is compared, but their random draws "
            "(dropout) are not replayed per sample, and they are not counted as micro-batches"
        )
    _step_loss_precision(job, run, report)
    switched = _in_the_steps_modes(job, run)
    if switched is not None:
        return switched
    clipping = _clipping(job.clip, job.model, run, refs, report)
    m = _measurements(job, run, refs, clipping)
    findings, info = diagnose(m)
    ctx = RunContext(job.k, job.b, job.tol, job.step is not None, run, refs.full, clipping, {f.code for f in findings})
    for rule in RUN_RULES:
        found = rule(ctx, findings)
        if found is not None:
            findings.append(found)
    report.findings = resolve(findings)
    _fill(report, run, clipping, info)
    if job.step is not None and job.partial and job.k >= 2 and run.error is None and set(report.codes) <= PARTIAL_OK:
        extra = _partial_window(job, refs, clipping, info.get("decay"))
        if extra is not None:
            report.findings.append(extra)
    return report


def _reference_findings(job: _Job, refs: _Refs) -> list[Finding] | None:
    """The verdict when the references themselves cannot be compared (a model that fails on a micro-batch,
    randomness that cannot be replayed per sample), or None."""
    if refs.error is not None:
        err = refs.error
        return [
            Finding(
                "model_fails_on_micro_batch",
                f"the model fails on a micro-batch of {job.b} sample(s)",
                f"micro-batch {refs.micro}: {type(err).__name__}: {str(err).strip().splitlines()[0]}",
                "use larger micro-batches (BatchNorm needs more than one value per channel) or a per-sample "
                "normalization such as GroupNorm",
                1,
            )
        ]
    if refs.unreplayed:
        # a random op that looked per-sample in the full batch (a dimension equal to its size) but not in the
        # micro-batches, e.g. a feature mask torch.rand(16) when the batch has 16 samples: its randomness is not
        # per sample, so the full batch and the micro-batches cannot be given the same draws
        return [
            Finding(
                "randomness_not_replayed",
                "randomness the checker could not replay per sample",
                f"{len(refs.unreplayed)} random draw(s) in the model's forward could not be cut into samples in "
                f"every pass, e.g. {refs.unreplayed[0]} (a draw per sample has a dimension equal to the batch size "
                f"in the full batch of {job.n} and in each micro-batch of {job.b})",
                "rerun with that randomness switched off "
                "(dropout p = 0) to compare like with like, or draw it with a batch dimension (torch.rand(x.shape[0], "
                "...))",
                6,
                "inconclusive",
            )
        ]
    if refs.recomputed:
        found = [
            Finding(
                "randomness_not_replayed",
                "randomness in a forward pass that backward recomputes (activation checkpointing with dropout)",
                f"{len(refs.recomputed)} random draw(s) during backward, e.g. "
                f"{refs.recomputed[0]}: the checker gives every sample its own masks in the forward pass, but cannot "
                "give the recomputation the same ones",
                "rerun with dropout off (p = 0) or without activation checkpointing to compare like with like",
                6,
                "inconclusive",
            )
        ]
        # the comparison is out of reach, but a checkpoint that does not restore the random state is still a bug
        unpreserved = _unpreserved_finding(
            _run_step(
                job.model, job.loss_fn, job.x, job.y, job.k, job.step or accumulate_plain, job.seed, plans=refs.plans
            )
        )
        return found + ([unpreserved] if unpreserved is not None else [])
    return None


def _cancellation(job: _Job, refs: _Refs, report: Report) -> list[Finding] | None:
    """Gradients out of range, or cancelling beyond :data:`CANCELLATION_LIMIT`: the inconclusive finding. Between
    :data:`CANCELLATION` and the limit, the tolerances are widened in proportion (a note says so) and None."""
    reach = _out_of_range(refs.basis, job.model, job.k)
    if reach is not None:
        return [
            Finding(
                "gradient_out_of_range",
                "the gradients lie outside the range the comparison can measure",
                reach,
                "check with the loss at ordinary magnitudes (leave out a constant factor such as a loss scale): the "
                "loop's structure, which the check names, does not depend on it",
                1,
                "inconclusive",
            )
        ]
    # rounding grows with the terms summed, not with their sum: where the micro-batch gradients cancel (near an
    # optimum) the full batch's gradient is far shorter than they are, and the default tolerance is widened by
    # the excess over CANCELLATION (a typical window's micro-batch gradients are a few times their mean)
    spread = float(refs.basis.norm(dim=1).mean()) / max(float(refs.full.norm()), 1e-300)
    if not job.fixed_tol and not job.switched and spread > CANCELLATION_LIMIT:
        return [
            Finding(
                "gradient_cancels",
                "the micro-batch gradients cancel: the full batch's gradient is too small to compare with",
                f"the micro-batch gradients are {spread:.3g}× longer on average than the full batch's "
                f"(as at an optimum): any difference is dominated by their rounding",
                "check from a state away from the "
                "optimum (the untrained model, an earlier checkpoint), or pass the tolerance you accept",
                1,
                "inconclusive",
            )
        ]
    if not job.fixed_tol and not job.switched and spread > CANCELLATION:
        job.tol, job.wtol = job.tol * spread / CANCELLATION, job.wtol * spread / CANCELLATION
        report.tolerance = job.tol
        report.notes.append(
            f"cancellation: the micro-batch gradients are {spread:.3g}× longer on average than the "
            f"full batch's (they cancel, as near an optimum), so rounding is relative to them: the "
            f"tolerance is widened to {job.tol:.2g}"
        )
    return None


def _step_loss_precision(job: _Job, run: _Run, report: Report) -> None:
    """A step whose forward passes return a loss in a coarser format than the tolerance allows for (the float32
    loss of a Hugging Face model a float64 wrapper holds, called by the step itself): the tolerances of that
    format (as for parameters held in it), and a note; not when the caller gave the tolerance."""
    if job.fixed_tol or not run.loss_dtypes:
        return
    coarsest = max(run.loss_dtypes, key=lambda d: torch.finfo(d).eps)
    tol, wtol, note = tolerances(_trainable(job.model), coarsest, None)
    if note is None or tol <= job.tol:  # the loss is no coarser than the parameters, or already allowed for
        return
    job.tol, job.wtol = tol, max(job.wtol, wtol)
    report.tolerance = job.tol
    dtype = str(coarsest).replace("torch.", "")
    report.notes.append(
        f"precision: your step's forward passes return their loss in {dtype} (as in "
        "transformers, whose losses cast the logits to float32), coarser than the reference: the "
        f"tolerance is that format's, {tol:.2g}"
    )


def _in_the_steps_modes(job: _Job, run: _Run) -> Report | None:
    """When the step switched modes (model.train() on a model handed over in eval mode, as from_pretrained returns
    it), the check again with the full batch in the modes the step's forward passes ran in (once: a step that
    flips the mode it finds is compared in the mode of this first run); else None."""
    given_modes = [m_.training for m_ in job.model.modules()]
    if run.modes is None or run.modes == given_modes or job.switched:
        return None
    moved = copy.deepcopy(job.model)
    for module, training in zip(moved.modules(), run.modes):
        module.training = training
    inner = _check(dataclasses.replace(job, model=moved, switched=True, fixed_tol=True))
    changed = [
        (name or "(the model)", now)
        for (name, _), was, now in zip(job.model.named_modules(), given_modes, run.modes)
        if was != now
    ]
    parts = [
        f"{len(group)} module(s) in {mode} mode (e.g. {', '.join(group[:3])})"
        for mode, group in (
            ("training", [c for c, now in changed if now]),
            ("evaluation", [c for c, now in changed if not now]),
        )
        if group
    ]
    inner.notes.insert(
        0,
        f"mode: your step puts {' and '.join(parts)} before its forward passes; the full "
        "batch was computed in the modes your step uses",
    )
    return inner


def _measurements(job: _Job, run: _Run, refs: _Refs, c: Clipping) -> Measurements:
    """What the rules read: the references, the run, the loss probe, whether the draws depend on the start state."""
    reseeded = None
    seeds = [e for e in run.events if e.kind == "seed"]
    draws = run.replayed + len(run.unreplayed)
    if job.step is not None and run.error is None and (draws or seeds):
        first = _run_step(
            job.model, job.loss_fn, job.x, job.y, job.k, job.step, job.seed, mode="record", start=job.seed + 1
        )
        second = _run_step(
            job.model, job.loss_fn, job.x, job.y, job.k, job.step, job.seed, mode="record", start=job.seed + 2
        )
        if first.error is None and second.error is None:
            reseeded = identical_draws(first.draws, second.draws)
    # misplaced and measuring-only clip calls are reported apart (or not at all)
    shown_events = [e for e in run.events if e.kind != "clip" or any(e is p for p in c.placed)]
    probe = _probe(job.loss_fn, refs, job.y, job.k, job.b)
    names = [name for name, p in job.model.named_parameters() if p.requires_grad]
    slices, start = [], 0
    for name, p in zip(names, _trainable(job.model)):
        slices.append((name, slice(start, start + p.numel())))
        start += p.numel()
    rtol = 1e-9 if job.wtol < 1e-6 else 1e-4
    model, x, b, seed = job.model, job.x, job.b, job.seed
    return Measurements(
        k=job.k,
        b=job.b,
        n=job.n,
        tol=job.tol,
        wtol=job.wtol,
        basis=refs.basis,
        full=refs.full,
        target=c.target,
        applied=run.applied,
        f=probe.weights,
        loss_residual=probe.residual,
        tokens=probe.tokens,
        f_moved=probe.moved,
        loss_thr=probe.thr,
        clip=c.clip,
        clip_kind=c.kind,
        clip_norm_type=c.norm_type,
        clip_source=c.source,
        events=shown_events,
        passes=run.passes,
        error=run.error,
        forwards=run.forwards,
        unreplayed=run.unreplayed,
        random_draws=draws,
        reseeded=reseeded,
        coupled=lambda: coupled_modules(model, x, b, SampleRNG(seed), rtol),
        param_slices=slices,
        has_step=job.step is not None,
        outside_draws=run.outside,
        params=torch.cat([p.detach().reshape(-1) for p in _trainable(model)]).to(refs.basis.dtype).cpu(),
    )


def _fill(report: Report, run: _Run, c: Clipping, info: dict[str, Any]) -> None:
    """The report's measurements: weights, error and cosine, warnings, events, counts, the randomness note."""
    report.weights, report.expected_weights = info.get("weights"), info.get("expected_weights")
    if run.error is None:  # (the gradient without a weight decay the rules took out)
        applied = info.get("compared", run.applied)
        report.rel_error, report.cosine = rel(c.target, applied), cosine(c.target, applied)
    report.warnings = run.warnings
    report.events = [str(e) for e in run.events]
    report.counts = {"backward": len(run.passes)}
    for kind_ in COUNTED[1:]:
        report.counts[kind_] = sum(e.kind == kind_ for e in run.events)
    if run.replayed:
        report.notes.append(
            f"randomness: {run.replayed} random op call(s) (dropout) in the window's forward passes "
            "were replayed per sample, so the full batch and the micro-batches use the same masks"
        )


def token_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the non-padding positions of (N, T, V) logits and (N, T) targets (padding: -100): the
    mean over tokens, :func:`gradaccum.windows.token_loss` with a loss function's two-argument signature."""
    return token_loss(logits, target)
