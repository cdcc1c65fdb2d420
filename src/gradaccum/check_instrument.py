r"""What :mod:`gradaccum.check` measures, and how: replayed randomness, recorded calls, traced gradient buffers.

Three instruments, each independent of how the user's code imports what it calls:

* :class:`SampleRNG` — a ``TorchDispatchMode`` active inside ``model.forward``. Every random operator (dropout's
  ``bernoulli_``, ``rand``, ``randn``, ``native_dropout``, ``multinomial``… — every ATen op tagged
  ``nondeterministic_seeded``) is run once per *sample*, from a seed that depends only on the checker's seed,
  the op's position in the forward pass and the sample's index in the window. Sample :math:`i` therefore gets
  the same dropout mask whether it sits in the full batch of :math:`N` or in a micro-batch of :math:`b`: the
  full batch and the K micro-batches are compared under identical randomness.
* :class:`CallRecorder` — a ``sys.setprofile`` hook active during the user's step. It sees calls by the code
  object that runs, not by the name they were imported under (``from torch.nn.utils import clip_grad_norm_``
  binds before any monkeypatch could), and records optimizer, scheduler (not the step every scheduler's
  constructor makes), ``GradScaler``, ``zero_grad``, clipping and seeding calls, each with the number of backward
  passes completed before it.
* :class:`GradTrace` — hooks on the parameters: for every backward pass that accumulates into ``.grad``, the
  buffer before and after it, and the loss scale in force. Effects such as a buffer emptied between two
  micro-batches are seen however they were caused (``zero_grad()``, ``p.grad = None``, ``grad.zero_()``).
"""

from __future__ import annotations

import copy
import functools
import inspect
import math
import numbers
import os
import random
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler
from torch.utils._python_dispatch import TorchDispatchMode

_SEEDED = torch.Tag.nondeterministic_seeded
#: Random ATen ops replayed per sample (elementwise draws); other random ops run as they are and are reported.
REPLAYABLE = {"bernoulli", "bernoulli_", "uniform_", "normal_", "normal", "rand", "rand_like", "randn", "randn_like",
              "randint", "randint_like", "multinomial", "native_dropout", "exponential_", "geometric_", "cauchy_",
              "log_normal_", "random_", "poisson", "binomial"}
_MASK = (1 << 63) - 1


def sample_seed(seed: int, call: int, sample: int) -> int:
    """The seed of the ``call``-th random op of a forward pass, for sample ``sample`` of the window."""
    return ((seed * 1_000_003 + call) * 1_000_033 + sample * 7_919 + 17) & _MASK


def flat(params: list[nn.Parameter]) -> torch.Tensor:
    """The parameters' gradients as one float64 vector on the CPU (zeros where ``.grad`` is None)."""
    return torch.cat([(p.grad.detach() if p.grad is not None else torch.zeros_like(p)).reshape(-1).double().cpu()
                      for p in params])


def first_tensor(obj: Any) -> torch.Tensor | None:
    """The first tensor in a (possibly nested) tuple, list or dict, or None."""
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, (tuple, list)):
        for item in obj:
            found = first_tensor(item)
            if found is not None:
                return found
    if isinstance(obj, dict):
        return first_tensor(list(obj.values()))
    return None


# ----------------------------------------------------------------------------------- randomness per sample


