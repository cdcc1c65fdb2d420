"""The step on a copy, the state restored: one accumulated window of the reader's step under the instruments (the
references it is compared with are in :mod:`.references`)."""

from __future__ import annotations

import copy
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

from .batch import Batch, batch_size, batch_tensors, output_field
from .instrument import OutsideDraws, SampleRNG, first_tensor, flat
from .recorder import CallRecorder, Event, GradTrace
from .report import Finding

#: ``step(model, loss_fn, x, y, k)``: x a tensor or a dict of tensors, y None and loss_fn None when the model
#: computes its own loss.
Step = Callable[[nn.Module, Any, Any, Any, int], Any]


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


def _batch_input(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The tensor a forward pass is located by: the first one with a dimension among its arguments (positional
    first, then keyword, nested containers searched), else the first tensor, else None."""
    found = [t for t in (first_tensor(a) for a in (*args, *kwargs.values())) if t is not None]
    return next((t for t in found if t.dim()), found[0] if found else None)


class _ForwardScope:
    """Forward hooks on every module of a model copy. The outermost forward pass the step runs learns which samples
    of the window it holds (by value, so copies and moved tensors are recognized), and the per-sample RNG is active
    inside it. That pass is the model's, or a submodule's whose input is rows of the window (the inner model a
    wrapper holds, called as ``wrapper.hf(**micro_batch)``; a submodule the model's forward runs, as
    ``model.transformer``): the count of random ops then starts where the model's own forward reaches that
    submodule (recorded in the plans, under its name, by the full batch), so its draws get the same masks as in
    the full batch. A submodule whose input is not rows of the window (hidden states) opens no scope: its draws
    are outside, as before."""

    def __init__(self, model: nn.Module, rng: SampleRNG, x: Batch):
        self.rng, self.n = rng, batch_size(x)
        self.model = model
        self.modes: list[bool] | None = None  # every module's training flag at the first forward pass
        self.rows = [t.detach().reshape(self.n, -1) for t in batch_tensors(x)]
        self.seen = 0
        self.unlocated = 0  # forward passes whose input is not a run of consecutive rows of x
        self.expect: int | None = None
        self.forwards: list[tuple[int, int]] = []
        self.transformed = 0  # forward passes inside torch.func transforms
        self.depth = 0  # forward passes running inside the open scope (0: random draws now are outside it)
        self.stack: list[tuple[str, bool]] = []  # per running forward: "open", "transformed" or "closed"; opened it
        self.root_open = False  # the open scope is the model's own forward (it records where submodules start)
        self.loss_dtypes: set[torch.dtype] = set()  # dtypes of the losses the placed forwards returned (.loss)
        self.names = {id(m): name for name, m in model.named_modules()}
        self.handles = [
            model.register_forward_pre_hook(self._pre, with_kwargs=True),
            model.register_forward_hook(self._post, always_call=True),
        ]
        for module in model.modules():
            if module is not model and not isinstance(module, torch.jit.ScriptModule):  # (which refuse hooks)
                self.handles += [
                    module.register_forward_pre_hook(self._pre, with_kwargs=True),
                    module.register_forward_hook(self._post, always_call=True),
                ]

    def _find(self, inp: torch.Tensor, n: int, guess: int) -> int | None:
        """Where the rows of ``inp`` start in a tensor of the window (``guess`` first), -1 when no tensor of the
        window has its row length and dtype (nothing to compare with), None when they are not rows of it."""
        q = inp.detach().reshape(n, -1)
        comparable = [rows for rows in self.rows if q.shape[1] == rows.shape[1] and q.dtype == rows.dtype]
        for rows in comparable:
            q = q.to(rows.device)
            if guess + n <= self.n and torch.equal(rows[guess : guess + n], q):
                return guess
            for i in (rows == q[0]).all(1).nonzero().flatten().tolist():
                if i + n <= self.n and torch.equal(rows[i : i + n], q):
                    return i
        return None if comparable else -1

    def _locate(self, inp: torch.Tensor | None, n: int) -> int:
        guess = self.expect if self.expect is not None else self.seen % self.n
        self.expect = None
        if inp is None or not n or n > self.n:
            return guess
        found = self._find(inp, n, guess)
        if found is None:
            self.unlocated += 1
        return guess if found is None or found < 0 else found

    def _push(self, state: str, opened: bool = False) -> None:
        self.stack.append((state, opened))
        self.depth += state == "open"

    def _pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.stack and self.stack[-1][0] != "closed":  # inside a forward already placed (or transformed)
            state = self.stack[-1][0]
            if state == "open" and self.root_open:
                self.rng.plans.setdefault(self.names.get(id(module), ""), self.rng.calls)
            self._push(state)
            return
        inp = _batch_input(args, kwargs)
        root = module is self.model
        name = self.names.get(id(module), "")
        # a submodule opens a scope only when the step calls it in a forward pass the model's own forward reaches
        # it in: not when backward recomputes it (the model's activation checkpointing: reported as before)
        if not root and (name not in self.rng.plans or torch._C._current_graph_task_id() != -1):
            self._push("closed")
            return
        if inp is not None and _transformed(inp):
            # a forward inside torch.func (vmap, grad: per-sample gradients): its input is a wrapper whose values
            # the checker cannot read, and one sample at a time; counted, and the check says so
            self.transformed += 1
            self._push("transformed")
            return
        n = int(inp.shape[0]) if inp is not None and inp.dim() else 0
        if root:
            offset = self._locate(inp, n)
        else:
            found = self._find(inp, n, self.seen % self.n) if inp is not None and 0 < n <= self.n else None
            if found is None or found < 0:
                self._push("closed")
                return
            offset = found
        self.seen = offset + n
        if torch.is_grad_enabled():  # a forward under no_grad (logging, a probe) never reaches a backward pass
            self.forwards.append((offset, n))
        if self.modes is None:
            self.modes = [m.training for m in self.model.modules()]
        self.rng.start_forward(offset, n)
        self.rng.calls = 0 if root else self.rng.plans[name]
        self.root_open = root
        self.rng.__enter__()
        self._push("open", True)

    def _post(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if self.stack:
            if self.stack[-1][1]:
                loss = output_field(output, "loss")
                if isinstance(loss, torch.Tensor) and loss.is_floating_point():
                    self.loss_dtypes.add(loss.dtype)
            self._pop()

    def _pop(self) -> None:
        state, opened = self.stack.pop()
        self.depth -= state == "open"
        if opened:
            self.rng.__exit__(None, None, None)

    def close(self) -> None:
        while self.stack:
            self._pop()
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
    loss_dtypes: set[torch.dtype] = field(default_factory=set)  # of the losses the step's forwards returned


def _run_step(
    model: nn.Module,
    loss_fn: Callable | None,
    x: Batch,
    y: torch.Tensor | None,
    k: int,
    step: Step,
    seed: int,
    mode: str = "replay",
    start: int | None = None,
    plans: dict | None = None,
) -> _Run:
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
            outside = OutsideDraws(lambda: scope is not None and scope.depth > 0) if mode == "replay" else nullcontext()
            if isinstance(outside, OutsideDraws):
                outside.unpreserved = recorder.recomputing_unpreserved
            with calls, rng if mode == "record" else outside:
                step(work, loss_fn, x, y, k)
        except Exception as err:  # a finding, never a crash of the checker
            error = err
        finally:
            if scope is not None:
                scope.close()
            trace.detach()
            rerun_counts = reruns.close()
    caught = list(dict.fromkeys(str(w.message).split(". ")[0] for w in raised))
    return _collect(params, trace, recorder, rng, scope, outside, error, caught, rerun_counts)


def _collect(
    params: list[nn.Parameter],
    trace: GradTrace,
    recorder: CallRecorder,
    rng: SampleRNG,
    scope: _ForwardScope | None,
    outside: object,
    error: BaseException | None,
    caught: list[str],
    rerun_counts: dict[str, tuple[int, int]],
) -> _Run:
    """What the instruments saw of one run of the step, as a :class:`_Run` (``scope`` and ``outside``: the
    forward scope and the draws outside it, where the run replayed randomness; None and a null context where it
    recorded it)."""
    applied = recorder.applied if recorder.applied is not None else flat(params)
    return _Run(
        applied,
        trace.passes,
        recorder.events,
        error,
        caught,
        scope.forwards if scope else [],
        rng.replayed,
        rng.unreplayed,
        rng.draws,
        recorder.errors,
        outside.draws if isinstance(outside, OutsideDraws) else [],
        rerun_counts,
        scope.modes if scope else None,
        scope.unlocated if scope else 0,
        rng.unpreserved_draws + (outside.unpreserved_draws if isinstance(outside, OutsideDraws) else 0),
        scope.transformed if scope else 0,
        scope.loss_dtypes if scope else set(),
    )


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
                self.handles.append(
                    layer.register_forward_pre_hook(
                        lambda m, _args, c=self.counts[name or "(the model)"]: self._count(m, c)
                    )
                )

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
        "checkpoint_rng_not_preserved",
        "activation checkpointing with preserve_rng_state=False around a forward that draws random numbers (dropout)",
        f"{calls} checkpoint call(s) with preserve_rng_state=False; backward "
        f"recomputed {run.unpreserved_draws} random op call(s) inside them: torch does not restore the random state "
        "for the recomputation, so it draws new masks and the gradient belongs to other masks than the forward's "
        "(the checker replays masks per sample, so the comparison cannot show it)",
        "drop "
        "preserve_rng_state=False (the default saves and restores the random state), or switch the randomness off "
        "in the checkpointed part",
        6,
    )


def _recorder_error_finding(run: _Run) -> Finding | None:
    """An exception inside the call recorder (never the reader's): the record of calls may be incomplete, so the
    verdict is inconclusive."""
    if not run.recorder_errors:
        return None
    more = f" (and {len(run.recorder_errors) - 1} more)" if len(run.recorder_errors) > 1 else ""
    return Finding(
        "checker_error",
        "the checker's call recorder raised while your step ran: its record of the "
        "calls your step made may be incomplete",
        f"{run.recorder_errors[0]}{more}",
        "report this as a bug in gradaccum (with this report and the step you checked)",
        None,
        "inconclusive",
    )


def _bn_rerun_finding(reruns: dict[str, tuple[int, int]]) -> Finding | None:
    """A BatchNorm layer whose forward ran again during backward (activation checkpointing): every rerun in
    training mode moves the running averages once more, with the same statistics, so r = (forward + rerun
    calls) / forward calls updates act as one of momentum :math:`1-(1-m)^r` (chapter 8)."""
    if not reruns:
        return None
    shown = "; ".join(
        f"{name!r}: {calls} call(s) in forward passes, {again} more during backward"
        for name, (calls, again) in list(reruns.items())[:3]
    )
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
        "bn_stats_updated_twice",
        "BatchNorm running statistics are updated again when backward recomputes the "
        "forward (activation checkpointing)",
        f"{shown}: every recomputation in training mode moves the running averages once more, so the effective "
        f"momentum per micro-batch is {effect}",
        "recompute with the statistics frozen (gradaccum.coupled.checkpoint_keeping_bn_stats around every "
        f"checkpointed call, nested ones included), or {fix}; the gradient "
        "itself is unaffected",
        8,
    )


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
