r"""Check *your* training step: does accumulating K micro-batches compute what one full batch would?

``check(model, loss_fn, x, y, k, step=None)`` runs one accumulated window — your own loop if you pass ``step`` — and
one full-batch pass from the same state, under the same randomness (dropout masks are drawn per sample, so a
sample gets the same mask in the full batch and in its micro-batch), and compares the gradients. It measures how
your step weighs each micro-batch's gradient, what it calls (optimizer, scheduler, ``GradScaler``, ``zero_grad``,
clipping, seeding: seen by the code that runs, however it was imported), how the ``.grad`` buffer evolves between
backward passes, which layers couple the samples of a batch, and how the loss weighs micro-batches (token counts),
and names every cause it finds with its evidence and fix (see :mod:`gradaccum.check_fingerprints`). An exception
inside your step is reported as a finding. It works on copies and restores the random state: your model and random
streams are left as they were.

``step(model, loss_fn, x, y, k)`` does what your training loop does for one window of K micro-batches: either
between ``zero_grad()`` and ``optimizer.step()`` (leaving the gradient in ``.grad``), or a whole iteration with an
optimizer and scheduler built inside ``step`` from ``model.parameters()`` (the gradient at its optimizer step is
compared). It is also called once with the first K − 1 micro-batches and ``k = K − 1``, as the last partial window
of an epoch. Command line::

    python -m gradaccum.check my_module:make -k 4    # make() returns (model, loss_fn, x, y) or (..., step)
    python -m gradaccum.book.check_demo              # the book's demo: every planted bug, and correct loops

Exit status: 0 no bug found, 1 a bug found (or no verdict possible), 2 a usage error.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import importlib.util
import json
import math
import os
import random
import sys
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from gradaccum._validate import require_k
from gradaccum.accumulate import accumulate_backward, split_batch
from gradaccum.check_fingerprints import (
    PARTIAL_OK,
    Finding,
    Measurements,
    clip_vec,
    cosine,
    diagnose,
    fit_weights,
    num,
    nums,
    rel,
)
from gradaccum.check_instrument import (
    CallRecorder,
    Event,
    GradTrace,
    OutsideDraws,
    SampleRNG,
    coupled_modules,
    first_tensor,
    flat,
    identical_draws,
)
from gradaccum.windows import token_loss

Step = Callable[[nn.Module, Callable, torch.Tensor, torch.Tensor, int], Any]

#: What ``Report.counts`` counts (0 everywhere when the step did not run, e.g. an inconclusive verdict).
COUNTED = ("backward", "optimizer.step", "scheduler.step", "scaler.step", "scaler.update", "scaler.unscale_", "clip",
           "zero_grad", "seed")


__all__ = ["Finding", "Report", "check", "main", "token_cross_entropy"]


#: How much longer than the full batch's gradient the micro-batch gradients may be, on average, before the default
#: tolerance is widened in proportion (their rounding, not the sum's, sets the error of a cancelling sum).
CANCELLATION = 10.0
#: Beyond this, the full batch's gradient is rounding noise of its micro-batches' (1000× shorter): inconclusive.
CANCELLATION_LIMIT = 1000.0


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

    @property
    def ok(self) -> bool:
        """True when the accumulated step equals the full-batch step and no bug (or open question) was found."""
        return (math.isfinite(self.rel_error) and self.rel_error <= self.tolerance
                and not any(f.severity in ("bug", "inconclusive") for f in self.findings))

    @property
    def codes(self) -> list[str]:
        """The codes of the bugs (and inconclusive findings), in the order they were found."""
        return [f.code for f in self.findings if f.severity != "note"]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary (``python -m gradaccum.check --json`` prints it)."""
        finite = lambda v: v if v is not None and math.isfinite(v) else None  # noqa: E731
        return {"ok": self.ok, "k": self.k, "micro_batch": self.micro_batch, "batch": self.batch,
                "rel_error": finite(self.rel_error), "cosine": finite(self.cosine), "tolerance": self.tolerance,
                "weights": self.weights, "expected_weights": self.expected_weights, "counts": self.counts,
                "findings": [f.to_dict() for f in self.findings], "notes": self.notes, "warnings": self.warnings,
                "events": self.events}

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
            lines.append(f"  micro-batch weights: yours {nums(self.weights)}, "
                         f"full batch {nums(self.expected_weights)}")
        lines += ["  " + n for n in self.notes]
        if self.ok and not self.findings:
            return "\n".join(lines + ["  OK: accumulation computes the full-batch gradient."])
        return "\n".join(lines + ["  " + str(f) for f in self.findings])

    __repr__ = __str__


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _transformed(t: torch.Tensor) -> bool:
    """Whether ``t`` is a torch.func wrapper (inside ``vmap`` or ``grad``)."""
    check = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
    return bool(check(t)) if check is not None else False