class SampleRNG(TorchDispatchMode):
    """Replays randomness per sample inside forward passes (``replay=True``), or records the random values a
    step draws (``replay=False``: used to see whether a step's draws depend on the state it starts from)."""

    def __init__(self, seed: int, replay: bool = True, plans: dict[int, tuple[str, int, int]] | None = None):
        super().__init__()
        self.seed = seed
        self.replay = replay
        self.plans = {} if plans is None else plans  # call index → (kind, batch dim, rows per sample)
        self.window: tuple[int, int] | None = None  # (offset of the forward's first sample, its batch size)
        self.calls = 0
        self.replayed = 0
        self.unreplayed: list[str] = []
        self.draws: list[tuple[tuple[int, ...], torch.Tensor]] = []
        # random op calls made while backward recomputed a function checkpointed with preserve_rng_state=False
        self.unpreserved: Callable[[], bool] = lambda: False
        self.unpreserved_draws = 0
        self.busy = 0
        self._generators: dict[str, torch.Generator] = {}

    def start_forward(self, offset: int, n: int) -> None:
        self.window, self.calls = (offset, n), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if _SEEDED not in func.tags or _draws_nothing(func, args, kwargs):
            return func(*args, **kwargs)
        if self.replay and self.unpreserved():
            self.unpreserved_draws += 1
        if func._overloadpacket.__name__ not in REPLAYABLE:  # e.g. a fused attention kernel with dropout
            if self.replay:
                self.calls += 1
                self.unreplayed.append(f"{func} on shape {self._shape(func, args, kwargs)}")
            return func(*args, **kwargs)
        if not self.replay:
            out = func(*args, **kwargs)
            if kwargs.get("generator") is None:  # a generator of the model's own does not follow the global state
                self._record(func, args, out)
            return out
        call = self.calls
        self.calls += 1
        plan = self._plan(func, args, kwargs, call)
        if plan is None:
            self.unreplayed.append(f"{func} on shape {self._shape(func, args, kwargs)}")
            return func(*args, **kwargs)
        self.replayed += 1
        self.busy += 1  # the recorder ignores the seeding done here
        try:
            return self._per_sample(func, args, kwargs, call, *plan)
        finally:
            self.busy -= 1

    # how to cut the op into samples
    @staticmethod
    def _names(func) -> list[str]:  # noqa: ANN001
        return [a.name for a in func._schema.arguments]

    def _shape(self, func, args, kwargs) -> tuple[int, ...] | None:  # noqa: ANN001
        names = self._names(func)
        if args and isinstance(args[0], torch.Tensor):
            return tuple(args[0].shape)
        if "size" in names:
            i = names.index("size")
            size = args[i] if i < len(args) else kwargs.get("size")
            return tuple(int(s) for s in size) if size is not None else None
        return None

    def _plan(self, func, args, kwargs, call: int) -> tuple[str, int, int] | None:  # noqa: ANN001
        """How the op's random tensor splits into samples: (kind, batch dimension, rows per sample). Decided on
        the first pass that reaches this op (the checker runs the full batch first) and reused by later passes, so
        that a micro-batch whose size happens to equal another dimension is cut the same way."""
        if self.window is None or func._overloadpacket.__name__ not in REPLAYABLE:
            return None
        shape = self._shape(func, args, kwargs)
        if not shape:
            return None
        n = self.window[1]
        kind = "tensor" if args and isinstance(args[0], torch.Tensor) else "size"
        plan = self.plans.get(call)
        if plan is None:
            dims = [d for d, s in enumerate(shape) if s == n]
            if dims:
                plan = (kind, dims[0], 1)
            elif shape[0] % n == 0:  # (N·heads, ...) as attention dropout lays it out
                plan = (kind, 0, shape[0] // n)
            else:
                return None
            self.plans[call] = plan
        if plan[0] != kind or plan[1] >= len(shape) or shape[plan[1]] != n * plan[2]:
            return None
        return plan

    def _generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        if key not in self._generators:
            self._generators[key] = torch.Generator(device=device)
        return self._generators[key]

    def _per_sample(self, func, args, kwargs, call: int, kind: str, dim: int, block: int):  # noqa: ANN001, ANN202
        names = self._names(func)
        assert self.window is not None  # only reached for an op that _plan planned, which needs a window
        offset, _ = self.window
        args = list(args)
        if kind == "tensor":
            base = args[0]
            device, count = base.device, base.shape[dim] // block
        else:
            i_size = names.index("size")
            size = list(args[i_size] if i_size < len(args) else kwargs["size"])
            device = torch.device(kwargs.get("device") or "cpu")
            count = size[dim] // block
        mutating = func._schema.arguments[0].alias_info is not None and func._schema.arguments[0].alias_info.is_write
        use_generator = "generator" in names
        outs = []
        for i in range(count):
            seed = sample_seed(self.seed, call, offset + i)
            a, kw = list(args), dict(kwargs)
            if kind == "tensor":
                a[0] = args[0].narrow(dim, i * block, block)
            else:
                one = list(size)
                one[dim] = block
                if i_size < len(a):
                    a[i_size] = one
                else:
                    kw["size"] = one
            if use_generator:
                gen = self._generator(device)
                gen.manual_seed(seed)
                i_gen = names.index("generator")
                if i_gen < len(a):
                    a[i_gen] = gen
                else:
                    kw["generator"] = gen
                outs.append(func(*a, **kw))
            else:
                devices = [device.index or 0] if device.type == "cuda" else []
                with torch.random.fork_rng(devices=devices):
                    if device.type == "cuda":
                        with torch.cuda.device(device):
                            torch.cuda.manual_seed(seed)
                    else:
                        torch.default_generator.manual_seed(seed)
                    outs.append(func(*a, **kw))
        if mutating:
            return args[0]
        if isinstance(outs[0], (tuple, list)):
            return tuple(torch.cat([o[j] for o in outs], dim) for j in range(len(outs[0])))
        return torch.cat(outs, dim)

    def _record(self, func, args, out) -> None:  # noqa: ANN001
        t = first_tensor(out)
        if t is None:
            return
        values = t.detach().reshape(-1)[:4096].double().cpu().clone()
        self.draws.append((tuple(t.shape), values))


def _as_float(value: object) -> float | None:
    """A clip argument as torch reads it: a Python or NumPy number, a one-element tensor, or the string 'inf'
    (``norm_type``); None for anything else (an argument not given)."""
    if isinstance(value, str) and value.strip().lower() in ("inf", "+inf", "infinity"):
        return math.inf
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value)
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return None


