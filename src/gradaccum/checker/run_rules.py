"""The rules that read the run itself (clip calls, forward passes, BatchNorm reruns, checkpoints, the recorder),
applied after the fingerprints of :mod:`.rules`, and the one place where findings outrank each other.

Each rule is a function ``(RunContext, findings so far) -> Finding | None``, applied in the order of
:data:`RUN_RULES`; :func:`resolve` then applies :data:`OUTRANKS` and :data:`FIRST` to the list.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .measure import rel
from .recorder import Event
from .report import Finding, num
from .run import _bn_rerun_finding, _recorder_error_finding, _Run, _unpreserved_finding

#: code → what it outranks: a finding raised *before* one of this code is dropped when its code, or its severity,
#: is listed. Micro-batches the checker could not place in the batch (with dropout) make every bug read before
#: them unreliable; the finding names them in its evidence instead.
OUTRANKS: dict[str, frozenset[str]] = {
    "randomness_not_replayed": frozenset({"bug"}),
}
#: Codes shown first, in this order; every other finding keeps the order it was raised in.
FIRST: tuple[str, ...] = ("checkpoint_rng_not_preserved", "clip_misplaced", "clip_threshold_differs")


def _outranks(later: Finding, earlier: Finding) -> bool:
    beaten = OUTRANKS.get(later.code, frozenset())
    return earlier.code in beaten or earlier.severity in beaten


def arrange(findings: list[Finding]) -> list[Finding]:
    """``findings`` in the declared order: :data:`FIRST`, then the others as raised."""
    return sorted(findings, key=lambda f: FIRST.index(f.code) if f.code in FIRST else len(FIRST))


def resolve(findings: list[Finding]) -> list[Finding]:
    """Drop what a later finding outranks (:data:`OUTRANKS`), then :func:`arrange`."""
    kept = [f for i, f in enumerate(findings) if not any(_outranks(g, f) for g in findings[i + 1 :])]
    return arrange(kept)


@dataclass
class Clipping:
    """How the full batch is clipped for the comparison, and the loop's clip calls."""

    given: float | None
    clip: float | None
    clips: list[Event]
    thresholds: set[tuple[Any, Any, Any]]
    target: torch.Tensor  # the full batch's gradient, clipped as the loop clips
    kind: str = "norm"
    norm_type: Any = 2.0
    source: str | None = None
    misplaced: list[tuple[Event, str]] = field(default_factory=list)
    placed: list[Event] = field(default_factory=list)


@dataclass
class RunContext:
    """What the run-level rules read: the window, the run, the full batch's gradient, the clipping, and the codes
    the fingerprints found."""

    k: int
    b: int
    tol: float
    has_step: bool
    run: _Run
    full: torch.Tensor
    clipping: Clipping
    codes: set[str]


def clip_missing(ctx: RunContext, findings: list[Finding]) -> Finding | None:
    """A threshold given, no clip call in the loop (a note: it did not bite, or the fingerprints said so)."""
    c = ctx.clipping
    if c.given is None or ctx.run.error is not None or c.clips or "clip_missing" in ctx.codes:
        return None
    return Finding(
        "clip_missing",
        "a clip threshold was given but your loop makes no clip call",
        f"threshold {num(c.given)} (the clip argument); the full-batch gradient's norm "
        f"{num(float(ctx.full.norm()))} is below it, so this window is not affected, but larger gradients "
        "will be clipped in the reference and not in your loop",
        "clip once per window, after the last backward (after scaler.unscale_), or drop the clip argument",
        3,
        "note",
    )


def clip_threshold_differs(ctx: RunContext, findings: list[Finding]) -> Finding | None:
    """The threshold given is not the loop's (a note)."""
    c = ctx.clipping
    if c.given is None or ctx.run.error is not None:
        return None
    differ = sorted({v for _, v, _ in c.thresholds if v is not None and v != c.given})
    if not differ:
        return None
    return Finding(
        "clip_threshold_differs",
        "the clip threshold you gave is not the one your loop uses",
        f"you gave {num(c.given)}; your loop's clip call(s) use {', '.join(num(v) for v in differ)}: the "
        "comparison clips the full batch at the threshold you gave, so a difference below may come from "
        "the two thresholds alone",
        f"rerun with --clip {num(differ[0])} (or without --clip: the checker then reads the threshold from your loop)",
        3,
        "note",
    )