class _ForwardScope:
    """Forward hooks on a model copy: each forward pass learns which samples of the window it holds (by value,
    so copies and moved tensors are recognized), and the per-sample RNG is active inside it."""

    def __init__(self, model: nn.Module, rng: SampleRNG, x: torch.Tensor):
        self.rng, self.n = rng, x.shape[0]
        self.model = model
        self.modes: list[bool] | None = None  # every module's training flag at the first forward pass
        self.rows = x.detach().reshape(self.n, -1)
        self.seen = 0
        self.unlocated = 0  # forward passes whose input is not a run of consecutive rows of x
        self.expect: int | None = None
        self.forwards: list[tuple[int, int]] = []
        self.transformed = 0  # forward passes inside torch.func transforms
        self.depth = 0
        self.handles = [model.register_forward_pre_hook(self._pre, with_kwargs=True),
                        model.register_forward_hook(self._post, always_call=True)]

    def _locate(self, inp: torch.Tensor | None, n: int) -> int:
        guess = self.expect if self.expect is not None else self.seen % self.n
        self.expect = None
        if inp is None or not n or n > self.n:
            return guess
        q = inp.detach().reshape(n, -1)
        if q.shape[1] != self.rows.shape[1] or q.dtype != self.rows.dtype:
            return guess
        q = q.to(self.rows.device)
        if guess + n <= self.n and torch.equal(self.rows[guess:guess + n], q):
            return guess
        for i in (self.rows == q[0]).all(1).nonzero().flatten().tolist():
            if i + n <= self.n and torch.equal(self.rows[i:i + n], q):
                return i
        self.unlocated += 1
        return guess

    def _pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        inp = first_tensor(args)
        if inp is None:
            inp = first_tensor(kwargs)
        if inp is not None and _transformed(inp):
            # a forward inside torch.func (vmap, grad: per-sample gradients): its input is a wrapper whose values
            # the checker cannot read, and one sample at a time; counted, and the check says so
            self.transformed += 1
            return
        n = int(inp.shape[0]) if inp is not None and inp.dim() else 0
        offset = self._locate(inp, n)
        self.seen = offset + n
        if torch.is_grad_enabled():  # a forward under no_grad (logging, a probe) never reaches a backward pass
            self.forwards.append((offset, n))
        if self.depth == 0:
            if self.modes is None:
                self.modes = [m.training for m in self.model.modules()]
            self.rng.start_forward(offset, n)
            self.rng.__enter__()
        self.depth += 1

    def _post(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        inp = first_tensor(args)
        if inp is not None and _transformed(inp):
            return
        if self.depth > 0:
            self.depth -= 1
            if self.depth == 0:
                self.rng.__exit__(None, None, None)

    def close(self) -> None:
        while self.depth > 0:
            self.depth -= 1
            if self.depth == 0:
                self.rng.__exit__(None, None, None)
        for h in self.handles:
            h.remove()


@dataclass
class _Run:
    applied: torch.Tensor
    passes: list
    events: list[Event]
    error: BaseException | None
    warnings: list[str]
    forwards: list[tuple[int, int]]
    replayed: int
    unreplayed: list[str]
    draws: list
    recorder_errors: list[str]
    outside: list[str] = field(default_factory=list)
    bn_reruns: dict[str, tuple[int, int]] = field(default_factory=dict)
    modes: list[bool] | None = None
    unlocated: int = 0
    unpreserved_draws: int = 0  # random draws in recomputations of functions checkpointed without their RNG state
    transformed: int = 0  # forward passes inside torch.func transforms


def _run_step(model: nn.Module, loss_fn: Callable, x: torch.Tensor, y: torch.Tensor, k: int, step: Step, seed: int,
              mode: str = "replay", start: int | None = None, plans: dict | None = None) -> _Run:
    """Run ``step`` on a copy of ``model``: randomness replayed per sample (``mode="replay"``, calls recorded) or
    recorded as drawn (``mode="record"``, from ``torch.manual_seed(start)``)."""
    work = copy.deepcopy(model)
    work.zero_grad(set_to_none=True)
    params = _trainable(work)
    trace = GradTrace(params)
    recorder = CallRecorder(params, trace)
    trace.scale_now = recorder.scale_now
    rng = SampleRNG(seed, replay=(mode == "replay"), plans=plans)
    recorder.mute = lambda: rng.busy > 0
    rng.unpreserved = recorder.recomputing_unpreserved
    scope = _ForwardScope(work, rng, x) if mode == "replay" else None
    reruns = _BatchNormReruns(work)
    torch.manual_seed(seed if start is None else start)
    error = None
    trace.attach()
    with warnings.catch_warnings(record=True) as raised:
        warnings.simplefilter("always")
        try:
            calls = recorder.active() if mode == "replay" else nullcontext()
            outside = (OutsideDraws(lambda: scope is not None and scope.depth > 0) if mode == "replay" else
                       nullcontext())
            if isinstance(outside, OutsideDraws):
                outside.unpreserved = recorder.recomputing_unpreserved
            with calls, (rng if mode == "record" else outside):
                step(work, loss_fn, x, y, k)
        except Exception as err:  # a finding, never a crash of the checker
            error = err
        finally:
            if scope is not None:
                scope.close()
            trace.detach()
            rerun_counts = reruns.close()
    applied = recorder.applied if recorder.applied is not None else flat(params)
    caught = list(dict.fromkeys(str(w.message).split(". ")[0] for w in raised))
    return _Run(applied, trace.passes, recorder.events, error, caught, scope.forwards if scope else [],
                rng.replayed, rng.unreplayed, rng.draws, recorder.errors,
                outside.draws if isinstance(outside, OutsideDraws) else [], rerun_counts,
                scope.modes if scope else None, scope.unlocated if scope else 0,
                rng.unpreserved_draws + (outside.unpreserved_draws if isinstance(outside, OutsideDraws) else 0),
                scope.transformed if scope else 0)


class _BatchNormReruns:
    """Forward pre-hooks on every BatchNorm layer of ``work`` that updates an exponential running average (training
    mode, running statistics, a nonzero momentum): calls made during the step's forward passes, and calls made while
    autograd runs a backward pass — the recomputation of activation checkpointing (reentrant or not, nested, or
    around the whole model), which moves the running statistics again."""

    def __init__(self, work: nn.Module):
        self.counts: dict[str, list[int]] = {}
        self.handles = []
        for name, layer in work.named_modules():
            if isinstance(layer, _BatchNorm):
                self.counts[name or "(the model)"] = [0, 0]
                self.handles.append(layer.register_forward_pre_hook(
                    lambda m, _args, c=self.counts[name or "(the model)"]: self._count(m, c)))

    @staticmethod
    def _count(layer: nn.Module, count: list[int]) -> None:
        # momentum None (a cumulative average) or 0 (frozen, as checkpoint_keeping_bn_stats reruns): no drift
        if layer.training and getattr(layer, "track_running_stats", False) and getattr(layer, "momentum", None):
            count[torch._C._current_graph_task_id() != -1] += 1  # inside a backward pass: a recomputation

    def close(self) -> dict[str, tuple[int, int]]:
        for h in self.handles:
            h.remove()
        return {name: (c[0], c[1]) for name, c in self.counts.items() if c[1]}


def _unpreserved_finding(run: _Run) -> Finding | None:
    """``checkpoint_rng_not_preserved`` when backward recomputed random draws inside a function that the step
    checkpointed with ``preserve_rng_state=False``."""
    calls = sum(e.kind == "checkpoint" for e in run.events)
    if not calls or not run.unpreserved_draws or run.error is not None:
        return None
    return Finding(
        "checkpoint_rng_not_preserved", "activation checkpointing with preserve_rng_state=False around a forward "
        "that draws random numbers (dropout)", f"{calls} checkpoint call(s) with preserve_rng_state=False; backward "
        f"recomputed {run.unpreserved_draws} random op call(s) inside them: torch does not restore the random state "
        "for the recomputation, so it draws new masks and the gradient belongs to other masks than the forward's "
        "(the checker replays masks per sample, so the comparison cannot show it)", "drop "
        "preserve_rng_state=False (the default saves and restores the random state), or switch the randomness off "
        "in the checkpointed part", 6)


def _bn_rerun_finding(reruns: dict[str, tuple[int, int]]) -> Finding | None:
    """A BatchNorm layer whose forward ran again during backward (activation checkpointing): every rerun in
    training mode moves the running averages once more, with the same statistics, so r = (forward + rerun
    calls) / forward calls updates act as one of momentum :math:`1-(1-m)^r` (chapter 8)."""
    if not reruns:
        return None
    shown = "; ".join(f"{name!r}: {calls} call(s) in forward passes, {again} more during backward"
                      for name, (calls, again) in list(reruns.items())[:3])
    ratios = {name: (calls + again) / calls for name, (calls, again) in reruns.items() if calls}
    distinct = sorted(set(ratios.values()))
    if len(distinct) > 1:  # nested checkpoints: a layer recomputed r times has its own r
        per_layer = "; ".join(f"{name!r}: r = {r:g}" for name, r in list(ratios.items())[:3])
        effect = f"1 - (1 - m)^r instead of m, with r per layer ({per_layer})"
        fix = "set each layer's momentum to 1 - (1 - m)^(1/r) with its own r"
    else:
        r = distinct[0] if distinct else 2.0
        effect = f"1 - (1 - m)^{r:g} instead of m"
        fix = f"set the momentum to 1 - (1 - m)^(1/{r:g})"
    return Finding(
        "bn_stats_updated_twice", "BatchNorm running statistics are updated again when backward recomputes the "
        "forward (activation checkpointing)",
        f"{shown}: every recomputation in training mode moves the running averages once more, so the effective "
        f"momentum per micro-batch is {effect}",
        "recompute with the statistics frozen (gradaccum.coupled.checkpoint_keeping_bn_stats around every "
        f"checkpointed call, nested ones included), or {fix}; the gradient "
        "itself is unaffected", 8)


@dataclass
class _Refs:
    basis: torch.Tensor
    full: torch.Tensor
    out: torch.Tensor
    error: BaseException | None
    micro: int
    plans: dict
    unreplayed: list[str] = field(default_factory=list)
    recomputed: list[str] = field(default_factory=list)


def _references(model: nn.Module, loss_fn: Callable, x: torch.Tensor, y: torch.Tensor, k: int, seed: int) -> _Refs:
    r"""The full-batch gradient and the micro-batch gradients :math:`h_j`, randomness replayed per sample (the
    full batch runs first: it decides how each random op splits into samples, for every later pass)."""
    work = copy.deepcopy(model)
    params = _trainable(work)
    buffers = {name: b.detach().clone() for name, b in work.named_buffers()}
    live = dict(work.named_buffers())
    rng = SampleRNG(seed)
    scope = _ForwardScope(work, rng, x)
    # random draws outside the forward passes: backward recomputing a checkpointed forward with dropout
    recomputed = OutsideDraws(lambda: scope.depth > 0)
    b = x.shape[0] // k

    def reset() -> None:
        with torch.no_grad():
            for name, value in buffers.items():
                live[name].copy_(value)
        work.zero_grad(set_to_none=True)
        torch.manual_seed(seed)

    try:
        recomputed.__enter__()
        reset()
        scope.expect = 0
        out = work(x)
        try:
            loss_fn(out, y).backward()
        except RuntimeError as err:
            raise ValueError(f"loss_fn(model(x), y).backward() raised: {err}; the checker needs a loss that is "
                             "differentiable with respect to the model's trainable parameters.") from err
        full = flat(params)
        if not bool(full.ne(0).any()):
            raise ValueError("the full batch's gradient is exactly zero (are all its targets ignore_index or padding? "
                             "does the loss depend on the trainable parameters?): there is nothing to compare a "
                             "window with; pass a batch with counted targets.")
        basis = []
        for j, (xb, yb) in enumerate(split_batch(x, y, k)):
            reset()
            scope.expect = j * b
            try:
                loss_fn(work(xb), yb).backward()
            except Exception as err:
                return _Refs(torch.empty(0), torch.empty(0), torch.empty(0), err, j + 1, rng.plans)
            basis.append(flat(params))
        return _Refs(torch.stack(basis), full, out.detach(), None, 0, rng.plans, rng.unreplayed, recomputed.draws)
    finally:
        recomputed.__exit__(None, None, None)
        scope.close()


@dataclass
class _Probe:
    weights: list[float]
    residual: float
    tokens: list[int]
    moved: list[float] | None = None  # the weights again at moved outputs, where they follow the outputs
    thr: float = 1e-9  # what counts as equal in this reading (a thousand roundings of the loss's dtype)


def _loss_probe(loss_fn: Callable, out: torch.Tensor, y: torch.Tensor, k: int, b: int) -> _Probe:
    r"""How the loss weighs micro-batches, measured on the loss alone: with :math:`G` its gradient with respect to
    the full batch's output and :math:`G_j` the gradient of micro-batch j's loss with respect to its part,
    :math:`f_j = \langle G[j], G_j\rangle / \|G_j\|^2`; ``residual`` is how far :math:`G[j]` is from
    :math:`f_j G_j` (0 for a loss that is a sum over positions, to the rounding of the loss's dtype: ``thr``).
    ``tokens``: positions with a non-zero gradient (padding and ignored targets have none).

    A loss whose weights are fixed by the targets or by counts (a token mean, a class-weighted mean, a mean over
    the non-zero losses) keeps the same :math:`f_j` when the outputs move a little. ``moved`` holds the weights at
    outputs moved by a thousandth of their spread (a hundredth below float64; three random directions) when they
    change with the outputs, smoothly (moving the other way changes them by as much, with the opposite sign): a
    batch-wide value of the outputs sets them (a logsumexp or softmax over the samples' losses, the square root of
    a mean), which no fixed normalization reproduces."""
    n = out.shape[0]
    dim = 0 if out.shape[0] == n else next(d for d, s in enumerate(out.shape) if s == n)
    base = out.detach().double()
    weights, residuals, tokens = _probe_at(loss_fn, base, out.dtype, y, k, b, dim)
    thr = max(1e-9, 1000 * torch.finfo(out.dtype).eps) if out.is_floating_point() else 1e-9
    probe = _Probe(weights, max(residuals), tokens, thr=thr)
    top = max(abs(f) for f in weights) if weights else 0.0
    if n < 2 or top == 0 or not out.is_floating_point():
        return probe
    eps = 1e-3 if out.dtype == torch.float64 else max(1e-2, 16 * torch.finfo(out.dtype).eps)
    noise = max(1e-12, 100 * torch.finfo(out.dtype).eps) * top  # the rounding of weights read in the loss's dtype
    for seed in range(3):  # three random directions: one may leave the weights nearly where they were
        step = eps * float(base.std()) * torch.randn(base.shape, generator=torch.Generator().manual_seed(seed),
                                                     dtype=torch.float64)
        try:  # outputs a little away, both ways
            up = _probe_at(loss_fn, base + step, out.dtype, y, k, b, dim)[0]
            down = _probe_at(loss_fn, base - step, out.dtype, y, k, b, dim)[0]
        except Exception:  # noqa: BLE001 (a loss that refuses moved outputs: the weights are read as fixed)
            return probe
        rise = [u - f for u, f in zip(up, weights)]
        fall = [d - f for d, f in zip(down, weights)]
        largest = max(max(abs(r) for r in rise), max(abs(f) for f in fall))
        if largest > 10 * noise and all(math.isfinite(r) and math.isfinite(f) and abs(r + f) <= 0.1 * largest + noise
                                         for r, f in zip(rise, fall)):
            probe.moved = up
            break
    return probe


def _probe_at(loss_fn: Callable, o: torch.Tensor, dtype: torch.dtype, y: torch.Tensor, k: int, b: int,
              dim: int) -> tuple[list[float], list[float], list[int]]:
    """:func:`_loss_probe`'s reading at the (float64) outputs ``o``, the loss computed in ``dtype``: weights,
    residuals and tokens."""
    o = o.detach().clone().requires_grad_()
    full = loss_fn(o.to(dtype), y)
    (g_full,) = torch.autograd.grad(full, o, allow_unused=True)
    g_full = torch.zeros_like(o) if g_full is None else g_full
    weights, residuals, tokens = [], [], []
    for j in range(k):
        oj = o.detach().narrow(dim, j * b, b).clone().requires_grad_()
        (gj,) = torch.autograd.grad(loss_fn(oj.to(dtype), y[j * b:(j + 1) * b]), oj, allow_unused=True)
        gj = torch.zeros_like(oj) if gj is None else gj
        gf = g_full.narrow(dim, j * b, b)
        gg = float((gj * gj).sum())
        fj = float((gf * gj).sum()) / gg if gg > 0 else 0.0
        weights.append(fj)
        scale = max(float(gf.norm()), float(gj.norm()) * abs(fj), 1e-300)
        residuals.append(float((gf - fj * gj).norm()) / scale if gg > 0 or float(gf.norm()) > 0 else 0.0)
        nz = (gj != 0)
        tokens.append(int(nz.reshape(*nz.shape[:-1], -1).any(-1).sum()) if gj.dim() >= 2 else int(nz.sum()))
    return weights, residuals, tokens


def _validate_arguments(model: Any, loss_fn: Any, x: Any, y: Any, k: Any, step: Any, clip: Any, tolerance: Any,
              seed: Any) -> None:
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
    if not callable(loss_fn):
        raise ValueError("loss_fn must be callable as loss_fn(model(x), y) and return a scalar tensor.")
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
        raise ValueError("x and y must be tensors whose first dimension is the batch; wrap other inputs in a model "
                         "that takes one tensor.")
    if x.dim() == 0 or y.dim() == 0:
        raise ValueError(f"x and y need a batch dimension (shapes {tuple(x.shape)} and {tuple(y.shape)}); for one "
                         "sample use x[None] and y[None].")
    require_k(k)
    split_batch(x, y, k)
    if step is not None and not callable(step):
        raise ValueError("step must be a function step(model, loss_fn, x, y, k), or None for plain accumulation.")
    for name, value in (("clip", clip), ("tolerance", tolerance)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value <= 0):
            raise ValueError(f"{name} must be a positive finite number or None, got {value!r}.")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}.")
    if not _trainable(model):
        raise ValueError("the model has no trainable parameters to compare gradients of.")
    sparse = [name for name, m in model.named_modules() if getattr(m, "sparse", False) is True]
    if sparse:
        raise ValueError(f"module(s) {sparse[:3]} produce sparse gradients (sparse=True), which the checker cannot "
                         "compare; check a copy built with sparse=False: the gradient's values are the same.")


