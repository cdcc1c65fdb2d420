r"""What :mod:`gradaccum.checker` measures, and how: replayed randomness, recorded calls, traced gradient buffers.

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
import math
import numbers
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from gradaccum import _tensors

from .batch import batch_size, call

_SEEDED = torch.Tag.nondeterministic_seeded


#: Random ATen ops replayed per sample (elementwise draws); other random ops run as they are and are reported.
REPLAYABLE = {
    "bernoulli",
    "bernoulli_",
    "uniform_",
    "normal_",
    "normal",
    "rand",
    "rand_like",
    "randn",
    "randn_like",
    "randint",
    "randint_like",
    "multinomial",
    "native_dropout",
    "exponential_",
    "geometric_",
    "cauchy_",
    "log_normal_",
    "random_",
    "poisson",
    "binomial",
}


_MASK = (1 << 63) - 1


def sample_seed(seed: int, call: int, sample: int) -> int:
    """The seed of the ``call``-th random op of a forward pass, for sample ``sample`` of the window."""
    return ((seed * 1_000_003 + call) * 1_000_033 + sample * 7_919 + 17) & _MASK


def flat(params: list[nn.Parameter]) -> torch.Tensor:
    """The parameters' gradients as one float64 vector on the CPU (zeros where ``.grad`` is None)."""
    return _tensors.flat_grads(params, float64=True)


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


class SampleRNG(TorchDispatchMode):
    """Replays randomness per sample inside forward passes (``replay=True``), or records the random values a
    step draws (``replay=False``: used to see whether a step's draws depend on the state it starts from)."""

    def __init__(self, seed: int, replay: bool = True, plans: dict[Any, Any] | None = None):
        super().__init__()
        self.seed = seed
        self.replay = replay
        # call index → (kind, batch dim, rows per sample); a module's name → the call index at which the model's
        # forward enters it (a step that calls the module itself continues the count from there)
        self.plans = {} if plans is None else plans
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
        if _SEEDED in func.tags and not self.inside() and not _draws_nothing(func, args, kwargs) and not _loader_seed():
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
        if frame.f_code.co_filename.endswith(_LOADER_FILE) and frame.f_code.co_name in ("__init__", "_share_dist_seed"):
            return True
        frame = frame.f_back
    return False


_LOADER_FILE = os.path.join("torch", "utils", "data", "dataloader.py")


def _draws_nothing(func, args, kwargs) -> bool:  # noqa: ANN001
    """Seeded ops that draw nothing for these arguments: dropout with p = 0, or not in training."""
    for i, arg in enumerate(func._schema.arguments):
        default = arg.default_value if arg.has_default_value() else None
        value = args[i] if i < len(args) else kwargs.get(arg.name, default)
        if (
            arg.name in ("dropout_p", "p")
            and func._overloadpacket.__name__ not in ("bernoulli_", "bernoulli")
            and isinstance(value, (int, float))
            and value == 0
        ):
            return True
        if arg.name == "train" and value is False:
            return True
    return False


def identical_draws(
    a: list[tuple[tuple[int, ...], torch.Tensor]], b: list[tuple[tuple[int, ...], torch.Tensor]]
) -> tuple[int, int]:
    """(draws equal in both runs, draws compared): draws that are constant (all entries equal) are skipped, since
    they carry no randomness (``bernoulli(1)``)."""
    same = compared = 0
    for (sa, va), (sb, vb) in zip(a, b):
        if sa != sb or va.numel() < 2 or bool((va == va[0]).all()):
            continue
        compared += 1
        same += bool(torch.equal(va, vb))
    return same, compared


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


def _module_difference(
    module: nn.Module, inputs: tuple[tuple[Any, ...], dict[str, Any]], n: int, b: int, rng: SampleRNG, rtol: float
) -> float | None:
    """The largest difference between ``module``'s output for the first b samples called on them alone and called
    on all n (its captured ``inputs``), or None when they agree or cannot be compared."""
    args, kwargs = inputs
    small_args = tuple(_slice(a, n, b) if isinstance(a, torch.Tensor) and n in a.shape else a for a in args)
    small_kwargs = {
        k: _slice(v, n, b) if isinstance(v, torch.Tensor) and n in v.shape else v for k, v in kwargs.items()
    }
    if any(s is None for s in small_args):
        return None
    rng.plans = {}
    before = len(rng.unreplayed)
    try:
        with rng:
            rng.start_forward(0, n)
            full = first_tensor(module(*args, **kwargs))
            rng.start_forward(0, b)
            small = first_tensor(module(*small_args, **small_kwargs))
    except Exception:
        return None
    if len(rng.unreplayed) > before:
        return None  # randomness without a batch dimension: a difference would say nothing
    if full is None or small is None:
        return None
    head = _slice(full, n, b)
    if head is None or head.shape != small.shape:
        return None
    if _close(small, head, rtol):
        return None
    return float((small.double() - head.double()).abs().max())


def coupled_modules(model: nn.Module, x: Any, b: int, rng: SampleRNG, rtol: float) -> list[tuple[str, str, float]]:
    """Modules whose output for a sample depends on the other samples of its batch, found by measurement.

    Every module is called twice on the inputs it received in a full-batch forward pass: on all N samples, and
    on the first b of them; when the first b rows of the two outputs differ (randomness replayed per sample), the
    module couples samples. Only the innermost such modules are returned, as (name, class, max difference).
    """

    work = copy.deepcopy(model)
    n = batch_size(x)
    captured: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {}
    handles = []
    names = {m: name for name, m in work.named_modules()}

    def keep(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        name = names.get(module)
        if name is not None and name not in captured:
            captured[name] = (
                tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args),
                {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()},
            )

    for module in work.modules():
        handles.append(module.register_forward_pre_hook(keep, with_kwargs=True))
    try:
        with torch.no_grad(), rng:
            rng.start_forward(0, n)
            call(work, x)
    finally:
        for h in handles:
            h.remove()
    found: dict[str, tuple[str, float]] = {}
    with torch.no_grad():
        for name, module in work.named_modules():
            if name not in captured:
                continue
            diff = _module_difference(module, captured[name], n, b, rng, rtol)
            if diff is not None:
                found[name] = (type(module).__name__, diff)
    inner = [name for name in found if not any(o != name and (name == "" or o.startswith(name + ".")) for o in found)]
    return [(name or "(the model itself)", found[name][0], found[name][1]) for name in inner]
