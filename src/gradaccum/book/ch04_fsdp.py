r"""Chapter 4's fine print on FSDP2 (``torch.distributed.fsdp.fully_shard``) under accumulation, run on every rank
of a gloo process group by :func:`gradaccum.book.ddp_workers.launch` (task ``"fsdp2"``).

With ``set_requires_gradient_sync(False)`` FSDP2 skips the reduce-scatter and keeps each parameter's *unsharded*
gradient until the window's last backward. Where it keeps it (torch 2.13,
``torch/distributed/fsdp/_fully_shard/``):

- ``MixedPrecisionPolicy(param_dtype=p, reduce_dtype=r)`` with ``r`` set and different from ``p``: after each
  backward the unsharded gradient (computed in ``p``) is cast to ``r`` and kept in
  ``FSDPParam.unsharded_accumulated_grad``; the next micro-batch's gradient is added into it
  (``_fsdp_param.py``: ``to_accumulated_grad_if_needed``, ``accumulate_unsharded_grad_if_needed``).
- otherwise (``reduce_dtype`` unset, or equal to ``param_dtype``, which FSDP2 then clears): autograd adds into the
  unsharded parameter's own ``.grad``, in ``param_dtype``.

Either way every rank holds a gradient as large as the whole parameter, not its ``1/p`` shard. The sums differ:
:math:`\sum_k \mathrm{fl}_r(g_k)` against a running sum rounded to ``param_dtype`` at every addition (chapter 4's
bf16 accumulator), and in fp16 the running sum holds :math:`S\,g`, not the :math:`\tfrac{S}{K}g` of one backward.

And ``torch.amp.GradScaler`` with FSDP2: its inf check runs on the sharded ``DTensor`` gradients, and DTensor's
handler for ``_amp_foreach_non_finite_check_and_unscale_`` all-reduces the flag (a ``Partial("max")``), so every
rank skips a step that overflowed in any rank's shard (``torch/distributed/tensor/_dispatch.py``:
``found_inf_reduce_handler``).

This module imports torch alone: every worker of the launcher imports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

#: The mixed-precision policies compared: name → ``MixedPrecisionPolicy`` keyword arguments.
POLICIES: dict[str, dict[str, torch.dtype]] = {
    "param_dtype=bf16, reduce_dtype=fp32": {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32},
    "param_dtype=bf16, reduce_dtype unset": {"param_dtype": torch.bfloat16},
    "no policy (fp32)": {},
}

#: The scaler's default loss scale, 2^16.
SCALE = 2.0**16


@dataclass
class Held:
    """What one rank holds for its parameters after a backward with gradient sync off: where (``holder``), in which
    dtype, and how many bytes, beside the bytes of its fp32 sharded gradient."""

    holder: str
    dtype: str
    bytes: int
    shard_bytes: int


@dataclass
class ScalerRun:
    """One window under fp16 (``param_dtype=fp16``) with ``torch.amp.GradScaler``, as one rank saw it."""

    shard_finite: bool  # this rank's sharded gradient, before unscale_: all finite?
    found_inf: float  # the scaler's inf flag after unscale_ (all-reduced over the ranks by DTensor)
    stepped: bool  # did this rank's shard of the weights change?
    scale_after: float


@dataclass
class Fsdp2Rank:
    """Everything one rank measured (:func:`fsdp2_task`)."""

    k: int
    # (gradient sync, policy) → what is held after a backward that does not end the window
    held: dict[tuple[str, str], Held] = field(default_factory=dict)
    # relative error of the window's gradient against the same window reduced every micro-batch, per policy
    errors: dict[str, float] = field(default_factory=dict)
    # fp16, S/K · g within range in every backward, S · g beyond it: per reduce_dtype ("fp32", "unset")
    headroom: dict[str, ScalerRun] = field(default_factory=dict)
    # fp16, one output's gradient overflowing on rank 1 only: what each rank's scaler did
    one_rank_overflow: ScalerRun | None = None


def _mlp(seed: int) -> nn.Sequential:
    """Linear(64, 64) → ReLU → Linear(64, 10), its weights drawn from ``seed`` alone."""
    gen = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    return model


def _shard(model: nn.Module, **policy: Any) -> Any:
    """``fully_shard`` on every linear layer inside, then on the root: the usual FSDP2 wrapping; returns the
    model, now also an ``FSDPModule`` (``set_requires_gradient_sync`` and the rest)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(**policy)
    for layer in model.modules():
        if isinstance(layer, nn.Linear) and layer is not model:
            fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def _fsdp_params(model: nn.Module) -> list[Any]:
    """FSDP2's per-parameter records (``FSDPParam``) of every sharded module."""
    found = []
    for module in model.modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        state = get_state() if get_state is not None else None
        group = getattr(state, "_fsdp_param_group", None)
        if group is not None:
            found.extend(group.fsdp_params)
    return found