def _check_outputs(model: nn.Module, loss_fn: Callable, x: torch.Tensor, y: torch.Tensor) -> None:
    try:
        with torch.no_grad():
            out = copy.deepcopy(model)(x)
    except Exception as err:
        raise ValueError(f"model(x) raised {type(err).__name__}: {err}; the checker needs a model that runs on the "
                         "whole batch x.") from err
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"the model must return a tensor that loss_fn can take, got {type(out).__name__}; "
                         "wrap it so that model(x) returns the logits.")
    if out.dim() == 0 or out.shape[0] != x.shape[0]:
        raise ValueError(f"model(x) must return one output per sample (first dimension {x.shape[0]}), got shape "
                         f"{tuple(out.shape)}.")
    try:
        with torch.no_grad():
            loss = loss_fn(out, y)
    except Exception as err:
        raise ValueError(f"loss_fn(model(x), y) raised {type(err).__name__}: {str(err).strip().splitlines()[0]}; "
                         "the checker needs a loss that takes the whole batch's output and targets (class indices "
                         "as int64, within the number of classes).") from err
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError("loss_fn(model(x), y) must return a scalar tensor (a mean or sum over the batch).")


class _Restore:
    """Restores the model's parameters, buffers and gradients and Python's and NumPy's random states."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.grads = [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]
        self.py = random.getstate()
        self.np = sys.modules["numpy"].random.get_state() if "numpy" in sys.modules else None

    def grads_changed(self) -> bool:
        """Whether a parameter's ``.grad`` differs from what it was when the check began."""
        for p, g in zip(self.model.parameters(), self.grads):
            now = p.grad
            if (now is None) != (g is None) or (now is not None and g is not None and not torch.equal(now, g)):
                return True
        return False

    def __call__(self) -> None:
        with torch.no_grad():
            for name, value in self.model.state_dict().items():
                value.copy_(self.state[name])
        for p, g in zip(self.model.parameters(), self.grads):
            p.grad = g
        random.setstate(self.py)
        if self.np is not None:
            sys.modules["numpy"].random.set_state(self.np)


