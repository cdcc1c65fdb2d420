r"""Batch-coupled computations beyond BatchNorm, and what accumulation does to them.

**Contrastive losses with in-batch negatives.** For paired embeddings :math:`a_i, b_i` of a batch of :math:`n`,
InfoNCE is :math:`L = -\frac1n \sum_i \log \frac{e^{s_{ii}/\tau}}{\sum_j e^{s_{ij}/\tau}}` with
:math:`s_{ij} = \hat a_i \cdot \hat b_j` (unit vectors): every sample's loss depends on every other sample of the
batch. With K micro-batches of b, each sample sees b − 1 negatives instead of Kb − 1, and the accumulated loss
:math:`\frac1K \sum_k L(B_k)` is a different function of the parameters, not a noisy estimate of :math:`L(B)`.
GradCache (Gao et al. 2021) computes the full-batch gradient anyway: embed every micro-batch without a graph, take
the full-batch loss and its gradient :math:`G = \partial L / \partial z` with respect to the embeddings (small),
then run each micro-batch again with a graph and backpropagate :math:`\langle z_k, G_k \rangle`. By the chain rule
:math:`\sum_k \partial \langle z_k, G_k\rangle / \partial\theta = \partial L / \partial \theta` exactly, at the cost
of a second forward per micro-batch (:func:`grad_cache_backward`).

**Mixture-of-experts load balancing** (:func:`expert_fractions`, :func:`switch_aux_loss`,
:func:`window_fractions`) is in :mod:`gradaccum.load_balancing`, re-exported here.

**Activation checkpointing × BatchNorm.** ``torch.utils.checkpoint`` reruns the forward during backward; a
BatchNorm inside updates its running statistics again, so each micro-batch moves them twice, with the same batch
statistics: :math:`r \leftarrow (1-m)^2 r + (1-(1-m)^2)\,\mu`, an effective momentum :math:`1 - (1-m)^2` per
micro-batch and :math:`1 - (1-m)^{2K}` per optimizer step. :func:`checkpoint_keeping_bn_stats` reruns with the
statistics frozen.
"""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from gradaccum import _tensors
from gradaccum._validate import require_count, require_k, require_momentum

# the mixture-of-experts load-balancing loss lives in gradaccum.load_balancing; chapter 8 reads it from here too
from gradaccum.load_balancing import expert_fractions as expert_fractions
from gradaccum.load_balancing import switch_aux_loss as switch_aux_loss
from gradaccum.load_balancing import window_fractions as window_fractions

__all__ = [
    "info_nce",
    "micro_batch_info_nce",
    "plain_accumulation_backward",
    "grad_cache_backward",
    "expert_fractions",
    "switch_aux_loss",
    "window_fractions",
    "checkpoint_keeping_bn_stats",
    "recompute_momentum",
]

_BN = nn.modules.batchnorm._BatchNorm
_NORM = nn.modules.batchnorm._NormBase  # BatchNorm and InstanceNorm: both may keep running statistics