def held_between_micro_batches(model: nn.Module) -> Held:
    """Where FSDP2 keeps the gradient after a backward that did not end the window (see the module's text): the
    unsharded gradient when gradient sync was off, else only the sharded ``.grad`` (fp32, the parameters' dtype)."""
    holders, dtypes, total, shard = set(), set(), 0, 0
    for fp in _fsdp_params(model):
        acc = fp.unsharded_accumulated_grad
        grad = acc if acc is not None else fp._unsharded_param.grad
        if grad is None:  # reduce-scattered: only the shard remains
            holders.add("the sharded .grad")
            grad = fp.sharded_param.grad.to_local()
        else:
            holders.add(
                "FSDPParam.unsharded_accumulated_grad" if acc is not None else "the unsharded parameter's .grad"
            )
        dtypes.add(str(grad.dtype).replace("torch.", ""))
        total += grad.numel() * grad.element_size()
        shard += fp.sharded_param.to_local().numel() * 4  # the sharded gradient: the parameters' fp32
    if len(holders) != 1 or len(dtypes) != 1:
        raise RuntimeError(f"the parameters' gradients are held in several places: {holders}, {dtypes}")
    return Held(holders.pop(), dtypes.pop(), total, shard)


def _window(rank: int, policy: dict[str, torch.dtype], k: int, sync_each: bool, b: int, seed: int) -> tuple:
    """One window of ``k`` micro-batches of ``b`` random samples per rank (mean loss / K); returns the gathered
    gradient (float64) and what was held after the next-to-last backward."""
    gen = torch.Generator().manual_seed(1000 + rank)
    x, y = torch.randn(k * b, 64, generator=gen), torch.randint(0, 10, (k * b,), generator=gen)
    model = _shard(_mlp(seed), **policy)
    held = None
    for i in range(k):
        model.set_requires_gradient_sync(sync_each or i == k - 1)
        out = model(x[i * b : (i + 1) * b]).float()
        (nn.functional.cross_entropy(out, y[i * b : (i + 1) * b]) / k).backward()
        if i == k - 2:
            held = held_between_micro_batches(model)
    grad = torch.cat([p.grad.full_tensor().flatten() for p in model.parameters()])
    return grad.double(), held


def _scaled_window(loss_weights: torch.Tensor, k: int, reduce_dtype: torch.dtype | None) -> ScalerRun:
    """``Linear(8, 4)`` under ``param_dtype=fp16`` (rows 0–1 on rank 0, rows 2–3 on rank 1), one window of ``k``
    micro-batches of one all-ones input with loss ``Σ_j w_j·out_j / K`` (``loss_weights``: this rank's ``w`` for
    each micro-batch, shape ``(k, 4)``), scaled by a ``torch.amp.GradScaler("cpu")`` at ``2^16``; then
    ``unscale_``, ``step``, ``update``. The gradient of row ``j`` in micro-batch ``i`` is
    ``S/K · w_ij`` per entry in fp16."""
    layer = nn.Linear(8, 4)
    with torch.no_grad():
        layer.weight.fill_(0.5)
        layer.bias.zero_()
    policy = {"param_dtype": torch.float16} | ({"reduce_dtype": reduce_dtype} if reduce_dtype else {})
    model = _shard(layer, **policy)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    for i in range(k):
        model.set_requires_gradient_sync(i == k - 1)
        out = model(torch.ones(1, 8)).float()  # the loss in fp32, as autocast would give it
        scaler.scale((out * loss_weights[i]).sum() / k).backward()
    shards = [p.grad.to_local() for p in model.parameters()]
    finite = all(bool(torch.isfinite(s).all()) for s in shards)
    before = [p.detach().to_local().clone() for p in model.parameters()]
    scaler.unscale_(opt)
    found = float(sum(v.item() for v in scaler._found_inf_per_device(opt).values()))
    scaler.step(opt)
    scaler.update()
    after = [p.detach().to_local() for p in model.parameters()]
    stepped = any(not torch.equal(a, c) for a, c in zip(before, after))
    return ScalerRun(finite, found, stepped, scaler.get_scale())


def fsdp2_task(rank: int, world_size: int, k: int = 16, b: int = 8, seed: int = 0) -> Fsdp2Rank:
    """Run on every rank of an initialized gloo process group (2 ranks): where FSDP2 keeps the gradient between
    micro-batches for each of :data:`POLICIES`, what that costs in precision against the same window reduced every
    micro-batch, and what ``torch.amp.GradScaler`` does under fp16."""
    result = Fsdp2Rank(k)
    bf16_fp32 = POLICIES["param_dtype=bf16, reduce_dtype=fp32"]
    reference, held = _window(rank, bf16_fp32, k, True, b, seed)
    result.held["every micro-batch", "param_dtype=bf16, reduce_dtype=fp32"] = held
    for name, policy in POLICIES.items():
        grad, held = _window(rank, policy, k if policy.get("param_dtype") else 2, False, b, seed)
        result.held["last micro-batch only", name] = held
        if policy.get("param_dtype") == torch.bfloat16:
            result.errors[name] = float((grad - reference).norm() / reference.norm())
    # S/K · w = 2^14 · 1.25 = 20480 in each backward (fp16 holds it); the sum over K = 4 is 81920 (it does not)
    w = torch.full((4, 4), 1.25)
    result.headroom = {
        "fp32": _scaled_window(w, 4, torch.float32),
        "unset": _scaled_window(w, 4, None),
    }
    # one output's gradient (row 3, on rank 1's shard) beyond fp16 in rank 1's second micro-batch only
    w = torch.full((4, 4), 0.01)
    if rank == 1:
        w[1, 3] = 10.0  # 2^14 · 10 = 163840 > 65504
    result.one_rank_overflow = _scaled_window(w, 4, torch.float32)
    return result
