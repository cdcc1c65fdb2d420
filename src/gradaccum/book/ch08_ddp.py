r"""Chapter 8's contrastive loss under DDP: what each rank's loss must see for the averaged gradient to be the
global batch's.

With p ranks of m pairs each, the global InfoNCE's negatives are all p·m samples. A rank that computes InfoNCE
over its own m pairs optimizes another loss. A rank that gathers the others' embeddings with
``torch.distributed.all_gather`` (no gradient) and computes the global loss over all rows gets
:math:`\partial L/\partial z_r` for its own embeddings only: DDP's average over ranks is then exactly
:math:`\nabla L / p`. Gathering with gradient (``torch.distributed._functional_collectives.all_gather_single``, or the
``torch.distributed.nn.functional.all_gather`` that torch 2.13 deprecates for it: the backward sums every rank's
gradient of a gathered block into its owner) restores :math:`\nabla L`, whether each rank computes all rows or
only its own.

**GradCache across ranks** (:func:`grad_cache_ddp_backward`). Rank r embeds its K micro-batches without a graph,
all-gathers every rank's embeddings (values only), and differentiates the global loss L over all p·K·b samples:
every rank gets the same :math:`G = \partial L/\partial Z` and keeps its own rows :math:`G_r`. Backpropagating
:math:`\langle z_{rk}, G_{rk}\rangle` through each re-embedded micro-batch leaves
:math:`g_r = \sum_k J_{rk}^\top G_{rk}` on rank r, and :math:`\sum_r g_r = \nabla L` (chain rule over all
rows). DDP's all-reduce divides the sum by p, so rank r backpropagates :math:`p\,G_r`; without the factor DDP
leaves exactly :math:`\nabla L / p`.

:func:`contrastive_task` runs on every rank of a ``gloo`` process group (registered in
:data:`gradaccum.book.ddp_tasks.TASKS` as ``"contrastive"``); :func:`contrastive_ddp` launches it on 2 local ranks.
Every worker imports this module: it holds nothing the workers do not need (no figures).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gradaccum._tensors import relative_error
from gradaccum._validate import require_k
from gradaccum.accumulate import flat_grad
from gradaccum.coupled import info_nce

#: The temperature of the chapter's InfoNCE (chapter 8's ``TAU``).
TAU = 0.2

#: The ways a rank computes its loss, in the order :func:`contrastive_task` runs them.
GATHERS = ("own pairs only", "all_gather, no gradient", "all_gather with gradient", "with gradient, own rows")

#: GradCache's micro-batches per rank in :func:`contrastive_task`.
GRAD_CACHE_K = 4

#: GradCache across the ranks, without and with the factor p (:func:`grad_cache_ddp_backward`'s ``scale``).
GRAD_CACHES = (f"GradCache, K = {GRAD_CACHE_K} per rank", f"GradCache, K = {GRAD_CACHE_K} per rank, × p")


def _encoder() -> nn.Module:
    """Linear(64, 64) → ReLU → Linear(64, 16), float64, the same weights on every rank and in every process."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16)).double()