class OutsideDraws(TorchDispatchMode):
    """Records random ops a step runs outside the model's forward (``inside()`` false), e.g. noise added to the
    inputs in the training loop: the checker cannot replay those per sample, so they make its verdict inconclusive."""

    def __init__(self, inside: Callable[[], bool]):
        super().__init__()
        self.inside = inside
        self.draws: list[str] = []
        self.unpreserved: Callable[[], bool] = lambda: False  # as in SampleRNG, for the draws outside the forward
        self.unpreserved_draws = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if _SEEDED in func.tags and not self.inside() and not _draws_nothing(func, args, kwargs) \
                and not _loader_seed():
            shape = tuple(args[0].shape) if args and isinstance(args[0], torch.Tensor) else None
            self.draws.append(f"{func} on shape {shape}")
            if self.unpreserved():
                self.unpreserved_draws += 1
        return func(*args, **kwargs)


def _loader_seed() -> bool:
    """Whether the draw now running is a DataLoader iterator's base seed, drawn as the iterator is made (its
    ``__init__`` or ``_share_dist_seed``): it seeds worker processes, and the batches a step sees do not depend on
    it in the main process (a shuffling sampler draws its own seed elsewhere, in sampler.py)."""
    frame: Any = sys._getframe(2)
    for _ in range(6):
        if frame is None:
            return False
        if frame.f_code.co_filename.endswith(_LOADER_FILE) and frame.f_code.co_name in ("__init__",
                                                                                       "_share_dist_seed"):
            return True
        frame = frame.f_back
    return False


_LOADER_FILE = os.path.join("torch", "utils", "data", "dataloader.py")


def _draws_nothing(func, args, kwargs) -> bool:  # noqa: ANN001
    """Seeded ops that draw nothing for these arguments: dropout with p = 0, or not in training."""
    for i, arg in enumerate(func._schema.arguments):
        default = arg.default_value if arg.has_default_value() else None
        value = args[i] if i < len(args) else kwargs.get(arg.name, default)
        if arg.name in ("dropout_p", "p") and func._overloadpacket.__name__ not in ("bernoulli_", "bernoulli") \
                and isinstance(value, (int, float)) and value == 0:
            return True
        if arg.name == "train" and value is False:
            return True
    return False


def identical_draws(a: list[tuple[tuple[int, ...], torch.Tensor]],
                    b: list[tuple[tuple[int, ...], torch.Tensor]]) -> tuple[int, int]:
    """(draws equal in both runs, draws compared): draws that are constant (all entries equal) are skipped, since
    they carry no randomness (``bernoulli(1)``)."""
    same = compared = 0
    for (sa, va), (sb, vb) in zip(a, b):
        if sa != sb or va.numel() < 2 or bool((va == va[0]).all()):
            continue
        compared += 1
        same += bool(torch.equal(va, vb))
    return same, compared


# ----------------------------------------------------------------------------------------- gradient trace