def check(model: nn.Module, loss_fn: Callable, x: torch.Tensor, y: torch.Tensor, k: int, step: Step | None = None,
          clip: float | None = None, tolerance: float | None = None, seed: int = 0, partial: bool = True) -> Report:
    """Compare one accumulated window (``step``, or plain accumulation) with one full-batch pass; name causes.

    ``clip``: the threshold your loop clips to (norm); when None and your loop calls ``clip_grad_norm_`` or
    ``clip_grad_value_``, the threshold it used is taken. The full-batch reference is then clipped once.
    ``tolerance``: relative error that counts as equal (default 1e-9 for float64 parameters, 1e-4 for float32,
    8 epsilons of the format for bf16 or fp16 parameters: 6.3e-2 and 7.8e-3).
    ``seed``: seeds the per-sample randomness. ``partial``: also run ``step`` on a partial window of K − 1
    micro-batches (as the last window of an epoch) and report a gradient that is not that window's mean.
    """
    _validate_arguments(model, loss_fn, x, y, k, step, clip, tolerance, seed)
    params = _trainable(model)
    float64 = params[0].dtype == torch.float64
    # parameters held in bf16 or fp16 round every gradient to their format: 8 of its epsilons count as equal
    low = 8 * max(torch.finfo(p.dtype).eps for p in params)
    tol = float(tolerance) if tolerance is not None else (1e-9 if float64 else max(1e-4, low))
    wtol = 1e-9 if float64 else max(1e-5, low)
    n, b = x.shape[0], x.shape[0] // k
    devices = sorted({p.device.index or 0 for p in params if p.device.type == "cuda"})
    restore = _Restore(model)
    try:
        with torch.random.fork_rng(devices=devices):
            _check_outputs(model, loss_fn, x, y)
            report = _check(model, loss_fn, x, y, k, step, clip, tol, wtol, seed, partial, n, b,
                            fixed_tol=tolerance is not None)
            if restore.grads_changed():
                raise ValueError(
                    "your loss_fn or step wrote gradients into the model you passed to check: the checker runs your "
                    "step, and the full batch, on copies of it, so a term computed from that model's own parameters "
                    "(a regularizer written over it in a closure, say) lands in a gradient nobody compares. Leave "
                    "such a term out of the check: the reference is loss_fn on the batch, so a term of the "
                    "parameters alone is not in it even when computed from the model your step is given, and the "
                    "loop's structure, which the check tests, does not depend on it (weight decay belongs in the "
                    "optimizer).")
            return report
    finally:
        restore()


