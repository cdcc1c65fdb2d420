"""The call recorder (optimizer, scheduler, GradScaler, zero_grad, clipping and seeding calls, seen by the code
that runs) and the ``.grad`` trace (the buffer before and after every backward pass); see :mod:`.instrument`."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler
from torch.optim.swa_utils import AveragedModel

from .averaging import ParameterCopies
from .frames import _SEED_NAMES, _changes_nothing, _closure_argument, _code_of, _from_the_toolkit
from .instrument import _as_float, flat


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


def _wraps_optimizer(obj: Any) -> bool:
    """True for an optimizer wrapper (Accelerate's ``AcceleratedOptimizer``): an ``Optimizer`` that holds another
    in ``.optimizer`` and calls it (or skips the call on micro-batches that do not end a window)."""
    inner = getattr(obj, "optimizer", None)
    return isinstance(inner, torch.optim.Optimizer) and inner is not obj


def _values(params: list[nn.Parameter]) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params]).clone() if params else torch.zeros(0)


_NAMES = (
    {
        "step",
        "__init__",
        "zero_grad",
        "scale",
        "unscale_",
        "update",
        "__enter__",
        "checkpoint",
        "update_parameters",
        "_call_impl",
    }
    | _CLIP_NAMES
    | _SEED_NAMES
)


#: What an average written by hand is recorded as (see :mod:`.averaging`).
BY_HAND = "(an average written by hand)"


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
        return torch.cat(
            [self._reads.get(i, self._last[a:b]) for i, (a, b) in enumerate(zip(self._offsets, self._offsets[1:]))]
        )

    def _read(self, opt: Any = None, grads: torch.Tensor | None = None) -> None:
        """Read the gradient an optimizer step applies: ``grads`` (default: ``.grad`` now), for the parameters
        ``opt`` holds (all of them when ``opt`` is None)."""
        now = flat(self.params) if grads is None else grads
        self._last = now
        held = (
            {id(p) for g in opt.param_groups for p in g["params"]} if isinstance(opt, torch.optim.Optimizer) else None
        )
        for i, p in enumerate(self.params):
            if held is None or id(p) in held:
                self._reads[i] = now[self._offsets[i] : self._offsets[i + 1]]

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
                if (
                    owners is not None
                    and id(frame) not in self._open
                    and (None in owners or id(self._self(frame)) in owners)
                ):
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
        except Exception as err:  # the recorder must never break the user's step: reported as checker_error
            self.errors.append(f"{type(err).__name__}: {err}")

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
        """Dispatch a call by name (and, for methods, by the object it runs on) to the handler that records it."""
        filename = frame.f_code.co_filename
        if name in _CLIP_NAMES:
            if filename.endswith("clip_grad.py"):
                self._on_clip(frame, name)
            return
        if name == "checkpoint":
            if filename.endswith(_CHECKPOINT_FILE):
                self._on_checkpoint(frame)
            return
        if name in _SEED_NAMES:
            self._on_seed(frame, name, filename)
            return
        obj = self._self(frame)
        if name in ("_call_impl", "update_parameters"):  # a module's forward; an AveragedModel's update
            if name == "_call_impl" and isinstance(obj, nn.Module):
                self._push(frame, "forward")
            elif isinstance(obj, AveragedModel) and self._push(frame, "average"):
                self._event("average.update", cls=type(obj).__name__, avg=id(obj))
        elif obj is not None:
            self._on_method(frame, name, obj)

    def _on_clip(self, frame: Any, name: str) -> None:
        """A clip function of torch's: the event, with its threshold and the gradient before it."""
        loc = frame.f_locals
        outer = self._push(frame, "clip", None)
        if outer:
            detail = {"fn": name, "scaled": self.grads_scaled, "before": flat(self.params)}
            for key in ("max_norm", "clip_value", "norm_type"):
                value = _as_float(loc.get(key))
                if value is not None:
                    detail[key] = value
            self._open[id(frame)] = ("clip", self._event("clip", **detail))

    def _on_checkpoint(self, frame: Any) -> None:
        """torch's checkpoint with preserve_rng_state=False: the event, and the code whose recomputation draws anew."""
        kwargs = frame.f_locals.get("kwargs") or {}
        if not kwargs.get("preserve_rng_state", True):  # torch then recomputes under new random draws
            self._event("checkpoint", preserve_rng_state=False)
            fn = frame.f_locals.get("function")
            module = isinstance(fn, nn.Module)
            code = _code_of(type(fn).forward if module else fn)
            if code is not None:
                self._unpreserved.setdefault(code, set()).add(id(fn) if module else None)

    def _on_seed(self, frame: Any, name: str, filename: str) -> None:
        """A seeding call of torch's or ``random``'s that the reader's loop makes (not torch's or gradaccum's own)."""
        obj = self._self(frame)
        is_rng = filename.endswith(("torch/random.py", "cuda/random.py", "torch/cuda/random.py")) or (
            name == "seed" and obj is not None and type(obj).__module__ == "random"
        )
        if is_rng and not _from_the_toolkit(frame.f_back) and not _changes_nothing(frame, name):
            if self._push(frame, "seed"):
                self._event("seed", fn=name)

    def _on_method(self, frame: Any, name: str, obj: Any) -> None:
        """A method call: scheduler constructors, autocast, GradScaler, scheduler and optimizer steps, zero_grad."""
        if name == "__init__":
            if isinstance(obj, LRScheduler):
                self._push(frame, "sched_init")
            return
        if name == "__enter__":
            if isinstance(obj, torch.amp.autocast) and getattr(obj, "_enabled", True):
                self._event("autocast", dtype=str(getattr(obj, "fast_dtype", "")).replace("torch.", ""))
            return
        if isinstance(obj, torch.amp.GradScaler) and name in ("scale", "unscale_", "step", "update"):
            self._on_scaler(frame, name, obj)
            return
        if name == "step" and isinstance(obj, LRScheduler):
            outer = self._push(frame, "sched")
            if outer and not self._depth.get("sched_init"):
                self._event("scheduler.step", cls=type(obj).__name__, sched=id(obj))
            return
        if name == "step" and isinstance(obj, torch.optim.Optimizer):
            self._on_optimizer_step(frame, obj)
            return
        if name == "zero_grad" and isinstance(obj, torch.optim.Optimizer) and _wraps_optimizer(obj):
            return
        if name == "zero_grad" and isinstance(obj, (torch.optim.Optimizer, nn.Module)):
            self._on_zero_grad(frame, obj)

    def _on_scaler(self, frame: Any, name: str, obj: Any) -> None:
        """GradScaler.scale, unscale_, step, update: the event, with the loss scale in force."""
        self.scaler = obj
        if name == "unscale_":
            self.grads_scaled = False
        if self._push(frame, "scaler"):
            scale = getattr(obj, "_scale", None)
            optimizer = frame.f_locals.get("optimizer")
            self._event(
                f"scaler.{name}",
                scale=float(scale) if scale is not None else None,
                opt=id(optimizer) if optimizer is not None else None,
            )

    def _on_optimizer_step(self, frame: Any, obj: Any) -> None:
        """An optimizer's step (a framework's wrapper: the step of the optimizer it wraps counts)."""
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
            event = self._event(
                "optimizer.step",
                cls=type(obj).__name__,
                via_scaler=bool(self._depth.get("scaler")),
                owns_params=owns,
                opt=id(obj),
            )
            # A closure runs inside step() (Lightning's last forward and backward): the gradient the step
            # applies is the one when the closure returns (after any clip it makes), and the backward passes
            # before the step are counted then. Without a closure we can name, backward passes that ran
            # inside step() mean the same, and the gradient is read when step() returns.
            self._closure_code = _code_of(_closure_argument(frame))
            self._closure_event = event
            self._open[id(frame)] = ("opt", (event, self.backwards))

    def _on_zero_grad(self, frame: Any, obj: Any) -> None:
        """zero_grad on an optimizer or module (after an update written by hand, that update is read first)."""
        if self._push(frame, "zero_grad"):
            if (
                not any(e.kind == "optimizer.step" for e in self.events)
                and self.backwards
                and not torch.equal(self._start, _values(self.params))
            ):
                # no optimizer has stepped, yet the parameters moved: an update written by hand (p -= lr * p.grad)
                # applied the gradient the buffer holds now
                self._read(None)
                self._event("optimizer.step", cls="(an update written by hand)", via_scaler=False, owns_params=True)
            self._event("zero_grad", cls=type(obj).__name__)

    def recomputing_unpreserved(self) -> bool:
        """Whether autograd is recomputing, in a backward pass, a function checkpointed with
        ``preserve_rng_state=False`` (its random draws then differ from the forward's)."""
        return self._depth.get("unpreserved", 0) > 0 and torch._C._current_graph_task_id() != -1

    def _return(self, frame: Any) -> None:
        category, data = self._open.pop(id(frame))
        self._depth[category] -= 1
        if data is None and category in ("opt", "wrap"):
            return  # a step nested in one already open (a wrapper's step calling its optimizer's): counted there
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

    def _copies_skipped(self) -> bool:
        """Where an in-place read of a parameter is no average written by hand (see :mod:`.averaging`)."""
        return (
            self.mute()
            or torch._C._current_graph_task_id() != -1
            or any(self._depth.get(c) for c in ("opt", "wrap", "average", "clip", "scaler", "zero_grad", "forward"))
        )

    def _hand_average(self) -> None:
        """An average written by hand read the parameters: one event per place between backward passes."""
        last = self.events[-1] if self.events else None
        if last is None or (last.kind, last.after, last.detail.get("cls")) != (
            "average.update",
            self.backwards,
            BY_HAND,
        ):
            self._event("average.update", cls=BY_HAND)

    @contextmanager
    def active(self) -> Iterator[None]:
        previous = sys.getprofile()
        sys.setprofile(self._profile)
        try:
            with ParameterCopies(self.params, self._copies_skipped, self._hand_average):
                yield
        finally:
            sys.setprofile(previous)