def _require_embeddings(a: torch.Tensor, b: torch.Tensor) -> None:
    """Two (n, d) floating-point embeddings of one shape and dtype, d >= 1, finite."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise ValueError(f"a and b must be torch tensors (n, d), got {type(a).__name__} and {type(b).__name__}.")
    if a.shape != b.shape or a.dim() != 2 or a.shape[1] == 0:
        raise ValueError(
            f"a and b must be (n, d) embeddings of the same shape with d >= 1, got {tuple(a.shape)} "
            f"and {tuple(b.shape)}."
        )
    if not a.is_floating_point() or a.dtype != b.dtype:
        raise ValueError(f"a and b must be floating-point embeddings of one dtype, got {a.dtype} and {b.dtype}.")
    if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
        raise ValueError("the embeddings contain inf or NaN: the encoder's output has overflowed or diverged.")


def _temperature(temperature: float | torch.Tensor, dtype: torch.dtype | None = None) -> float | torch.Tensor:
    """A positive finite temperature (or a one-element floating tensor, for a learnable one, as a scalar) whose
    inverse is finite in ``dtype`` (the similarities it divides: 1/τ must not overflow)."""
    if isinstance(temperature, torch.Tensor):  # a learnable temperature: one positive finite value
        valid = (
            temperature.numel() == 1
            and temperature.is_floating_point()
            and bool(torch.isfinite(temperature).all())
            and bool((temperature > 0).all())
        )
    else:
        valid = (
            isinstance(temperature, numbers.Real) and not isinstance(temperature, bool) and 0 < temperature < math.inf
        )
    if not valid:
        raise ValueError(
            f"temperature must be a positive finite number (or a one-element floating tensor, for a "
            f"learnable temperature), got {temperature!r}."
        )
    value = float(temperature.detach()) if isinstance(temperature, torch.Tensor) else float(temperature)
    if dtype is not None and value < 1 / torch.finfo(dtype).max:
        raise ValueError(
            f"temperature {value:g} is so small that 1/temperature overflows {dtype}; "
            "typical temperatures lie between 0.01 and 1."
        )
    if isinstance(temperature, torch.Tensor):
        return temperature.reshape(())  # a (1, 1) temperature must not broadcast the logits to 3-D
    return temperature


def info_nce(a: torch.Tensor, b: torch.Tensor, temperature: float = 0.1) -> torch.Tensor:
    r"""InfoNCE over in-batch negatives: the mean over i of
    :math:`-\log\,\mathrm{softmax}_j(\hat a_i\cdot\hat b_j/\tau)_i` (the positive of ``a[i]`` is ``b[i]``; every
    other ``b[j]`` of the batch is a negative)."""
    _require_embeddings(a, b)
    if len(a) == 0:
        raise ValueError("no pairs: InfoNCE over an empty batch is undefined; give at least one pair.")
    logits = F.normalize(a, dim=1) @ F.normalize(b, dim=1).T / _temperature(temperature, a.dtype)
    return F.cross_entropy(logits, torch.arange(len(a), device=a.device))


def micro_batch_info_nce(
    a: torch.Tensor, b: torch.Tensor, k: int, temperature: float | torch.Tensor = 0.1
) -> torch.Tensor:
    r"""The loss plain accumulation optimizes, in one pass: the mean over the K micro-batches (consecutive
    blocks of m = n/K rows, as ``torch.chunk`` cuts them) of their own InfoNCE, :math:`\frac1K\sum_k L(B_k)`. It
    is InfoNCE with every similarity outside a sample's own block masked out (:math:`s_{ij} = -\infty`): each
    row's softmax sees only its micro-batch's m − 1 negatives, and the mean over all n rows is the mean over the
    blocks of their means (equal blocks).

    Its gradient is :func:`plain_accumulation_backward`'s with ``info_nce``, to rounding, when the embeddings
    come from encoders that treat each sample on its own and draw no random numbers (no dropout, no BatchNorm
    with batch statistics): those give each micro-batch the embeddings it would get alone. It saves time, not
    memory: the whole batch's graph and an n × n similarity matrix are held, which accumulation avoids."""
    _require_embeddings(a, b)
    n = len(a)
    require_k(k)
    if n == 0 or n % k:
        raise ValueError(
            f"K = {k} does not divide the batch of {n} into non-empty micro-batches; pick a batch that K divides."
        )
    temperature = _temperature(temperature, a.dtype)
    logits = F.normalize(a, dim=1) @ F.normalize(b, dim=1).T / temperature
    block = torch.arange(n, device=a.device) // (n // k)
    logits = logits.masked_fill(block[:, None] != block[None, :], float("-inf"))
    return F.cross_entropy(logits, torch.arange(n, device=a.device))


def _split(inputs: Sequence[torch.Tensor], k: int) -> list[tuple[torch.Tensor, ...]]:
    require_k(k)
    n = len(inputs[0])
    if any(len(x) != n for x in inputs):
        raise ValueError(f"every input needs the same number of samples, got {[len(x) for x in inputs]}.")
    if n == 0 or n % k:
        raise ValueError(
            f"K = {k} does not divide the batch of {n} into non-empty micro-batches; pick a batch that K divides."
        )
    return _tensors.split_tensors(inputs, k)