def _out_of_range(basis: torch.Tensor, model: nn.Module, k: int) -> str | None:
    """Why the micro-batch gradients (``basis``, float64, one row each) cannot be compared, or None: every entry
    below the parameters' smallest normal number (subnormal: fewer significant bits than the format, so a
    loss times 1e-42 in float32 reads as a pattern of weights), or squared norms of the K-term sums that
    overflow float64 (inner products and norms turn into inf and NaN)."""
    largest = float(basis.abs().max()) if basis.numel() else 0.0
    tiny = min(torch.finfo(p.dtype).tiny for p in _trainable(model))
    if 0.0 < largest < tiny:
        return (f"the largest micro-batch gradient entry is {largest:.3g}, below the smallest normal number of the "
                f"parameters' format ({tiny:.3g}): every entry is subnormal and rounded to fewer significant bits")
    norm = float(basis.norm(dim=1).max()) if basis.numel() else 0.0
    if not math.isfinite(norm * norm * k * k):
        return (f"a micro-batch gradient's norm ({norm:.3g}) squared, over K = {k} micro-batches, overflows "
                "float64, the format the check compares in")
    return None


def _check(model: nn.Module, loss_fn: Callable, x: torch.Tensor, y: torch.Tensor, k: int, step: Step | None,
           clip: float | None, tol: float, wtol: float, seed: int, partial: bool, n: int, b: int,
           switched: bool = False, fixed_tol: bool = False) -> Report:
    report = Report(k, float("nan"), float("nan"), tol, micro_batch=b, batch=n,
                    counts=dict.fromkeys(COUNTED, 0))
    refs = _references(model, loss_fn, x, y, k, seed)
    if refs.error is not None:
        err = refs.error
        report.findings.append(Finding(
            "model_fails_on_micro_batch", f"the model fails on a micro-batch of {b} sample(s)",
            f"micro-batch {refs.micro}: {type(err).__name__}: {str(err).strip().splitlines()[0]}",
            "use larger micro-batches (BatchNorm needs more than one value per channel) or a per-sample "
            "normalization such as GroupNorm", 1))
        return report
    if refs.unreplayed:
        # a random op that looked per-sample in the full batch (a dimension equal to its size) but not in the
        # micro-batches, e.g. a feature mask torch.rand(16) when the batch has 16 samples: its randomness is not
        # per sample, so the full batch and the micro-batches cannot be given the same draws
        report.findings.append(Finding(
            "randomness_not_replayed", "randomness the checker could not replay per sample",
            f"{len(refs.unreplayed)} random draw(s) in the model's forward could not be cut into samples in every "
            f"pass, e.g. {refs.unreplayed[0]} (a draw per sample has a dimension equal to the batch size in the full "
            f"batch of {n} and in each micro-batch of {b})", "rerun with that randomness switched off (dropout "
            "p = 0) to compare like with like, or draw it with a batch dimension (torch.rand(x.shape[0], ...))", 6,
            "inconclusive"))
        return report
    if refs.recomputed:
        report.findings.append(Finding(
            "randomness_not_replayed", "randomness in a forward pass that backward recomputes (activation "
            "checkpointing with dropout)", f"{len(refs.recomputed)} random draw(s) during backward, e.g. "
            f"{refs.recomputed[0]}: the checker gives every sample its own masks in the forward pass, but cannot "
            "give the recomputation the same ones", "rerun with dropout off (p = 0) or without activation "
            "checkpointing to compare like with like", 6, "inconclusive"))
        # the comparison is out of reach, but a checkpoint that does not restore the random state is still a bug
        unpreserved = _unpreserved_finding(_run_step(model, loss_fn, x, y, k, step or accumulate_backward, seed,
                                                     plans=refs.plans))
        if unpreserved is not None:
            report.findings.insert(0, unpreserved)
        return report
    reach = _out_of_range(refs.basis, model, k)
    if reach is not None:
        report.findings.append(Finding(
            "gradient_out_of_range", "the gradients lie outside the range the comparison can measure", reach,
            "check with the loss at ordinary magnitudes (leave out a constant factor such as a loss scale): the "
            "loop's structure, which the check names, does not depend on it", 1, "inconclusive"))
        return report
    # rounding grows with the terms summed, not with their sum: where the micro-batch gradients cancel (near an
    # optimum) the full batch's gradient is far shorter than they are, and the default tolerance is widened by
    # the excess over CANCELLATION (a typical window's micro-batch gradients are a few times their mean)
    spread = float(refs.basis.norm(dim=1).mean()) / max(float(refs.full.norm()), 1e-300)
    if not fixed_tol and not switched and spread > CANCELLATION_LIMIT:
        report.findings.append(Finding(
            "gradient_cancels", "the micro-batch gradients cancel: the full batch's gradient is too small to "
            "compare with", f"the micro-batch gradients are {spread:.3g}× longer on average than the full batch's "
            f"(as at an optimum): any difference is dominated by their rounding", "check from a state away from the "
            "optimum (the untrained model, an earlier checkpoint), or pass the tolerance you accept", 1,
            "inconclusive"))
        return report
    if not fixed_tol and not switched and spread > CANCELLATION:
        tol, wtol = tol * spread / CANCELLATION, wtol * spread / CANCELLATION
        report.tolerance = tol
        report.notes.append(f"cancellation: the micro-batch gradients are {spread:.3g}× longer on average than the "
                            f"full batch's (they cancel, as near an optimum), so rounding is relative to them: the "
                            f"tolerance is widened to {tol:.2g}")
    run = _run_step(model, loss_fn, x, y, k, step or accumulate_backward, seed, plans=refs.plans)
    if run.transformed:
        report.notes.append(f"torch.func: {run.transformed} forward pass(es) of your step ran inside torch.func "
                            "transforms (vmap, grad); the gradient they produce is compared, but their random draws "
                            "(dropout) are not replayed per sample, and they are not counted as micro-batches")
    given_modes = [m_.training for m_ in model.modules()]
    if run.modes is not None and run.modes != given_modes and not switched:
        # the step switched modes (model.train() on a model handed over in eval mode, as from_pretrained returns
        # it): the full batch must run in the mode the step's forward passes ran in (once: a step that flips the
        # mode it finds is compared in the mode of this first run)
        moved = copy.deepcopy(model)
        for module, training in zip(moved.modules(), run.modes):
            module.training = training
        inner = _check(moved, loss_fn, x, y, k, step, clip, tol, wtol, seed, partial, n, b, switched=True,
                       fixed_tol=True)
        changed = [(name or "(the model)", now) for (name, _), was, now in
                   zip(model.named_modules(), given_modes, run.modes) if was != now]
        parts = [f"{len(group)} module(s) in {mode} mode (e.g. {', '.join(group[:3])})"
                 for mode, group in (("training", [c for c, now in changed if now]),
                                     ("evaluation", [c for c, now in changed if not now])) if group]
        inner.notes.insert(0, f"mode: your step puts {' and '.join(parts)} before its forward passes; the full "
                              "batch was computed in the modes your step uses")
        return inner
    # a clip call with an infinite threshold only measures the norm (a common way to log it): not a clip
    clips = [e for e in run.events if e.kind == "clip" and not _measures_only(e)]
    kind, norm_type, source = "norm", 2.0, None
    thresholds = {(e.detail.get("fn"), e.detail.get("max_norm", e.detail.get("clip_value")),
                   e.detail.get("norm_type", 2.0)) for e in clips}
    given = clip
    if clip is not None:
        source = "the clip argument"
        # v is None when the loop's threshold was not a number (e.g. a tensor); num(None) raises: left as is
        loop = ", ".join(f"{fn} with threshold {num(v)}"  # type: ignore[arg-type]
                         for fn, v, _ in sorted(thresholds, key=str))
        report.notes.append(f"clipping: the full batch is clipped once at threshold {num(clip)} (the clip argument)"
                            + (f"; your loop calls {loop}" if loop else "; your loop makes no clip call"))
    else:
        if len(thresholds) == 1:
            fn, value, norm_type = next(iter(thresholds))
            if value is not None:
                clip, source = value, "your loop's threshold"
                kind = "value" if fn == "clip_grad_value_" else "norm"
                report.notes.append(f"clipping: your loop calls {fn} with threshold {num(clip)}; the full batch is "
                                    "clipped once at the same threshold")
    # clip calls that cannot reach the gradient the step applies (after the last step, or on the empty buffer
    # before the first backward): a bug when no other clip does, harmless beside a clip that does
    misplaced = [(e, where) for e, where in _misplaced_clips(run.events) if not _measures_only(e)]
    placed = [e for e in clips if all(e is not c for c, _ in misplaced)]
    if misplaced and not placed and given is None:
        clip, source = None, None  # compare with the unclipped full batch
        report.notes = [n for n in report.notes if not n.startswith("clipping:")]
    target = clip_vec(refs.full, clip, kind, norm_type) if clip is not None else refs.full
    same = given is None or all(e.detail.get("max_norm", e.detail.get("clip_value")) == given for e in placed)
    by_group = _clipped_by_group(refs.full, placed, model, len(run.passes)) if same else None
    if by_group is not None:
        target = by_group
        report.notes = [n for n in report.notes if not n.startswith("clipping:")]
        report.notes.append(f"clipping: your loop clips {len(placed)} group(s) of parameters on their own, once, "
                            "after the last backward; the full batch is clipped the same way")
    reseeded = None
    seeds = [e for e in run.events if e.kind == "seed"]
    draws = run.replayed + len(run.unreplayed)
    if step is not None and run.error is None and (draws or seeds):
        a = _run_step(model, loss_fn, x, y, k, step, seed, mode="record", start=seed + 1)
        c = _run_step(model, loss_fn, x, y, k, step, seed, mode="record", start=seed + 2)
        if a.error is None and c.error is None:
            reseeded = identical_draws(a.draws, c.draws)
    # misplaced and measuring-only clip calls are reported apart (or not at all)
    shown_events = [e for e in run.events if e.kind != "clip" or any(e is c for c in placed)]
    probe = _loss_probe(loss_fn, refs.out, y, k, b)
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    slices, start = [], 0
    for name, p in zip(names, _trainable(model)):
        slices.append((name, slice(start, start + p.numel())))
        start += p.numel()
    rtol = 1e-9 if wtol < 1e-6 else 1e-4
    m = Measurements(
        k=k, b=b, n=n, tol=tol, wtol=wtol, basis=refs.basis, full=refs.full, target=target, applied=run.applied,
        f=probe.weights, loss_residual=probe.residual, tokens=probe.tokens, f_moved=probe.moved, loss_thr=probe.thr,
        clip=clip, clip_kind=kind, clip_norm_type=norm_type, clip_source=source, events=shown_events,
        passes=run.passes, error=run.error, forwards=run.forwards, unreplayed=run.unreplayed, random_draws=draws,
        reseeded=reseeded, coupled=lambda: coupled_modules(model, x, b, SampleRNG(seed), rtol),
        param_slices=slices, has_step=step is not None, outside_draws=run.outside)
    findings, info = diagnose(m)
    codes = {f.code for f in findings}
    if given is not None and run.error is None:
        if not clips and "clip_missing" not in codes:
            findings.append(Finding(
                "clip_missing", "a clip threshold was given but your loop makes no clip call",
                f"threshold {num(given)} (the clip argument); the full-batch gradient's norm "
                f"{num(float(refs.full.norm()))} is below it, so this window is not affected, but larger gradients "
                "will be clipped in the reference and not in your loop", "clip once per window, after the last "
                "backward (after scaler.unscale_), or drop the clip argument", 3, "note"))
        differ = sorted({v for _, v, _ in thresholds if v is not None and v != given})
        if differ:
            findings.insert(0, Finding(
                "clip_threshold_differs", "the clip threshold you gave is not the one your loop uses",
                f"you gave {num(given)}; your loop's clip call(s) use {', '.join(num(v) for v in differ)}: the "
                "comparison clips the full batch at the threshold you gave, so a difference below may come from "
                "the two thresholds alone", f"rerun with --clip {num(differ[0])} (or without --clip: the checker "
                "then reads the threshold from your loop)", 3, "note"))
    if misplaced and not placed and run.error is None:
        e, where = misplaced[0]
        findings.insert(0, Finding(
            "clip_misplaced", "your clip call does not clip the gradient the optimizer step applies",
            f"{e.detail.get('fn', 'clip')} ran {where}: the step applied the gradient as it was before any clip",
            "clip once per window after the last backward (after scaler.unscale_) and before optimizer.step()",
            3))
    bugs = [f for f in findings if f.severity == "bug"]
    if run.unlocated and run.replayed and bugs and run.error is None and rel(target, run.applied) > tol:
        # micro-batches that are not consecutive slices of x (strided, shuffled): their samples could not be found,
        # so they may have drawn other masks than in the full batch
        findings = [f for f in findings if f.severity != "bug"] + [Finding(
            "randomness_not_replayed", "dropout in micro-batches the checker could not place in the batch",
            f"{run.unlocated} forward pass(es) of your step got inputs that are not consecutive rows of x (e.g. "
            f"x[j::K], or a shuffle), and the forward draws random numbers: their samples may have been given other "
            f"masks than in the full batch (without that, the findings would be: {', '.join(f.code for f in bugs)})",
            "split the window into consecutive micro-batches as the checker does (x.chunk(K)), or rerun with "
            "dropout off to compare like with like", 6, "inconclusive")]
    if step is not None and run.error is None and run.forwards and not bugs:
        sizes = sorted({size for _, size in run.forwards})
        if sizes != [b]:
            findings.append(Finding(
                "micro_batches_differ", "your step's micro-batches are not the K you passed",
                f"its forward passes saw {len(run.forwards)} batch(es) of size(s) {sizes}, not K = {k} "
                f"micro-batches of {b}; this window's gradient is still the full batch's", "pass the K your loop "
                "uses (-k), so that the check (and its partial window) tests the loop you run", 6, "note"))
    twice = _bn_rerun_finding(run.bn_reruns) if run.error is None else None
    if twice is not None:
        findings.append(twice)
    unpreserved = _unpreserved_finding(run)
    if unpreserved is not None:
        findings.insert(0, unpreserved)
    report.findings = findings
    report.weights, report.expected_weights = info.get("weights"), info.get("expected_weights")
    if run.error is None:
        report.rel_error, report.cosine = rel(target, run.applied), cosine(target, run.applied)
    report.warnings = run.warnings
    report.events = [str(e) for e in run.events]
    report.counts = {"backward": len(run.passes)}
    for kind_ in COUNTED[1:]:
        report.counts[kind_] = sum(e.kind == kind_ for e in run.events)
    if run.replayed:
        report.notes.append(f"randomness: {run.replayed} random op call(s) (dropout) in the window's forward passes "
                            "were replayed per sample, so the full batch and the micro-batches use the same masks")
    if step is not None and partial and k >= 2 and run.error is None and set(report.codes) <= PARTIAL_OK:
        extra = _partial_window(model, loss_fn, x, y, k, b, step, seed, refs, clip, kind, norm_type, wtol, tol,
                                fixed_tol)
        if extra is not None:
            report.findings.append(extra)
    return report


