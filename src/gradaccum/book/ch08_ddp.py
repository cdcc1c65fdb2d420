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

:func:`contrastive_task` runs on every rank of a ``gloo`` process group (registered in
:data:`gradaccum.book.ddp_tasks.TASKS` as ``"contrastive"``); :func:`contrastive_ddp` launches it on 2 local ranks.
Every worker imports this module: it holds nothing the workers do not need (no figures).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gradaccum._tensors import relative_error
from gradaccum.accumulate import flat_grad
from gradaccum.coupled import info_nce

#: The temperature of the chapter's InfoNCE (chapter 8's ``TAU``).
TAU = 0.2

#: The ways a rank computes its loss, in the order :func:`contrastive_task` runs them.
GATHERS = ("own pairs only", "all_gather, no gradient", "all_gather with gradient", "with gradient, own rows")


def _encoder() -> nn.Module:
    """Linear(64, 64) → ReLU → Linear(64, 16), float64, the same weights on every rank and in every process."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16)).double()


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


def contrastive_task(rank: int, world_size: int, views_a: torch.Tensor, views_b: torch.Tensor) -> dict[str, Any]:
    """On each rank: its share of the pairs (``views_a``, ``views_b``: both views of every rank's samples),
    embedded through one DDP model; for each way of :data:`GATHERS`, the gradient DDP leaves after one backward.
    Rank 0 adds the global batch's gradient computed in one process."""
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
    if rank == 0:
        single = _encoder()
        info_nce(single(a), single(b), TAU).backward()
        out["global batch"] = flat_grad(single).detach()
    return out


def contrastive_ddp(a: torch.Tensor, b: torch.Tensor, ranks: int = 2) -> dict[str, dict[str, float]]:
    """:func:`contrastive_task` on ``ranks`` local gloo processes: for each way of :data:`GATHERS`, the relative
    error of rank 0's gradient from the global batch's, and the ratio of their norms."""
    from gradaccum.book.ddp_workers import launch  # here: ddp_workers imports this module's task

    if len(a) != len(b) or len(a) % ranks or len(a) < 2 * ranks:
        raise ValueError(f"a and b must hold the same number of pairs, at least 2 per rank and a multiple of {ranks}.")
    result = launch("contrastive", world_size=ranks, views_a=a.double(), views_b=b.double())[0]
    reference = result["global batch"]
    out = {}
    for how in GATHERS:
        ratio = float(result[how].norm() / reference.norm())
        out[how] = {"error": relative_error(result[how], reference), "norm ratio": ratio}
    return out