@dataclass
class Pass:
    """One backward pass that accumulated into ``.grad``: the buffer before and after it, the loss scale then."""

    before: torch.Tensor
    after: torch.Tensor
    scale: float | None


class GradTrace:
    """Hooks on the parameters that record every accumulating backward pass (see :class:`Pass`)."""

    def __init__(self, params: list[nn.Parameter], scale_now: Callable[[], float | None] = lambda: None):
        self.params = params
        self.passes: list[Pass] = []
        self.scale_now = scale_now
        self._open = False
        self._accumulated = False
        self._before: torch.Tensor | None = None
        self._handles: list[Any] = []

    def attach(self) -> None:
        for p in self.params:
            self._handles.append(p.register_hook(self._pre))
            self._handles.append(p.register_post_accumulate_grad_hook(self._post))

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _pre(self, grad: torch.Tensor) -> None:
        if not self._open:
            self._open = True
            self._accumulated = False
            self._before = flat(self.params)
            torch.autograd.Variable._execution_engine.queue_callback(self._end)
        return None

    def _post(self, param: torch.Tensor) -> None:
        self._accumulated = True

    def _end(self) -> None:
        if self._accumulated and self._before is not None:
            self.passes.append(Pass(self._before, flat(self.params), self.scale_now()))
        self._open = False
        self._before = None


# ------------------------------------------------------------------------------------------ call recorder


@dataclass
class Event:
    """One recorded call. ``after`` = backward passes completed before it (0 = before the first)."""

    kind: str
    after: int
    detail: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        extra = ", ".join(f"{k}={v}" for k, v in self.detail.items() if k in ("fn", "max_norm", "clip_value", "cls"))
        return f"{self.kind}({extra}) after backward {self.after}"


_CLIP_NAMES = {"clip_grad_norm_", "clip_grad_value_", "clip_grads_with_norm_", "_clip_grads_with_norm_"}
_SEED_NAMES = {"manual_seed", "seed", "set_rng_state", "manual_seed_all"}
_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def _wraps_optimizer(obj: Any) -> bool:
    """True for an optimizer wrapper (Accelerate's ``AcceleratedOptimizer``): an ``Optimizer`` that holds another
    in ``.optimizer`` and calls it (or skips the call on micro-batches that do not end a window)."""
    inner = getattr(obj, "optimizer", None)
    return isinstance(inner, torch.optim.Optimizer) and inner is not obj


def _values(params: list[nn.Parameter]) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params]).clone() if params else torch.zeros(0)


def _closure_argument(frame: Any) -> Any:
    """The closure an optimizer's ``step`` was called with: the ``closure`` argument, else its first positional
    argument after ``self``, else the first of ``*args``; None when there is none."""
    loc = frame.f_locals
    if callable(loc.get("closure")):
        return loc["closure"]
    code = frame.f_code
    names = code.co_varnames
    if code.co_argcount > 1 and callable(loc.get(names[1])):
        return loc[names[1]]
    if code.co_flags & inspect.CO_VARARGS:
        extra = loc.get(names[code.co_argcount + code.co_kwonlyargcount], ())
        if extra and callable(extra[0]):
            return extra[0]
    return None


def _code_of(fn: Any) -> Any:
    """The code object a call of ``fn`` runs first (through partials, bound methods and callable objects)."""
    for _ in range(8):
        if isinstance(fn, functools.partial):
            fn = fn.func
        elif inspect.ismethod(fn):
            fn = fn.__func__
        elif fn is not None and not inspect.isfunction(fn) and callable(fn):
            fn = type(fn).__call__
        else:
            break
    return getattr(fn, "__code__", None)


