"""What the checker reports: :class:`Finding` (one cause, its evidence and fix), :data:`CODES` (every code it
can raise), the messages several rules share, and :class:`Report` (the verdict and the measurements)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

#: Severity of a finding: a bug; a note (nothing wrong, or a limit of this check); inconclusive (no verdict).
SEVERITIES = ("bug", "note", "inconclusive")


@dataclass(frozen=True)
class Finding:
    """One cause: a stable ``code``, what it is, the measured evidence, what to do, and the chapter about it."""

    code: str
    cause: str
    evidence: str
    fix: str
    chapter: int | None = None
    severity: str = "bug"

    @property
    def expected(self) -> bool:
        """True for notes: behaviour that is correct, or a limit of the check, rather than a bug."""
        return self.severity == "note"

    def to_dict(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "cause": self.cause,
            "evidence": self.evidence,
            "fix": self.fix,
            "chapter": self.chapter,
            "severity": self.severity,
        }

    def __str__(self) -> str:
        tag = {"bug": "BUG", "note": "note", "inconclusive": "??"}[self.severity]
        where = f" (chapter {self.chapter})" if self.chapter else ""
        return f"[{tag}] {self.cause}{where}\n       evidence: {self.evidence}\n       fix: {self.fix}"


#: Findings that leave the window's weights measurable: the partial-window probe runs only when no others were found.
PARTIAL_OK = {"batch_coupled_layer", "scheduler_step_inside_window", "rng_reseeded"}


def num(v: float) -> str:
    """A number for a report: 4 significant digits (stable across machines for float64 experiments)."""
    if v == 0 or not math.isfinite(v):
        return f"{v:g}" if v else "0"
    return f"{v:.4g}"


def nums(vs: Sequence[float]) -> str:
    return "[" + ", ".join(num(v) for v in vs) + "]"


def ordinal_list(items: Sequence[int]) -> str:
    items = list(items)
    if len(items) <= 6:
        return ", ".join(str(i) for i in items)
    return ", ".join(str(i) for i in items[:5]) + f", … ({len(items)} in all)"


CLIP_RUNNING = "clipping inside the window, on the running .grad buffer"


CLIP_PER_MICRO = "clipping inside the window, each micro-batch's gradient separately"


CLIP_FIX = "clip once, after the last micro-batch (after scaler.unscale_ with a GradScaler)"


#: Every finding the checker can report: code → what it means (the book page "Check your own loop" lists them).
CODES: dict[str, str] = {
    "missing_1_over_k": "the micro-batch losses are not divided by K: the gradient is K times the full batch's",
    "double_1_over_k": "one 1/K too many (divided by K twice, or a summed loss divided by K): the gradient is 1/K "
    "of the full batch's",
    "gradient_scaled": "the gradient is a constant multiple of the full batch's, by another factor",
    "loss_scale_not_removed": "the gradient still carries GradScaler's loss scale",
    "zero_grad_inside_window": "the .grad buffer is emptied between micro-batches: only the last ones count",
    "micro_batches_missing": "some micro-batches contribute nothing, and the buffer was not emptied",
    "clip_running_buffer": "clip_grad_norm_ on the running .grad buffer after every backward",
    "clip_per_micro_batch": "each micro-batch's gradient clipped on its own",
    "clip_before_unscale": "clipping ran on gradients still multiplied by the loss scale",
    "clip_missing": "a clip threshold was given but the loop does not clip (a note when it does not bite)",
    "clip_misplaced": "clipping after the optimizer step, or before the first backward: the step is not clipped",
    "clip_threshold_differs": "(note) the clip threshold given differs from the one the loop's clip call uses",
    "scaler_update_inside_window": "GradScaler.update() before the last backward: the loss scale changes inside",
    "scaler_step_inside_window": "GradScaler.step() (an optimizer step) more than once per window",
    "scaler_unscale_inside_window": "GradScaler.unscale_() more than once per window",
    "optimizer_step_inside_window": "an optimizer steps more than once per window, or before the last backward",
    "scheduler_step_inside_window": "scheduler.step() more than once per window (constructors not counted)",
    "weight_decay_per_micro_batch": "a term proportional to the parameters (weight decay) added to .grad after "
    "every micro-batch: K times the decay per step",
    "weight_decay_in_gradient": "(note) weight decay in the gradient (p.grad += wd * p once, or an L2 term in the "
    "loss): left out of the comparison",
    "ema_per_micro_batch": "a model average (AveragedModel, or an EMA written by hand) updated per micro-batch",
    "batch_coupled_layer": "a layer (BatchNorm, or any other) makes a sample's output depend on its batch",
    "loss_couples_samples": "the loss is not a sum over micro-batches (in-batch negatives, batch statistics)",
    "bn_stats_updated_twice": "BatchNorm statistics updated again when backward recomputes it (checkpointing)",
    "checkpoint_rng_not_preserved": "checkpointing with preserve_rng_state=False recomputes dropout with new masks",
    "token_normalization": "micro-batches weighted equally although the full batch weighs them by tokens (or "
    "by a weighted loss's weights)",
    "rng_reseeded": "random draws do not depend on the state the window starts from: a seed is set inside",
    "seed_inside_window": "(note) a seed is set inside the window, but nothing random is drawn",
    "partial_window": "a window of K − 1 micro-batches is not normalized by its own size",
    "partial_window_not_checked": "(note) the step refused a window of K − 1 micro-batches",
    "step_raised": "your step raised an exception (the checker reports it instead of crashing)",
    "model_fails_on_micro_batch": "the model raises on a micro-batch of b samples (BatchNorm with b = 1)",
    "non_finite": "inf or NaN in the gradient",
    "no_gradient": "the step left no gradient in the model it was given",
    "optimizer_not_on_model": "(note) the step steps an optimizer built on another model",
    "micro_batches_differ": "the step's forward passes do not see the K equal micro-batches once each",
    "weights_differ": "micro-batches weighed differently from the full batch, in no known pattern",
    "randomness_not_replayed": "(inconclusive) random draws the checker could not give each sample in every pass",
    "autocast_precision": "(inconclusive) a small difference from a step run under torch.autocast",
    "gradient_cancels": "(inconclusive) the micro-batch gradients cancel: the full batch's is too small to compare",
    "gradient_out_of_range": "(inconclusive) gradients all subnormal, or too large to square in float64",
    "unexplained": "a difference none of the fingerprints explains",
    "checker_error": "(inconclusive) the checker's own instruments raised while your step ran: a bug in gradaccum",
}


#: The loop the checker compares with, in four lines (what "compare your loop" means).
CORRECT_LOOP = (
    "compare your loop with the correct one: optimizer.zero_grad(); for xb, yb in zip(x.chunk(K), "
    "y.chunk(K)): (loss_fn(model(xb), yb) / K).backward(); then, once, clip (if you clip) and "
    "optimizer.step()"
)


PLACEMENT_TEXT = {
    "scaled_micro": "each micro-batch's 1/K-scaled gradient clipped on its own, then summed (chapter 3's (a1))",
    "raw_micro": "each micro-batch's raw gradient clipped, then averaged (chapter 3's (a2))",
    "running": "the running .grad buffer clipped after every backward (chapter 3's (b))",
}


#: The fix a BatchNorm ``batch_coupled_layer`` finding names: remove the coupling, compute the full batch's statistics
#: exactly, or keep per-micro-batch statistics on purpose and accept the finding.
BN_FIX = (
    "GroupNorm/LayerNorm (no batch coupling); gradaccum.full_batch_stats_backward (exact full-batch "
    "statistics); or keep per-micro-batch statistics deliberately (gradaccum.ghostify: GhostBatchNorm) and "
    "accept the difference with allow=['batch_coupled_layer'] (--allow batch_coupled_layer); running "
    "statistics are also updated K times per step: PreciseBN (chapters 1, 2)"
)


#: What every zero_grad_inside_window finding says the cause is.
ZERO_GRAD_CAUSE = "zero_grad() inside the window: the gradient buffer is emptied between micro-batches"


#: The ``double_1_over_k`` finding's cause and fix. Two loops give a step 1/K of the full batch's: a mean loss
#: divided by K twice, and a loss with ``reduction="sum"`` divided by K once (its micro-batch sums already add up to
#: the full batch's sum).
_DOUBLE_1_OVER_K = (
    "one 1/K too many: the gradient is K times too small (1/K applied twice, or a summed loss divided by K)"
)


_DOUBLE_1_OVER_K_FIX = (
    "divide by K once, and only a mean: either each micro-batch's loss, or the gradients before "
    "the step; a loss_fn with reduction='sum' needs no 1/K at all for micro-batches of equal size"
)


#: What ``Report.counts`` counts (0 everywhere when the step did not run, e.g. an inconclusive verdict).
COUNTED = (
    "backward",
    "optimizer.step",
    "scheduler.step",
    "scaler.step",
    "scaler.update",
    "scaler.unscale_",
    "clip",
    "zero_grad",
    "seed",
)


@dataclass
class Report:
    """The result of :func:`check`: the verdict (``ok``), the measurements, and the findings."""

    k: int
    rel_error: float
    cosine: float
    tolerance: float
    findings: list[Finding] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    weights: list[float] | None = None
    expected_weights: list[float] | None = None
    counts: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    micro_batch: int = 0
    batch: int = 0
    #: Codes the caller declared expected (``check(..., allow=[...])``): still reported, not held against ``ok``.
    allowed: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """True when the accumulated step equals the full-batch step and no bug (or open question) was found; an
        allowed finding does not count, and when one was found the gradients may differ by what it explains."""
        judged = [f for f in self.findings if f.code not in self.allowed]
        explained = any(f.code in self.allowed and f.severity == "bug" for f in self.findings)
        equal = math.isfinite(self.rel_error) and self.rel_error <= self.tolerance
        return (equal or explained) and not any(f.severity in ("bug", "inconclusive") for f in judged)

    @property
    def codes(self) -> list[str]:
        """The codes of the bugs (and inconclusive findings), in the order they were found."""
        return [f.code for f in self.findings if f.severity != "note"]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary (``python -m gradaccum.checker --json`` prints it)."""
        finite = lambda v: v if v is not None and math.isfinite(v) else None  # noqa: E731
        return {
            "ok": self.ok,
            "k": self.k,
            "micro_batch": self.micro_batch,
            "batch": self.batch,
            "rel_error": finite(self.rel_error),
            "cosine": finite(self.cosine),
            "tolerance": self.tolerance,
            "weights": self.weights,
            "expected_weights": self.expected_weights,
            "counts": self.counts,
            "findings": [f.to_dict() for f in self.findings],
            "notes": self.notes,
            "warnings": self.warnings,
            "events": self.events,
            "allowed": list(self.allowed),
        }

    def __str__(self) -> str:
        if not math.isfinite(self.rel_error):
            error = "not measured"
        elif self.rel_error <= self.tolerance:
            error = f"below the tolerance {self.tolerance:.0e}"
        else:
            cosine = "undefined (a zero gradient)" if math.isnan(self.cosine) else f"{self.cosine:.4f}"
            error = f"{self.rel_error:.2e}, cosine {cosine} (tolerance {self.tolerance:.0e})"
        lines = [f"gradaccum.check, K = {self.k}: accumulated vs full-batch gradient: relative error {error}"]
        lines += ["  warning raised by your step: " + w for w in self.warnings]
        if self.weights is not None and self.expected_weights is not None and not self.ok and self.findings:
            lines.append(f"  micro-batch weights: yours {nums(self.weights)}, full batch {nums(self.expected_weights)}")
        lines += ["  " + n for n in self.notes]
        if self.ok and not self.findings:
            return "\n".join(lines + ["  OK: accumulation computes the full-batch gradient."])
        return "\n".join(lines + [("  (allowed) " if f.code in self.allowed else "  ") + str(f) for f in self.findings])

    __repr__ = __str__


class _Findings:
    """Findings by code, in the order they were raised; a second report of the same code adds evidence."""

    def __init__(self) -> None:
        self.by_code: dict[str, Finding] = {}
        # a clip_grad_value_ inside the window that bit: it changes the gradient's direction, so a gradient that is
        # no combination of the micro-batch gradients is explained by it, not "unexplained"
        self.value_clip_bit = False

    def add(self, code: str, cause: str, evidence: str, fix: str, chapter: int | None, severity: str = "bug") -> None:
        if code in self.by_code:
            old = self.by_code[code]
            if evidence and evidence not in old.evidence:
                self.by_code[code] = Finding(
                    code, old.cause, old.evidence + "; " + evidence, old.fix, old.chapter, old.severity
                )
            return
        self.by_code[code] = Finding(code, cause, evidence, fix, chapter, severity)

    def remove(self, codes: set[str]) -> None:
        for code in codes:
            self.by_code.pop(code, None)

    def __contains__(self, code: str) -> bool:
        return code in self.by_code

    def list(self) -> list[Finding]:
        return list(self.by_code.values())
