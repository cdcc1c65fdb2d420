r"""What the three integrations share: the window they check, the run's optimizers and schedulers rebuilt on the
checker's copy of the model, and what they do with the verdict.

**The window.** A training micro-batch of :math:`B` samples is cut into :math:`K` micro-batches of
:math:`b = \lfloor B/K \rfloor` samples (``micro_batch_size`` sets :math:`b`), so the whole window the check runs
— the full batch of :math:`bK \le B` samples included — fits where one training micro-batch fits. When
:math:`B < K`, :math:`b = 1` and the window takes its :math:`K` samples from the run's first batches.

**The verdict.** ``on_bug``: ``"raise"`` raises :class:`AccumulationBug` (the default: a check that found a bug
stops everything, loudly), ``"stop"`` logs the report and stops the run the framework's own way, ``"warn"``
warns and training goes on. Only findings of severity ``bug`` that ``allow`` does not list count; an inconclusive
verdict warns and never stops a run. Every report is logged on the ``gradaccum.integrations`` logger.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from gradaccum._validate import require_count
from gradaccum.checker import Report
from gradaccum.checker.arguments import _allowed_codes

#: What a check does with a bug: raise, stop the run the framework's way, or warn and go on.
ON_BUG = ("raise", "stop", "warn")

LOG = logging.getLogger("gradaccum.integrations")


class AccumulationBug(RuntimeError):
    """A bug the check found in the run's accumulation (``on_bug="raise"``); ``report`` holds the whole report."""

    def __init__(self, report: Report):
        super().__init__(f"gradient accumulation bug(s) {', '.join(bugs(report))}:\n{report}")
        self.report = report


class AccumulationWarning(UserWarning):
    """A bug (``on_bug="warn"``) or an inconclusive verdict of the check at the start of a run."""


def options(on_bug: Any, allow: Any, micro_batch_size: Any, tolerance: Any) -> tuple[str, tuple[str, ...]]:
    """The integrations' shared options, checked when the callback is made (a bad option is a usage error, not a
    finding of the run): ``on_bug`` and ``allow`` as used."""
    if on_bug not in ON_BUG:
        raise ValueError(f"on_bug must be one of {', '.join(repr(o) for o in ON_BUG)}, got {on_bug!r}.")
    if micro_batch_size is not None:
        require_count(micro_batch_size, "micro_batch_size (samples per micro-batch of the checked window)")
    if tolerance is not None and (
        isinstance(tolerance, bool)
        or not isinstance(tolerance, (int, float))
        or not math.isfinite(tolerance)
        or tolerance <= 0
    ):
        raise ValueError(f"tolerance must be a positive finite number or None, got {tolerance!r}.")
    return on_bug, _allowed_codes(list(allow))


def bugs(report: Report) -> list[str]:
    """The codes of the bugs the check found that ``allow`` does not accept."""
    return [f.code for f in report.findings if f.severity == "bug" and f.code not in report.allowed]


def act(report: Report, on_bug: str, stop: Callable[[], None], where: str) -> None:
    """Log ``report`` and act on it: raise, call ``stop`` (the framework's way of ending a run) or warn."""
    found = bugs(report)
    if not found:
        if report.ok:
            LOG.info("%s: gradient accumulation checked on the run's first window\n%s", where, report)
        else:  # inconclusive: the check could not decide; the run goes on
            LOG.warning("%s: the accumulation check is inconclusive\n%s", where, report)
            warnings.warn(
                f"{where}: the accumulation check is inconclusive:\n{report}", AccumulationWarning, stacklevel=3
            )
        return
    LOG.error("%s: gradient accumulation bug(s) %s\n%s", where, ", ".join(found), report)
    if on_bug == "raise":
        raise AccumulationBug(report)
    if on_bug == "stop":
        stop()
    else:
        warnings.warn(
            f"{where}: gradient accumulation bug(s) {', '.join(found)}:\n{report}", AccumulationWarning, stacklevel=3
        )


# ------------------------------------------------------------------------------------------------- the window