def _from_the_toolkit(frame: Any) -> bool:
    """Whether a seeding call, made from ``frame`` (the code that called the seeding function), is not a seed the
    reader's loop sets: a call from gradaccum's own tools (the exact full-batch BatchNorm scheme restores the RNG
    state to replay dropout masks) or from torch itself (``fork_rng`` and activation checkpointing save and
    restore the RNG state). Only the immediate caller counts: the reader's step is itself called by the checker.

    The tools are the code under gradaccum's directory, except a package of it that declares its code a user's
    (``USER_CODE = True`` in its ``__init__``: a layer built on the toolkit, whose loops are checked as a reader's
    are)."""
    # torch's own pass-through frames: a seeding function calling another (manual_seed → cuda.manual_seed_all)
    # and the wrappers that keep the compiler out of it
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_TORCH) and (
            frame.f_code.co_name in _SEED_NAMES or frame.f_code.co_filename.endswith(("eval_frame.py", "_compile.py"))):
        frame = frame.f_back
    if frame is None:
        return True
    filename = os.path.abspath(frame.f_code.co_filename)
    if filename.startswith(_TORCH):
        return True
    if not filename.startswith(_PACKAGE):
        return False
    package = frame.f_globals.get("__package__") or ""
    while package:
        if getattr(sys.modules.get(package), "USER_CODE", False) is True:
            return False
        package = package.rpartition(".")[0]
    return True
def _changes_nothing(frame: Any, name: str) -> bool:
    """A seeding call that leaves every shared generator as it was: a new ``random.Random`` seeding itself as it is
    constructed (``tempfile`` makes one), or ``torch.set_rng_state`` given the state the generator is in (a
    framework restoring what it saved around code that drew nothing, as Lightning's ``isolate_rng`` does)."""
    if name == "seed":
        return frame.f_back is not None and frame.f_back.f_code is random.Random.__init__.__code__
    state = frame.f_locals.get("new_state")
    if name != "set_rng_state" or not frame.f_code.co_filename.endswith(os.path.join("torch", "random.py")):
        return False
    return isinstance(state, torch.Tensor) and torch.equal(state, torch.get_rng_state())


_NAMES = ({"step", "__init__", "zero_grad", "scale", "unscale_", "update", "__enter__", "checkpoint"} | _CLIP_NAMES
          | _SEED_NAMES)
_CHECKPOINT_FILE = os.path.join("torch", "utils", "checkpoint.py")