def _info_nce(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return info_nce(a, b, TAU)


def _own_rows_loss(a: torch.Tensor, b_all: torch.Tensor, first: int) -> torch.Tensor:
    """InfoNCE's rows for this rank's anchors ``a`` against every rank's ``b_all``; the positives start at row
    ``first`` of ``b_all``."""
    logits = F.normalize(a, dim=1) @ F.normalize(b_all, dim=1).T / TAU
    return F.cross_entropy(logits, torch.arange(first, first + len(a)))


def _rank_loss(how: str, za: torch.Tensor, zb: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    if how == "own pairs only":
        return info_nce(za, zb, TAU)
    if how == "all_gather, no gradient":
        gathered = []
        for z in (za, zb):
            parts = [torch.empty_like(z) for _ in range(world_size)]
            dist.all_gather(parts, z.detach())
            parts[rank] = z  # only this rank's block carries a gradient
            gathered.append(torch.cat(parts))
        return info_nce(gathered[0], gathered[1], TAU)
    # torch.distributed.nn.functional.all_gather does the same; torch 2.13 deprecates it for this one
    from torch.distributed._functional_collectives import all_gather_single  # here: other tasks never need it

    world = dist.group.WORLD
    assert world is not None  # the task runs inside an initialized process group
    a_all, b_all = (all_gather_single(z, 0, world) for z in (za, zb))
    if how == "all_gather with gradient":
        return info_nce(a_all, b_all, TAU)
    return _own_rows_loss(za, b_all, rank * len(za))


def _gather(z: torch.Tensor, group: Any) -> torch.Tensor:
    """Every rank's ``z`` (the same shape on each), stacked in rank order; no gradient flows back."""
    parts = [torch.empty_like(z) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, z.contiguous(), group=group)
    return torch.cat(parts)


def grad_cache_ddp_backward(
    model: DDP,
    inputs: Sequence[torch.Tensor],
    k: int,
    loss_fn: Callable[..., torch.Tensor],
    scale: bool = True,
) -> float:
    r"""GradCache across DDP ranks: leave in ``.grad`` on every rank (after DDP's all-reduce) the gradient of
    ``loss_fn`` over the global batch (every rank's samples, in rank order), holding one micro-batch's graph at a
    time. Returns the global loss (the same on every rank).

    ``inputs``: this rank's m samples of each input (the same m on every rank, K dividing it), all embedded by the
    one shared encoder ``model``, which treats each row on its own and draws no random numbers; ``loss_fn`` takes
    each input's p·m embeddings. 1. Embed the K micro-batches without a graph (``model.module``: no DDP hooks).
    2. All-gather every rank's embeddings Z (values only), compute L(Z) and :math:`G = \partial L/\partial Z`;
    keep this rank's rows :math:`G_r`. 3. Embed each micro-batch again with a graph and backpropagate
    :math:`c\,G_{rk}`: the first K − 1 inside ``no_sync()``, the last one's forward and backward outside, so DDP
    all-reduces once. Rank r then holds :math:`c\,g_r`, :math:`g_r = \sum_k J_{rk}^\top G_{rk}`, and DDP's mean
    over the ranks is :math:`\frac{c}{p}\sum_r g_r = \frac{c}{p}\nabla L`. ``scale`` sets :math:`c = p`: exactly
    :math:`\nabla L`; ``scale=False`` (c = 1) leaves :math:`\nabla L/p`. A comm hook that sums instead of
    averaging needs ``scale=False``."""
    if not isinstance(model, DDP):
        raise ValueError(f"model must be a DistributedDataParallel module, got {type(model).__name__}; wrap it in DDP.")
    require_k(k)
    m = len(inputs[0]) if inputs else 0
    if not inputs or any(len(x) != m for x in inputs) or m == 0 or m % k:
        raise ValueError(
            f"every input needs the same number of samples on this rank, a multiple of K = {k} >= 1; got "
            f"{[len(x) for x in inputs]}."
        )
    group = model.process_group
    p, rank = dist.get_world_size(group), dist.get_rank(group)
    chunks = list(zip(*(x.chunk(k) for x in inputs)))
    with torch.no_grad():
        cached = [model.module(torch.cat(c)).split([len(x) for x in c]) for c in chunks]
    gathered = [_gather(torch.cat([z[i] for z in cached]), group).requires_grad_() for i in range(len(inputs))]
    loss = loss_fn(*gathered)
    loss.backward()
    factor = p if scale else 1
    own = [factor * z.grad[rank * m : (rank + 1) * m] for z in gathered]  # type: ignore[index]
    for j, chunk in enumerate(chunks):
        b = len(chunk[0])
        with model.no_sync() if j < k - 1 else contextlib.nullcontext():
            z = model(torch.cat(chunk))
            z.backward(torch.cat([g[j * b : (j + 1) * b] for g in own]))
    return float(loss.detach())


def contrastive_task(rank: int, world_size: int, views_a: torch.Tensor, views_b: torch.Tensor) -> dict[str, Any]:
    """On each rank: its share of the pairs (``views_a``, ``views_b``: both views of every rank's samples),
    embedded through one DDP model; for each way of :data:`GATHERS`, the gradient DDP leaves after one backward,
    and for each of :data:`GRAD_CACHES`, after :func:`grad_cache_ddp_backward` over :data:`GRAD_CACHE_K`
    micro-batches. Rank 0 adds the global batch's gradient computed in one process."""
    a, b = views_a, views_b
    m = len(a) // world_size
    rows = slice(rank * m, (rank + 1) * m)
    model = DDP(_encoder())
    out: dict[str, Any] = {}
    for how in GATHERS:
        model.zero_grad(set_to_none=True)
        za, zb = model(torch.cat([a[rows], b[rows]])).split(m)
        _rank_loss(how, za, zb, rank, world_size).backward()
        out[how] = flat_grad(model.module).detach().clone()
    for how, scale in zip(GRAD_CACHES, (False, True)):
        model.zero_grad(set_to_none=True)
        grad_cache_ddp_backward(model, (a[rows], b[rows]), GRAD_CACHE_K, _info_nce, scale)
        out[how] = flat_grad(model.module).detach().clone()
    if rank == 0:
        single = _encoder()
        info_nce(single(a), single(b), TAU).backward()
        out["global batch"] = flat_grad(single).detach()
    return out


def start_fork_server() -> bool:
    """Start the fork server that :func:`gradaccum.book.ddp_workers.launch` forks its workers from, now, and return
    at once, with ``torch._dynamo`` preloaded too (DDP's constructor imports it: a second or two in every worker
    otherwise); see :func:`gradaccum.book.ddp_workers.start_fork_server`. Returns ``False`` (and starts nothing)
    where the platform has no fork server."""
    from gradaccum.book import ddp_workers  # here: ddp_workers imports this module's task

    return ddp_workers.start_fork_server(["torch._dynamo"])


def contrastive_ddp(a: torch.Tensor, b: torch.Tensor, ranks: int = 2) -> dict[str, dict[str, float]]:
    """:func:`contrastive_task` on ``ranks`` local gloo processes: for each way of :data:`GATHERS` and
    :data:`GRAD_CACHES`, the relative error of rank 0's gradient from the global batch's, and the ratio of their
    norms. Each rank needs a multiple of :data:`GRAD_CACHE_K` pairs (GradCache's micro-batches)."""
    from gradaccum.book.ddp_workers import launch  # here: ddp_workers imports this module's task

    per_rank = GRAD_CACHE_K * ranks
    if len(a) != len(b) or len(a) % per_rank or len(a) == 0:
        raise ValueError(
            f"a and b must hold the same number of pairs, a positive multiple of {per_rank}: {ranks} ranks of "
            f"{GRAD_CACHE_K} GradCache micro-batches."
        )
    result = launch("contrastive", world_size=ranks, views_a=a.double(), views_b=b.double())[0]
    reference = result["global batch"]
    out = {}
    for how in (*GATHERS, *GRAD_CACHES):
        ratio = float(result[how].norm() / reference.norm())
        out[how] = {"error": relative_error(result[how], reference), "norm ratio": ratio}
    return out