def clip_misplaced(ctx: RunContext, findings: list[Finding]) -> Finding | None:
    """Every clip call ran where it cannot reach the applied gradient."""
    c = ctx.clipping
    if not c.misplaced or c.placed or ctx.run.error is not None:
        return None
    e, where = c.misplaced[0]
    return Finding(
        "clip_misplaced",
        "your clip call does not clip the gradient the optimizer step applies",
        f"{e.detail.get('fn', 'clip')} ran {where}: the step applied the gradient as it was before any clip",
        "clip once per window after the last backward (after scaler.unscale_) and before optimizer.step()",
        3,
    )


def unplaced_randomness(ctx: RunContext, findings: list[Finding]) -> Finding | None:
    """Micro-batches that are not consecutive slices of x (strided, shuffled), with dropout: their samples could
    not be found, so they may have drawn other masks than in the full batch (it outranks the bugs before it)."""
    run = ctx.run
    bugs = [f for f in arrange(findings) if f.severity == "bug"]
    if not (
        run.unlocated
        and run.replayed
        and bugs
        and run.error is None
        and rel(ctx.clipping.target, run.applied) > ctx.tol
    ):
        return None
    return Finding(
        "randomness_not_replayed",
        "dropout in micro-batches the checker could not place in the batch",
        f"{run.unlocated} forward pass(es) of your step got inputs that are not consecutive rows of x (e.g. "
        f"x[j::K], or a shuffle), and the forward draws random numbers: their samples may have been given other "
        f"masks than in the full batch (without that, the findings would be: {', '.join(f.code for f in bugs)})",
        "split the window into consecutive micro-batches as the checker does (x.chunk(K)), or rerun with "
        "dropout off to compare like with like",
        6,
        "inconclusive",
    )


def micro_batches_differ(ctx: RunContext, findings: list[Finding]) -> Finding | None:
    """A correct window cut otherwise than into the K micro-batches asked for (a note)."""
    run = ctx.run
    if not ctx.has_step or run.error is not None or not run.forwards or any(f.severity == "bug" for f in findings):
        return None
    sizes = sorted({size for _, size in run.forwards})
    if sizes == [ctx.b]:
        return None
    return Finding(
        "micro_batches_differ",
        "your step's micro-batches are not the K you passed",
        f"its forward passes saw {len(run.forwards)} batch(es) of size(s) {sizes}, not K = {ctx.k} "
        f"micro-batches of {ctx.b}; this window's gradient is still the full batch's",
        "pass the K your loop uses (-k), so that the check (and its partial window) tests the loop you run",
        6,
        "note",
    )


def bn_stats_updated_twice(ctx: RunContext, findings: list[Finding]) -> Finding | None:
    """BatchNorm running statistics moved again by a recomputation in backward."""
    return _bn_rerun_finding(ctx.run.bn_reruns) if ctx.run.error is None else None


def checkpoint_rng_not_preserved(ctx: RunContext, findings: list[Finding]) -> Finding | None:
    """Random draws recomputed under a checkpoint that does not restore the RNG state."""
    return _unpreserved_finding(ctx.run)


def checker_error(ctx: RunContext, findings: list[Finding]) -> Finding | None:
    """An exception inside the checker's own call recorder (inconclusive)."""
    return _recorder_error_finding(ctx.run)


#: The run-level rules, in the order they are applied (a rule sees the findings raised before it).
RUN_RULES: tuple[Callable[[RunContext, list[Finding]], Finding | None], ...] = (
    clip_missing,
    clip_threshold_differs,
    clip_misplaced,
    unplaced_randomness,
    micro_batches_differ,
    bn_stats_updated_twice,
    checkpoint_rng_not_preserved,
    checker_error,
)