class CallRecorder:
    """Records what a training step calls, by the code objects that run (``sys.setprofile``)."""

    def __init__(self, params: list[nn.Parameter], trace: GradTrace):
        self.params = params
        self._start = _values(params)  # the parameters as the step begins: an update written by hand changes them
        self.param_ids = {id(p) for p in params}
        self.trace = trace
        self.events: list[Event] = []
        # the gradient each parameter had when an optimizer holding it stepped (see ``applied``)
        self._reads: dict[int, torch.Tensor] = {}
        self._last: torch.Tensor | None = None
        self._offsets = [0]
        for p in params:
            self._offsets.append(self._offsets[-1] + p.numel())
        self.scaler: Any = None
        self.grads_scaled = False
        self._open: dict[int, tuple[str, Any]] = {}
        self._depth: dict[str, int] = {}
        self._passes_at_scale = -1
        self.errors: list[str] = []
        self.mute: Callable[[], bool] = lambda: False  # True while the checker's own code runs
        self._closure_code: Any = None  # the code of the closure passed to the optimizer step now running
        self._closure_event: Event | None = None
        self._stepping: Any = None  # the optimizer whose step() is running
        # functions checkpointed with preserve_rng_state=False: code object → owner (the module) or None
        self._unpreserved: dict[Any, set[int | None]] = {}

    # scale in force (for GradTrace)
    def scale_now(self) -> float | None:
        scaler = self.scaler
        if scaler is None or getattr(scaler, "_scale", None) is None:
            return None
        # a backward after scaler.scale(): the buffer now holds scaled gradients
        self.grads_scaled = True
        return float(scaler._scale)

    @property
    def applied(self) -> torch.Tensor | None:
        """The gradient the optimizer steps applied: each parameter's ``.grad`` when the last optimizer holding it
        stepped (several optimizers may each step and empty their own parameters in turn), and for a parameter no
        stepping optimizer holds, ``.grad`` at the last step. None before any step."""
        if self._last is None:
            return None
        return torch.cat([self._reads.get(i, self._last[a:b])
                          for i, (a, b) in enumerate(zip(self._offsets, self._offsets[1:]))])

    def _read(self, opt: Any = None, grads: torch.Tensor | None = None) -> None:
        """Read the gradient an optimizer step applies: ``grads`` (default: ``.grad`` now), for the parameters
        ``opt`` holds (all of them when ``opt`` is None)."""
        now = flat(self.params) if grads is None else grads
        self._last = now
        held = ({id(p) for g in opt.param_groups for p in g["params"]} if isinstance(opt, torch.optim.Optimizer)
                else None)
        for i, p in enumerate(self.params):
            if held is None or id(p) in held:
                self._reads[i] = now[self._offsets[i]:self._offsets[i + 1]]

    @property
    def backwards(self) -> int:
        return len(self.trace.passes)

    def _push(self, frame: Any, category: str, data: Any = None) -> bool:
        outer = self._depth.get(category, 0) == 0
        self._depth[category] = self._depth.get(category, 0) + 1
        self._open[id(frame)] = (category, data)
        return outer

    def _event(self, kind: str, **detail: Any) -> Event:
        event = Event(kind, self.backwards, detail)
        self.events.append(event)
        return event

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        try:
            if self.mute():
                return
            if event == "call":
                name = frame.f_code.co_name
                if self._closure_code is not None and frame.f_code is self._closure_code:
                    self._push(frame, "closure")
                elif name in _NAMES:
                    self._call(frame, name)
                owners = self._unpreserved.get(frame.f_code)
                if owners is not None and id(frame) not in self._open and (
                        None in owners or id(self._self(frame)) in owners):
                    self._push(frame, "unpreserved")  # one category per frame: its return pops it
            elif event == "return":
                if self._open and id(frame) in self._open:
                    self._return(frame)
            elif event == "c_call":
                name = getattr(arg, "__name__", None)
                if name in _SEED_NAMES and not self._depth.get("seed") and not _from_the_toolkit(frame):
                    owner = getattr(arg, "__self__", None)
                    if isinstance(owner, torch.Generator) or type(owner).__name__ == "RandomState":
                        self._event("seed", fn=f"{type(owner).__name__}.{name}")
        except Exception as err:  # the recorder must never break the user's step
            self.errors.append(repr(err))

    def _self(self, frame: Any) -> Any:
        """The object a method runs on: its first argument, when it is named ``self`` or the function is defined
        in a class (``def step(opt, closure=None)`` in an optimizer of your own)."""
        code = frame.f_code
        if not code.co_argcount:
            return None
        owner = getattr(code, "co_qualname", "").rpartition(".")[0]
        if code.co_varnames[0] == "self" or (owner and not owner.endswith("<locals>")):
            return frame.f_locals.get(code.co_varnames[0])
        return None

    def _call(self, frame: Any, name: str) -> None:
        filename = frame.f_code.co_filename
        if name in _CLIP_NAMES:
            if filename.endswith("clip_grad.py"):
                loc = frame.f_locals
                outer = self._push(frame, "clip", None)
                if outer:
                    detail = {"fn": name, "scaled": self.grads_scaled, "before": flat(self.params)}
                    for key in ("max_norm", "clip_value", "norm_type"):
                        value = _as_float(loc.get(key))
                        if value is not None:
                            detail[key] = value
                    self._open[id(frame)] = ("clip", self._event("clip", **detail))
            return
        if name == "checkpoint":
            if filename.endswith(_CHECKPOINT_FILE):
                kwargs = frame.f_locals.get("kwargs") or {}
                if not kwargs.get("preserve_rng_state", True):  # torch then recomputes under new random draws
                    self._event("checkpoint", preserve_rng_state=False)
                    fn = frame.f_locals.get("function")
                    module = isinstance(fn, nn.Module)
                    code = _code_of(type(fn).forward if module else fn)
                    if code is not None:
                        self._unpreserved.setdefault(code, set()).add(id(fn) if module else None)
            return
        if name in _SEED_NAMES:
            obj = self._self(frame)
            is_rng = (filename.endswith(("torch/random.py", "cuda/random.py", "torch/cuda/random.py"))
                      or (name == "seed" and obj is not None and type(obj).__module__ == "random"))
            if is_rng and not _from_the_toolkit(frame.f_back) and not _changes_nothing(frame, name):
                if self._push(frame, "seed"):
                    self._event("seed", fn=name)
            return
        obj = self._self(frame)
        if obj is None:
            return

        if name == "__init__":
            if isinstance(obj, LRScheduler):
                self._push(frame, "sched_init")
            return
        if name == "__enter__":
            if isinstance(obj, torch.amp.autocast) and getattr(obj, "_enabled", True):
                self._event("autocast", dtype=str(getattr(obj, "fast_dtype", "")).replace("torch.", ""))
            return
        if isinstance(obj, torch.amp.GradScaler) and name in ("scale", "unscale_", "step", "update"):
            self.scaler = obj
            if name == "unscale_":
                self.grads_scaled = False
            if self._push(frame, "scaler"):
                scale = getattr(obj, "_scale", None)
                optimizer = frame.f_locals.get("optimizer")
                self._event(f"scaler.{name}", scale=float(scale) if scale is not None else None,
                            opt=id(optimizer) if optimizer is not None else None)
            return
        if name == "step" and isinstance(obj, LRScheduler):
            outer = self._push(frame, "sched")
            if outer and not self._depth.get("sched_init"):
                self._event("scheduler.step", cls=type(obj).__name__, sched=id(obj))
            return
        if name == "step" and isinstance(obj, torch.optim.Optimizer):
            if _wraps_optimizer(obj):
                # a framework's wrapper (Accelerate's skips step() until the window is complete): its optimizer's
                # own step is what counts — unless the wrapper changes the parameters without calling one
                if not self._depth.get("opt") and self._push(frame, "wrap"):
                    count = sum(e.kind == "optimizer.step" for e in self.events)
                    self._open[id(frame)] = ("wrap", (obj, flat(self.params), _values(self.params), count))
                return
            if self._push(frame, "opt"):
                owns = any(id(p) in self.param_ids for g in obj.param_groups for p in g["params"])
                self._read(obj)
                self._stepping = obj
                event = self._event("optimizer.step", cls=type(obj).__name__,
                                    via_scaler=bool(self._depth.get("scaler")), owns_params=owns, opt=id(obj))
                # A closure runs inside step() (Lightning's last forward and backward): the gradient the step
                # applies is the one when the closure returns (after any clip it makes), and the backward passes
                # before the step are counted then. Without a closure we can name, backward passes that ran
                # inside step() mean the same, and the gradient is read when step() returns.
                self._closure_code = _code_of(_closure_argument(frame))
                self._closure_event = event
                self._open[id(frame)] = ("opt", (event, self.backwards))
            return
        if name == "zero_grad" and isinstance(obj, torch.optim.Optimizer) and _wraps_optimizer(obj):
            return
        if name == "zero_grad" and isinstance(obj, (torch.optim.Optimizer, nn.Module)):
            if self._push(frame, "zero_grad"):
                if not any(e.kind == "optimizer.step" for e in self.events) and self.backwards and not torch.equal(
                        self._start, _values(self.params)):
                    # no optimizer has stepped, yet the parameters moved: an update written by hand (p -= lr * p.grad)
                    # applied the gradient the buffer holds now
                    self._read(None)
                    self._event("optimizer.step", cls="(an update written by hand)", via_scaler=False,
                                owns_params=True)
                self._event("zero_grad", cls=type(obj).__name__)

    def recomputing_unpreserved(self) -> bool:
        """Whether autograd is recomputing, in a backward pass, a function checkpointed with
        ``preserve_rng_state=False`` (its random draws then differ from the forward's)."""
        return self._depth.get("unpreserved", 0) > 0 and torch._C._current_graph_task_id() != -1

    def _return(self, frame: Any) -> None:
        category, data = self._open.pop(id(frame))
        self._depth[category] -= 1
        if category == "closure":
            if self._closure_event is not None:
                self._read(self._stepping)
                self._closure_event.after = self.backwards
                # the step updates the parameters now: what the closure did (its backward, Lightning's clip)
                # comes before it
                moved = self._closure_event  # by identity: events are dataclasses, equal when their fields are
                self.events[:] = [e for e in self.events if e is not moved] + [moved]
            return
        if category == "opt":
            event, entry = data
            if self._closure_code is None and self.backwards > entry:
                self._read(self._stepping)
                event.after = self.backwards
            self._closure_code, self._closure_event = None, None
            return
        if category == "wrap":
            wrapper, grads, values, count = data
            stepped = sum(e.kind == "optimizer.step" for e in self.events) > count
            if not stepped and not torch.equal(values, _values(self.params)):
                self._read(None, grads)
                self._event("optimizer.step", cls=type(wrapper).__name__, via_scaler=False, owns_params=True)
            return
        if category == "clip" and isinstance(data, Event):
            # which parameters it clipped (clip_grad_norm_ has made its argument a list by now): a loop may clip a
            # subset, or each parameter group on its own
            clipped = frame.f_locals.get("parameters")
            if isinstance(clipped, torch.Tensor):
                clipped = [clipped]
            if isinstance(clipped, (list, tuple)):
                ids = {id(p) for p in clipped}
                data.detail["params"] = [i for i, p in enumerate(self.params) if id(p) in ids]
            elif isinstance(frame.f_locals.get("grads"), list):  # clip_grad_value_ consumed a generator
                ids = {id(g) for g in frame.f_locals["grads"]}
                data.detail["params"] = [i for i, p in enumerate(self.params) if id(p.grad) in ids]
            before = data.detail.pop("before")
            after = flat(self.params)
            nb = float(before.norm())
            data.detail["norm_before"] = nb
            data.detail["factor"] = float(after.norm()) / nb if nb > 0 else 1.0

    @contextmanager
    def active(self) -> Iterator[None]:
        previous = sys.getprofile()
        sys.setprofile(self._profile)
        try:
            yield
        finally:
            sys.setprofile(previous)