def _measures_only(event: Event) -> bool:
    """A clip call whose threshold is infinite: it returns the norm and changes nothing."""
    value = event.detail.get("max_norm", event.detail.get("clip_value"))
    return isinstance(value, float) and math.isinf(value)


def _misplaced_clips(events: list[Event]) -> list[tuple[Event, str]]:
    """Clip calls that cannot have clipped what the optimizer applied: after the window's last optimizer step, or
    before the first backward pass (the buffer is still empty)."""
    steps = [i for i, e in enumerate(events) if e.kind in ("optimizer.step", "scaler.step")]
    out = []
    for i, e in enumerate(events):
        if e.kind != "clip":
            continue
        if steps and i > steps[-1]:
            out.append((e, "after the last optimizer.step()"))
        elif e.after == 0:
            out.append((e, "before the first backward pass, on an empty gradient"))
    return out


def _clipped_by_group(full: torch.Tensor, clips: list[Event], model: nn.Module, last: int) -> torch.Tensor | None:
    """The full-batch gradient clipped as the loop clips: each clip call on its own parameters, in order, when
    every call comes after the last backward pass and some call clips a subset (a layer, a parameter group);
    None otherwise (one call on every parameter is the plain case)."""
    sizes = [p.numel() for p in _trainable(model)]
    if not clips or any(e.after < last or "params" not in e.detail for e in clips):
        return None
    if len(clips) == 1 and _clips_all(clips[0], len(sizes)):
        return None
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + size)
    out = full.clone()
    for e in clips:
        value = e.detail.get("max_norm", e.detail.get("clip_value"))
        if value is None or not e.detail["params"]:
            return None
        index = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in e.detail["params"]])
        kind = "value" if e.detail.get("fn") == "clip_grad_value_" else "norm"
        out[index] = clip_vec(out[index], value, kind, e.detail.get("norm_type", 2.0))
    return out