def rows_needed(first: int, k: int, micro_batch_size: int | None) -> tuple[int, int]:
    """``(b, b·K)``: the checked micro-batch size and the window's samples, from a first batch of ``first``."""
    b = micro_batch_size or max(1, first // k)
    return b, b * k


def first_batches(
    loader: Iterable, rows: Callable[[Any], int], k: int, micro_batch_size: int | None
) -> tuple[list[Any], int]:
    """The run's first batches, enough for the window, and its samples: read from a fresh iterator of ``loader``
    with torch's random state and the loader's own generator put back afterwards (a shuffling sampler draws its
    order from one of them), so the run itself still sees its data in the order it would have."""
    batches: list[Any] = []
    owners = [
        loader,
        getattr(loader, "sampler", None),
        getattr(getattr(loader, "batch_sampler", None), "sampler", None),
    ]
    generators = {id(g): g for g in (getattr(o, "generator", None) for o in owners) if isinstance(g, torch.Generator)}
    states = [(g, g.get_state()) for g in generators.values()]  # a loader's own generator draws its order
    try:
        with torch.random.fork_rng(devices=[]):
            for batch in loader:
                batches.append(batch)
                need = rows_needed(rows(batches[0]), k, micro_batch_size)[1]
                if sum(rows(b) for b in batches) >= need:
                    return batches, need
    finally:
        for g, state in states:
            g.set_state(state)
    raise ValueError(
        f"the training data holds {sum(rows(b) for b in batches)} samples, fewer than one checked "
        f"window of K = {k} micro-batches needs; pass a smaller micro_batch_size, or train on more."
    )


def concat(columns: Sequence[Sequence[torch.Tensor]], n: int) -> list[torch.Tensor]:
    """Each column (one tensor per batch) joined along the samples and cut to ``n``: ``ValueError`` where the
    batches differ in shape beyond the samples (padding to each batch's own length)."""
    joined = []
    for parts in columns:
        shapes = {tuple(p.shape[1:]) for p in parts}
        if len(shapes) > 1:
            raise ValueError(
                f"the run's first batches differ in shape beyond the samples ({sorted(shapes)}: padded "
                "to each batch's length?), and one checked window needs several of them; pass "
                "micro_batch_size=1 with batches of at least K samples, or pad to one fixed length."
            )
        joined.append(torch.cat(list(parts))[:n] if len(parts) > 1 else parts[0][:n])
    return joined


# ------------------------------------------------------------------ the run's optimizers, on the checker's copy


def _track_steps(opt: torch.optim.Optimizer) -> None:
    """What an LR scheduler's constructor does to its optimizer (torch wraps ``step`` to warn about a scheduler
    stepped first): done again for a copy, whose wrapper would otherwise point at the original."""
    if hasattr(opt.step, "_wrapped_by_lr_sched"):
        return
    func, owner = type(opt).step, weakref.ref(opt)

    @functools.wraps(func)
    def step(*args: Any, **kwargs: Any) -> Any:
        target = owner()
        assert target is not None, "the optimizer was freed while stepping"
        target._opt_called = True  # type: ignore[attr-defined]
        return func(target, *args, **kwargs)

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    opt.step = step  # type: ignore[method-assign]


#: A framework's wrapper around the torch optimizer or scheduler, and the attribute that holds it.
_WRAPPERS = {
    "AcceleratedOptimizer": "optimizer",
    "AcceleratedScheduler": "scheduler",
    "LightningOptimizer": "_optimizer",
}


def unwrap(obj: Any) -> Any:
    """The torch optimizer or scheduler inside a framework's wrapper (Accelerate's ``AcceleratedOptimizer`` and
    ``AcceleratedScheduler``, Lightning's ``LightningOptimizer``); anything else as it is."""
    while type(obj).__name__ in _WRAPPERS and hasattr(obj, _WRAPPERS[type(obj).__name__]):
        obj = getattr(obj, _WRAPPERS[type(obj).__name__])
    return obj


def rebuild(
    model: nn.Module, work: nn.Module, optimizers: Sequence[Any], schedulers: Sequence[Any]
) -> tuple[list[torch.optim.Optimizer], list[Any]]:
    """The run's optimizers and schedulers, copied onto ``work`` (a deep copy of ``model``, as the checker makes):
    every parameter is mapped to its copy, and the hyperparameters, state and schedule position carry over. A
    scheduler built on a framework's wrapper of an optimizer (the Trainer builds its scheduler on Accelerate's)
    gets the copy of the torch optimizer inside."""
    memo: dict[int, Any] = {id(p): q for p, q in zip(model.parameters(), work.parameters())}
    opts = []
    for o in optimizers:
        opts.append(copy.deepcopy(unwrap(o), memo))  # the memo maps the optimizer to its copy from now on
        memo[id(o)] = opts[-1]
    for s in schedulers:
        inner = getattr(unwrap(s), "optimizer", None)
        if inner is not None and id(unwrap(inner)) in memo:
            memo[id(inner)] = memo[id(unwrap(inner))]
    scheds = [copy.deepcopy(unwrap(s), memo) for s in schedulers]
    for s in scheds:
        if isinstance(getattr(s, "optimizer", None), torch.optim.Optimizer):
            _track_steps(s.optimizer)
    return opts, scheds