# -------------------------------------------------------------------------------- which layers couple samples


def _slice(t: torch.Tensor, n: int, b: int) -> torch.Tensor | None:
    """The first b samples of ``t`` (batch dimension: the first of size n)."""
    for d, s in enumerate(t.shape):
        if s == n:
            return t.narrow(d, 0, b)
    return None


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float) -> bool:
    if a.shape != b.shape:
        return False
    if not (a.is_floating_point() or a.is_complex()):
        return bool(torch.equal(a, b))
    scale = float(b.detach().abs().max()) if b.numel() else 0.0
    return float((a.detach() - b.detach()).abs().max()) <= rtol * max(scale, 1e-30) if a.numel() else True


def coupled_modules(model: nn.Module, x: torch.Tensor, b: int, rng: SampleRNG,
                    rtol: float) -> list[tuple[str, str, float]]:
    """Modules whose output for a sample depends on the other samples of its batch, found by measurement.

    Every module is called twice on the inputs it received in a full-batch forward pass: on all N samples, and
    on the first b of them; when the first b rows of the two outputs differ (randomness replayed per sample), the
    module couples samples. Only the innermost such modules are returned, as (name, class, max difference).
    """

    work = copy.deepcopy(model)
    n = x.shape[0]
    captured: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {}
    handles = []
    names = {m: name for name, m in work.named_modules()}

    def keep(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        name = names.get(module)
        if name is not None and name not in captured:
            captured[name] = (tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args),
                              {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})

    for module in work.modules():
        handles.append(module.register_forward_pre_hook(keep, with_kwargs=True))
    try:
        with torch.no_grad(), rng:
            rng.start_forward(0, n)
            work(x)
    finally:
        for h in handles:
            h.remove()
    found: dict[str, tuple[str, float]] = {}
    with torch.no_grad():
        for name, module in work.named_modules():
            if name not in captured:
                continue
            args, kwargs = captured[name]
            small_args = tuple(_slice(a, n, b) if isinstance(a, torch.Tensor) and n in a.shape else a for a in args)
            small_kwargs = {k: _slice(v, n, b) if isinstance(v, torch.Tensor) and n in v.shape else v
                            for k, v in kwargs.items()}
            if any(s is None for s in small_args):
                continue
            rng.plans = {}
            before = len(rng.unreplayed)
            try:
                with rng:
                    rng.start_forward(0, n)
                    full = first_tensor(module(*args, **kwargs))
                    rng.start_forward(0, b)
                    small = first_tensor(module(*small_args, **small_kwargs))
            except Exception:
                continue
            if len(rng.unreplayed) > before:
                continue  # randomness without a batch dimension: a difference would say nothing
            if full is None or small is None:
                continue
            head = _slice(full, n, b)
            if head is None or head.shape != small.shape:
                continue
            if not _close(small, head, rtol):
                found[name] = (type(module).__name__, float((small.double() - head.double()).abs().max()))
    inner = [name for name in found if not any(o != name and (name == "" or o.startswith(name + ".")) for o in found)]
    return [(name or "(the model itself)", found[name][0], found[name][1]) for name in inner]