def _check_encoders(encoders: Sequence[nn.Module], inputs: Sequence[torch.Tensor]) -> None:
    if len(encoders) != len(inputs) or not encoders:
        raise ValueError(
            f"give one encoder per input (the same module twice if they share weights), got "
            f"{len(encoders)} encoder(s) for {len(inputs)} input(s)."
        )
    for i, (enc, x) in enumerate(zip(encoders, inputs)):
        if not isinstance(enc, nn.Module):
            raise ValueError(
                f"encoder {i} is a {type(enc).__name__}, not an nn.Module: GradCache reads a module's "
                "layers and buffers to refuse what it cannot recompute exactly; wrap the function in an "
                "nn.Module (its forward calling it)."
            )
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            raise ValueError(
                f"input {i} must be a torch.Tensor with a batch dimension, got "
                f"{type(x).__name__}{'' if not isinstance(x, torch.Tensor) else ' of shape ()'}; "
                "convert it with torch.as_tensor(...) and keep the samples along dimension 0."
            )
        if x.is_inference():
            raise ValueError(
                f"input {i} was made under torch.inference_mode(), and autograd cannot save inference "
                "tensors for backward; make it outside inference mode (or pass x.clone() made there)."
            )
    for enc in encoders:
        for name, m in enc.named_modules():
            if isinstance(m, _BN) and (m.training or m.running_mean is None):
                raise ValueError(
                    f"{type(enc).__name__}.{name or 'self'} is a BatchNorm that normalizes with batch "
                    "statistics (training mode, or track_running_stats=False): they couple the samples "
                    "of each micro-batch, so no per-micro-batch recomputation can be exact. Use "
                    "GroupNorm/LayerNorm, or a BatchNorm in eval mode with running statistics."
                )


#: A buffer as a module holds it: (owning module, its name there, the tensor, the encoder-qualified name, a copy
#: of its values).
_Buffer = tuple[nn.Module, str, torch.Tensor, str, torch.Tensor]


def _buffers(encoders: Sequence[nn.Module]) -> list[_Buffer]:
    """Every buffer of the encoders, once per (module, name) slot: the tensor the slot holds now and a copy."""
    seen: set[tuple[int, str]] = set()
    out = []
    for enc in encoders:
        for path, module in enc.named_modules():
            for name, buf in module._buffers.items():
                if buf is not None and (id(module), name) not in seen:
                    seen.add((id(module), name))
                    label = f"{type(enc).__name__}.{path + '.' if path else ''}{name}"
                    out.append((module, name, buf, label, buf.clone()))
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN equal to NaN (a buffer holding NaN that the forward pass left alone is unchanged)."""
    if torch.equal(a, b):
        return True
    return a.is_floating_point() and torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def _refuse_changed_buffers(buffers: list[_Buffer]) -> None:
    """Raise a ``ValueError`` naming the buffers the forward passes changed — in place, or replaced by another
    tensor — after putting every one back."""
    changed = [
        label
        for module, name, buf, label, old in buffers
        if module._buffers.get(name) is not buf or not _same(buf, old)
    ]
    if changed:
        for module, name, buf, _, old in buffers:
            buf.copy_(old)
            module._buffers[name] = buf
        raise ValueError(
            f"the encoders' forward pass changed the buffer(s) {', '.join(changed)} (running "
            "statistics, a power iteration, a counter): GradCache runs every micro-batch twice, so "
            "its second pass would run in another state than the first and the gradient would not be "
            "exact. Put those layers in eval mode or remove them from the encoder (the buffers were "
            "restored)."
        )


def plain_accumulation_backward(
    encoders: Sequence[nn.Module],
    inputs: Sequence[torch.Tensor],
    k: int,
    loss_fn: Callable[..., torch.Tensor] = info_nce,
) -> float:
    """Plain accumulation of a batch-coupled loss: ``loss_fn`` on each micro-batch's embeddings, divided by K,
    backpropagated micro-batch by micro-batch (negatives only from the same micro-batch). Returns the summed loss."""
    _check_encoders(encoders, inputs)
    cut = _cut(inputs)
    total = 0.0
    for chunk in _split(cut, k):
        loss = loss_fn(*[enc(x) for enc, x in zip(encoders, chunk)]) / k
        loss.backward()
        total += float(loss.detach())
    _join(inputs, cut)
    return total


def _cut(inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The inputs, each computed by layers that need grad (a shared trunk, a view or a cast of a leaf) replaced
    by a detached leaf that requires grad: the micro-batches' backward passes stop there, and :func:`_join` sends
    their summed gradient through the input's own graph once (which each micro-batch's pass could not: the
    first frees it)."""
    return [x.detach().requires_grad_() if x.grad_fn is not None else x for x in inputs]


def _join(inputs: Sequence[torch.Tensor], cut: Sequence[torch.Tensor]) -> None:
    """One backward pass through the inputs' graphs with the gradients :func:`_cut`'s leaves collected."""
    pairs = [(x, c.grad) for x, c in zip(inputs, cut) if c is not x and c.grad is not None]
    if pairs:
        torch.autograd.backward([x for x, _ in pairs], [g for _, g in pairs])


def _rng_devices() -> list[int]:
    return list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []


def _rng_state(devices: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    return torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices]