def _clips_all(event: Event, count: int) -> bool:
    """Whether a clip call clipped every trainable parameter."""
    return sorted(event.detail.get("params", [])) == list(range(count))


def _partial_window(model: nn.Module, loss_fn: Callable, x: torch.Tensor, y: torch.Tensor, k: int, b: int,
                    step: Step, seed: int, refs: _Refs, clip: float | None, kind: str, norm_type: float,
                    wtol: float, tol: float, fixed_tol: bool = False) -> Finding | None:
    """Run ``step`` on the first K − 1 micro-batches with k = K − 1 and compare with their mean gradient (under
    autocast, and without a tolerance of the caller's, a difference of autocast's size, up to 10%, is no finding:
    the whole window's check reports that as inconclusive)."""
    m = k - 1
    xp, yp = x[: m * b], y[: m * b]
    run = _run_step(model, loss_fn, xp, yp, m, step, seed, plans=refs.plans)
    if run.error is not None:
        return Finding("partial_window_not_checked", "the last partial window was not checked",
                       f"your step raised {type(run.error).__name__} on a window of {m} micro-batch(es) with "
                       f"k = {m}", "if your loader can end an epoch with fewer than K micro-batches, make step "
                       "accept k < K", 6, "note")
    probe = _loss_probe(loss_fn, refs.out.narrow(0, 0, m * b), yp, m, b)
    basis = refs.basis[:m]
    ideal = mean = cast(torch.Tensor, sum(fj * basis[j] for j, fj in enumerate(probe.weights)))
    clips = [e for e in run.events if e.kind == "clip" and not _measures_only(e)]
    by_group = _clipped_by_group(ideal, clips, model, len(run.passes))
    if by_group is not None:
        ideal = by_group
    elif clip is not None:
        ideal = clip_vec(ideal, clip, kind, norm_type)
    error = rel(ideal, run.applied)
    if error <= tol or (not fixed_tol and error <= 0.1 and any(e.kind == "autocast" for e in run.events)):
        return None
    # a loop that gives batch-coupled layers the statistics of the whole window (e.g. the exact full-batch
    # BatchNorm scheme) is right when it equals the partial window's own full-batch gradient
    whole = _references(model, loss_fn, xp, yp, m, seed)
    if whole.error is None:
        target = clip_vec(whole.full, clip, kind, norm_type) if clip is not None else whole.full
        grouped = _clipped_by_group(whole.full, clips, model, len(run.passes))
        if rel(grouped if grouped is not None else target, run.applied) <= tol:
            return None
    w, residual, _ = fit_weights(basis, run.applied)
    # one clip of every parameter: compare the gradient it was given (a clip that bites hides the scale)
    one = (len(clips) == 1 and by_group is None and "max_norm" in clips[0].detail
           and clips[0].detail.get("factor", 0) > 0)
    given = run.applied / clips[0].detail["factor"] if one else run.applied
    against = mean if one else ideal
    s = float(given @ against) / float(against @ against) if float(against.norm()) > 0 else float("nan")
    thr = max(1e-6 if wtol < 1e-6 else 1e-2, tol)
    straight = abs(cosine(against, given) - 1) <= thr
    if straight and abs(s - m / k) <= thr * (m / k):
        evidence = (f"a window of {m} micro-batches gets {num(s)}× its mean gradient = {m}/{k}: your step divides by "
                    f"K = {k}, not by the {m} micro-batches present")
        if one and clips[0].detail["factor"] < 1:
            evidence += (f"; here your clip then shrinks it to its threshold, so this step differs from the right "
                         f"one by {num(error)} only (clip_grad_norm_ adds 1e-6 to the norm), but a window the clip "
                         f"leaves alone gets {m}/{k} of its gradient")
    else:
        evidence = (f"a window of {m} micro-batches gets weights {nums(w)} instead of {nums(probe.weights)} "
                    f"(relative error {num(error)})")
    return Finding("partial_window", "the last partial window is not normalized by its own size", evidence,
                   "divide a window's loss by the micro-batches (or samples, or tokens) it holds, or never make one: "
                   "keep the micro-batches per epoch a multiple of K (a DataLoader's drop_last drops only an "
                   "incomplete micro-batch); if your loader never makes one, pass partial=False (--no-partial)", 6)


