"""The step on a copy, the state restored: one accumulated window of the reader's step under the instruments, the
references it is compared with (the full batch and each micro-batch alone), and the loss probe."""

from __future__ import annotations

import copy
import math
import random
import sys
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from gradaccum.accumulate import split_batch

from .instrument import OutsideDraws, SampleRNG, first_tensor, flat
from .recorder import CallRecorder, Event, GradTrace
from .report import Finding

Step = Callable[[nn.Module, Callable, torch.Tensor, torch.Tensor, int], Any]


#: How much longer than the full batch's gradient the micro-batch gradients may be, on average, before the default
#: tolerance is widened in proportion (their rounding, not the sum's, sets the error of a cancelling sum).
CANCELLATION = 10.0


#: Beyond this, the full batch's gradient is rounding noise of its micro-batches' (1000× shorter): inconclusive.
CANCELLATION_LIMIT = 1000.0


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


def _recorder_error_finding(run: _Run) -> Finding | None:
    """An exception inside the call recorder (never the reader's): the record of calls may be incomplete, so the
    verdict is inconclusive."""
    if not run.recorder_errors:
        return None
    more = f" (and {len(run.recorder_errors) - 1} more)" if len(run.recorder_errors) > 1 else ""
    return Finding("checker_error", "the checker's call recorder raised while your step ran: its record of the "
                   "calls your step made may be incomplete", f"{run.recorder_errors[0]}{more}",
                   "report this as a bug in gradaccum (with this report and the step you checked)", None,
                   "inconclusive")


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