def _embedding(enc: nn.Module, x: torch.Tensor, saved: list[_Buffer]) -> torch.Tensor:
    """``enc(x)``, refused unless it is one tensor (the buffers put back first)."""
    z = enc(x)
    if not isinstance(z, torch.Tensor) or z.dim() == 0:
        _refuse_changed_buffers(saved)
        got = "a 0-dimensional tensor" if isinstance(z, torch.Tensor) else f"a {type(z).__name__}"
        raise ValueError(
            f"{type(enc).__name__} returned {got}: GradCache caches one tensor of embeddings (rows "
            "first) per encoder and micro-batch; return a single tensor."
        )
    return z


def _scalar(loss: object) -> torch.Tensor:
    """The loss, refused unless it is a one-element tensor."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(
            f"loss_fn returned {shape}, not a scalar tensor: GradCache backpropagates one full-batch "
            "loss; reduce it (.mean() or .sum(), as the loss you want to train)."
        )
    return loss


def _replay(
    enc: nn.Module,
    x: torch.Tensor,
    state: tuple[torch.Tensor, list[torch.Tensor]],
    devices: list[int],
    cached: torch.Tensor,
) -> torch.Tensor:
    """``enc(x)`` again, with a graph, under the random state saved before its first run (the same dropout masks);
    refused unless it is the cached embedding (its shape, and its values to a thousand rounding steps)."""
    with torch.random.fork_rng(devices=devices):
        cpu, cuda = state
        torch.set_rng_state(cpu)
        for d, s in zip(devices, cuda):
            torch.cuda.set_rng_state(s, d)
        z = enc(x)
    if z.shape != cached.shape:
        raise ValueError(
            f"{type(enc).__name__} returned {tuple(z.shape)} when embedding a micro-batch again, "
            f"{tuple(cached.shape)} the first time: GradCache needs a forward pass that repeats "
            "itself; .grad now holds a partial gradient (zero it)."
        )
    if z.is_floating_point():
        eps = torch.finfo(z.dtype).eps
        gap = float((z.detach() - cached).double().norm())
        if not gap <= 1e3 * eps * float(cached.double().norm()) + 1e-30:
            raise ValueError(
                f"{type(enc).__name__} returned another embedding when embedding a micro-batch again "
                f"(relative difference {gap / max(float(cached.double().norm()), 1e-300):.2g}): its "
                "forward pass changed something it reads (an input scaled in place, x.div_(255), an "
                "attribute, a parameter), so GradCache's replay runs another network; .grad now holds "
                "a partial gradient (zero it)."
            )
    return z


def _embed_without_graph(
    encoders: Sequence[nn.Module], chunks: Sequence[Sequence[torch.Tensor]], devices: list[int]
) -> tuple[list[list[tuple[torch.Tensor, list[torch.Tensor]]]], list[list[torch.Tensor]]]:
    """GradCache's step 1: every micro-batch (``chunks[j]``, one input per encoder) embedded by each encoder without
    a graph, the random state saved before each embedding; refused (the buffers put back) if a forward pass changed
    a buffer. Returns the states and the embeddings, indexed [micro-batch][encoder]."""
    saved = _buffers(encoders)
    states: list[list[tuple[torch.Tensor, list[torch.Tensor]]]] = []
    cached: list[list[torch.Tensor]] = []
    with torch.no_grad():
        for chunk in chunks:
            row_states, row = [], []
            for enc, x in zip(encoders, chunk):
                row_states.append(_rng_state(devices))  # replayed in step 3: the same dropout masks
                row.append(_embedding(enc, x, saved))
            states.append(row_states)
            cached.append(row)
        _refuse_changed_buffers(saved)
    return states, cached


def grad_cache_backward(
    encoders: Sequence[nn.Module],
    inputs: Sequence[torch.Tensor],
    k: int,
    loss_fn: Callable[..., torch.Tensor] = info_nce,
) -> float:
    """GradCache: add to ``.grad`` the exact gradient of ``loss_fn(*[enc(x) for enc, x in zip(encoders, inputs)])``
    over the whole batch while holding the graph of one micro-batch at a time. Returns the full-batch loss.

    1. embed every micro-batch of every input without a graph, saving the random state (CPU and CUDA) before each;
    2. the full-batch loss on the cached embeddings, backpropagated: parameters inside ``loss_fn`` (a learnable
    temperature, a projection head) get their full-batch gradient, the embeddings theirs; 3. per micro-batch and
    encoder, embed again with a graph, under the saved random state, and backpropagate the cached gradient
    (``z.backward(G)``). With dropout, the result is the full-batch gradient under the masks drawn in step 1.

    Refuses (``ValueError``) a BatchNorm that normalizes with batch statistics, and an encoder whose forward pass
    changes a buffer, in place or by replacing it (an InstanceNorm's running statistics, spectral norm's power
    iteration): step 3 would run another network than step 1 (the buffers are put back); so is a re-embedding
    that differs from step 1's by more than rounding (an input scaled in place, a parameter or attribute the
    forward changes). Not seen, and as wrong: a change made only in step 3, and any coupling of the samples inside
    an encoder; GradCache is exact for couplings that sit in ``loss_fn``. Under DDP, each
    re-embedding backward pass all-reduces unless all but the last run in ``no_sync()``. A shared trunk before the
    encoders gets its gradient in one backward pass at the end (:func:`_cut`, :func:`_join`). An encoder may return
    any number of rows per micro-batch (one per token, say): ``loss_fn`` sees each encoder's rows concatenated in
    micro-batch order.
    """
    _check_encoders(encoders, inputs)
    chunks = _split(cut := _cut(inputs), k)
    devices = _rng_devices()
    states, cached = _embed_without_graph(encoders, chunks, devices)
    reps = [torch.cat([row[i] for row in cached]).requires_grad_() for i in range(len(encoders))]
    loss = _scalar(loss_fn(*reps))
    loss.backward()
    grads = [r.grad for r in reps]
    starts = [0] * len(encoders)  # each micro-batch's first row in reps (an encoder may return several per sample)
    for j, chunk in enumerate(chunks):
        for i, (enc, x) in enumerate(zip(encoders, chunk)):
            z, rows, gz = _replay(enc, x, states[j][i], devices, cached[j][i]), len(cached[j][i]), grads[i]
            if z.requires_grad and gz is not None:  # a frozen encoder has nothing to update
                z.backward(gz[starts[i] : starts[i] + rows])
            starts[i] += rows
    _join(inputs, cut)
    return float(loss.detach())


# ------------------------------------------------------------------------------ checkpointing and BatchNorm


def recompute_momentum(m: float, k: int, reruns: int = 1) -> float:
    """The effective BatchNorm momentum per optimizer step when each of K micro-batches runs the forward
    ``1 + reruns`` times with the same statistics: :math:`1 - (1-m)^{(1+\\text{reruns})K}`."""
    require_k(k)
    if m is None:
        raise ValueError(
            "momentum=None is BatchNorm's cumulative average: reruns add more batches to the average "
            "instead of moving it by a momentum, so this formula does not apply."
        )
    m = float(require_momentum(m, allow_zero=True))
    require_count(reruns, "reruns", minimum=0)
    return 1 - (1 - m) ** ((1 + reruns) * k)


def _require_module(module: object) -> None:
    """The layers kept are the module's own: a function reaching layers through a closure is refused."""
    if not isinstance(module, nn.Module):
        raise ValueError(
            f"checkpoint_keeping_bn_stats needs the nn.Module to checkpoint (its BatchNorm layers are the "
            f"ones kept), got {type(module).__name__}; wrap the function's layers in an nn.Module, or "
            "pass the module whose method you checkpoint."
        )