def token_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the non-padding positions of (N, T, V) logits and (N, T) targets (padding: -100): the
    mean over tokens, :func:`gradaccum.windows.token_loss` with a loss function's two-argument signature."""
    return token_loss(logits, target)


class _UsageError(Exception):
    pass


def _load_target(target: str) -> Callable[[], Any]:
    if ":" not in target:
        raise _UsageError(f"give the target as module:function (or path/to/file.py:function), got {target!r}")
    module_name, func_name = target.rsplit(":", 1)
    try:
        if module_name.endswith(".py"):
            path = os.path.abspath(module_name)
            if not os.path.exists(path):
                raise _UsageError(f"no file {module_name}")
            spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
            if spec is None or spec.loader is None:  # not for a .py path; caught below as "cannot import"
                raise ImportError(f"no module spec for {path}")
            module = importlib.util.module_from_spec(spec)
            # as `python path/to/file.py` would: the file's own folder first, so that it imports its neighbours
            sys.path.insert(0, os.path.dirname(path))
            spec.loader.exec_module(module)
        else:
            sys.path.insert(0, os.getcwd())
            module = importlib.import_module(module_name)
    except _UsageError:
        raise
    except Exception as err:
        raise _UsageError(f"cannot import {module_name}: {type(err).__name__}: {err}") from err
    func = getattr(module, func_name, None)
    if not callable(func):
        raise _UsageError(f"{module_name} has no function {func_name}")
    return func


def _made(func: Callable[[], Any]) -> tuple[Any, ...]:
    try:
        made = func()
    except Exception as err:
        raise _UsageError(f"{func.__name__}() raised {type(err).__name__}: {err}") from err
    if not isinstance(made, (tuple, list)) or len(made) not in (4, 5):
        raise _UsageError(f"{func.__name__}() must return (model, loss_fn, x, y) or (model, loss_fn, x, y, step), "
                          f"got {type(made).__name__}"
                          + (f" of length {len(made)}" if isinstance(made, (tuple, list)) else ""))
    return tuple(made)


#: The demo's command: the book layer's own entry point (its data and models are the book's).
DEMO_COMMAND = "python -m gradaccum.book.check_demo"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m gradaccum.check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", nargs="?", help="module:function (or file.py:function) returning "
                        "(model, loss_fn, x, y) or (model, loss_fn, x, y, step)")
    parser.add_argument("-k", type=int, default=4, help="accumulation steps K (default 4)")
    parser.add_argument("--clip", type=float, help="the threshold your loop clips the gradient norm to")
    parser.add_argument("--tolerance", type=float, help="relative error that counts as equal (default 1e-9 for "
                        "float64 parameters, 1e-4 for float32, 8 epsilons of bf16 or fp16 parameters)")
    parser.add_argument("--seed", type=int, default=0, help="seeds make() and the replayed randomness (default 0)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--no-partial", action="store_true", help="do not check a partial last window")
    # the demo is the book layer's (the core never imports it): --demo only says where it went
    parser.add_argument("--demo", action="store_true", help=f"moved: run {DEMO_COMMAND}")
    return parser


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit status (0 no bug, 1 bug found, 2 usage error)."""
    parser = _parser()
    raw = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in raw

    def usage_json(message: str) -> int:
        """With --json, a usage error is still JSON on stdout (exit status 2); the message also goes to stderr."""
        print(json.dumps({"ok": False, "usage_error": message, "findings": []}, indent=2))
        return 2

    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        if as_json and exit_.code == 2:
            return usage_json("invalid command line (argparse's message is on stderr)")
        raise
    problem = None
    if args.k < 1:
        problem = f"-k must be >= 1, got {args.k}"
    for name in ("clip", "tolerance"):
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            problem = problem or f"--{name} must be a positive number, got {value}"
    if args.seed < 0:
        problem = problem or f"--seed must be >= 0, got {args.seed}"
    if args.demo:
        problem = (f"--demo moved to the book layer: run {DEMO_COMMAND} [-k K] [--json] "
                   "(it needs pip install 'gradaccum[book]')")
    if not args.target:
        problem = problem or f"give module:function (the demo: {DEMO_COMMAND})"
    if problem is not None:
        if args.json:
            print(f"python -m gradaccum.check: error: {problem}", file=sys.stderr)
            return usage_json(problem)
        parser.error(problem)
    try:
        torch.manual_seed(args.seed)
        model, loss_fn, x, y, *rest = _made(_load_target(args.target))
        report = check(model, loss_fn, x, y, args.k, step=rest[0] if rest else None, clip=args.clip,
                       tolerance=args.tolerance, seed=args.seed, partial=not args.no_partial)
    except (_UsageError, ValueError) as err:
        print(f"python -m gradaccum.check: error: {err}", file=sys.stderr)
        return usage_json(str(err)) if args.json else 2
    print(json.dumps(report.to_dict(), indent=2) if args.json else report)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