@contextlib.contextmanager
def _frozen_bn(module: nn.Module) -> Iterator[None]:
    """BatchNorm and InstanceNorm layers of ``module`` that track running statistics normalize as usual but do not
    update them."""
    saved = [
        (m, m.momentum, None if m.num_batches_tracked is None else m.num_batches_tracked.clone())
        for m in module.modules()
        if isinstance(m, _NORM) and m.track_running_stats
    ]
    for m, _, _ in saved:
        m.momentum = 0.0
    try:
        yield
    finally:
        for m, momentum, tracked in saved:
            m.momentum = momentum
            if tracked is not None and m.num_batches_tracked is not None:
                m.num_batches_tracked.copy_(tracked)


def checkpoint_keeping_bn_stats(module: nn.Module, *args: torch.Tensor) -> torch.Tensor:
    """``torch.utils.checkpoint.checkpoint(module, *args, use_reentrant=False)`` whose recomputation during
    backward leaves the running statistics of BatchNorm and InstanceNorm layers (and ``num_batches_tracked``) as the
    first forward left them.
    The output and the gradient are the same as without checkpointing (``module``: an ``nn.Module``)."""
    _require_module(module)
    return checkpoint(
        module, *args, use_reentrant=False, context_fn=lambda: (contextlib.nullcontext(), _frozen_bn(module))
    )
