r"""``no_sync()`` under accumulation: one all-reduce per optimizer step, what each placement of it does, the
all-reduces counted by a communication hook, and the α–β cost model (chapter 5).

DistributedDataParallel (DDP) registers hooks that fire as gradients become ready during ``backward()``; they
average gradient *buckets* across the p ranks with an all-reduce. Naive accumulation therefore all-reduces after
every micro-batch: K collectives per optimizer step. Since the all-reduce is linear,

.. math:: \frac1p\sum_r \sum_k g_{r,k} \;=\; \sum_k \frac1p\sum_r g_{r,k},

one all-reduce of the accumulated gradients gives the same result: ``with model.no_sync():`` around the forward
*and* backward of the first K−1 micro-batches skips their all-reduces, and the K-th micro-batch's forward *and*
backward run outside it. DDP decides in the *forward* pass whether the coming backward synchronizes: a forward
inside ``no_sync()`` followed by a backward outside launches no all-reduce at all, so the ranks keep different
gradients (:func:`placed_accumulate` reproduces each placement).

DDP puts every parameter into one bucket for the first iteration (``find_unused_parameters=False``) and rebuilds
the buckets, in the order the gradients became ready, after the first synchronized backward pass; from then on
each synchronized backward launches one all-reduce per bucket. Without a communication hook DDP divides by p while
copying each gradient into its bucket (``at::mul_out`` in ``reducer.cpp``), so a synchronization makes two passes
over the gradients besides the all-reduce: copy in (and divide), copy out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from gradaccum._validate import require_count, require_k, require_nonnegative, require_positive
from gradaccum.accumulate import split_batch


def ddp_accumulate(model: DDP, loss_fn: Callable, x: torch.Tensor, y: torch.Tensor, k: int, no_sync: bool) -> None:
    """One optimizer step's backward passes on this rank: K micro-batches, loss / K each. With ``no_sync`` the
    forward and backward of the first K−1 run inside ``model.no_sync()``, so only the last one all-reduces."""
    placed_accumulate(model, loss_fn, x, y, k, "no_sync" if no_sync else "sync every micro-batch")


#: Where the micro-batches' forward and backward passes sit relative to ``model.no_sync()``:
#:
#: * ``"sync every micro-batch"`` — no ``no_sync()``: K synchronizations;
#: * ``"no_sync"`` — forward and backward of micro-batches 1..K−1 inside, of micro-batch K outside: one;
#: * ``"last forward inside"`` — as ``"no_sync"``, but micro-batch K's forward also runs inside and only its
#:   backward outside: **none** (DDP prepares the reduction in the forward pass), so ranks keep their own gradients;
#: * ``"forward outside"`` — every forward outside, the backward of micro-batches 1..K−1 inside: K, as without it.
PLACEMENTS = ("sync every micro-batch", "no_sync", "last forward inside", "forward outside")


def placed_accumulate(model: DDP, loss_fn: Callable, x: torch.Tensor, y: torch.Tensor, k: int, placement: str) -> None:
    """One optimizer step's K forward/backward passes (loss / K each) with ``no_sync()`` placed as ``placement``
    says (one of :data:`PLACEMENTS`)."""
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown placement {placement!r}; choose one of {PLACEMENTS}.")
    if not isinstance(model, DDP):
        raise ValueError(f"model must be wrapped in DistributedDataParallel, got {type(model).__name__}.")
    for i, (xb, yb) in enumerate(split_batch(x, y, k)):
        last = i == k - 1
        if placement == "sync every micro-batch" or (last and placement != "last forward inside"):
            (loss_fn(model(xb), yb) / k).backward()
        elif placement == "forward outside":
            loss = loss_fn(model(xb), yb) / k
            with model.no_sync():
                loss.backward()
        elif last:  # "last forward inside": the forward in the context, its backward after it
            with model.no_sync():
                loss = loss_fn(model(xb), yb) / k
            loss.backward()
        else:
            with model.no_sync():
                (loss_fn(model(xb), yb) / k).backward()


@dataclass
class CommCounter:
    """State of :func:`counting_hook`: all-reduce calls and bytes sent into them, and the process group to average
    over — the DDP model's own (``model.process_group``; :func:`register_counter` sets it). None is the default
    (world) group, right only for a DDP model built on it: a model on a subgroup would be averaged with ranks of
    other replicas."""

    calls: int = 0
    bytes: int = 0
    process_group: Any = None


def counting_hook(state: CommCounter, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook that counts, then does what DDP does by default: average by all-reduce over
    ``state.process_group``."""

    state.calls += 1
    state.bytes += bucket.buffer().numel() * bucket.buffer().element_size()
    return default_hooks.allreduce_hook(state.process_group, bucket)


def register_counter(model: nn.Module) -> CommCounter:
    """Register :func:`counting_hook` on a DDP model, with a :class:`CommCounter` that averages over the model's own
    process group; returns the counter."""
    if not isinstance(model, DDP):
        raise ValueError(
            f"register_counter needs a DistributedDataParallel model, got {type(model).__name__}; wrap it in DDP first."
        )
    counter = CommCounter(process_group=model.process_group)
    model.register_comm_hook(counter, counting_hook)
    return counter


def micro_batch_that_fits(n_images: int, world_size: int, k: int, steps: int, cap: int = 8) -> int:
    r"""The largest micro-batch size :math:`b \le` ``cap`` for which every rank gets its own
    :math:`K b \cdot \text{steps}` images: :math:`b = \min(\text{cap}, \lfloor n / (p K \cdot \text{steps})\rfloor)`.

    Raises ValueError when not even b = 1 fits (then fewer steps or a smaller K is needed).
    """
    require_k(k)
    for name, value in (("n_images", n_images), ("world_size", world_size), ("steps", steps), ("cap", cap)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}.")
    b = min(cap, n_images // (world_size * k * steps))
    if b < 1:
        raise ValueError(
            f"{world_size} ranks × K={k} × {steps} steps need more than the {n_images} images even "
            + (
                f"with micro-batches of 1; use at most {n_images // (world_size * k)} steps or a smaller K."
                if n_images >= world_size * k
                else f"with micro-batches of 1; even one step needs {world_size * k} images: use a smaller K "
                "or fewer ranks."
            )
        )
    return b


@dataclass(frozen=True)
class Interconnect:
    """Per-direction bandwidth (bytes/s) and per-message latency (s) of one link, for the α–β model."""

    name: str
    bandwidth: float
    latency: float
    source: str

    def __post_init__(self) -> None:  # Python floats, so that no NumPy scalar reaches the predictions
        object.__setattr__(self, "bandwidth", require_positive(self.bandwidth, "an Interconnect's bandwidth (bytes/s)"))
        object.__setattr__(self, "latency", require_nonnegative(self.latency, "an Interconnect's latency (s)"))


def _require_link(link: object) -> None:
    if not isinstance(link, Interconnect):
        raise ValueError(
            f"link must be an Interconnect (one of distributed.PRESETS, or Interconnect(name, "
            f"bandwidth, latency, source)), got {type(link).__name__}."
        )


#: Nominal per-direction link rates from the standards and datasheets cited in the chapter; the latencies are
#: order-of-magnitude assumptions, not measurements.
PRESETS: dict[str, Interconnect] = {
    "NVLink 4 (H100)": Interconnect("NVLink 4 (H100)", 450e9, 5e-6, "nvidia_h100"),
    "PCIe 4.0 x16": Interconnect("PCIe 4.0 x16", 31.5e9, 10e-6, "pcie4"),
    "InfiniBand NDR 400 Gb/s": Interconnect("InfiniBand NDR 400 Gb/s", 50e9, 5e-6, "infiniband_ndr"),
    "Ethernet 100 Gb/s": Interconnect("Ethernet 100 Gb/s", 12.5e9, 20e-6, "ethernet100g"),
    "Ethernet 10 Gb/s": Interconnect("Ethernet 10 Gb/s", 1.25e9, 50e-6, "ethernet100g"),
}


def ring_allreduce_time(n_bytes: float, p: int, link: Interconnect) -> float:
    r"""Ring all-reduce of ``n_bytes`` over p ranks: :math:`2(p-1)\alpha + \frac{2(p-1)}{p}\frac{n}{\beta}`.

    Each rank sends and receives :math:`\frac{2(p-1)}{p}n` bytes (a reduce-scatter then an all-gather, p − 1
    rounds each, a 1/p chunk per round).
    """
    if isinstance(p, bool) or not isinstance(p, int) or p < 1:
        raise ValueError(f"p is a number of ranks: an int >= 1, got {p!r}; round it to a whole number of ranks.")
    require_nonnegative(n_bytes, "n_bytes")
    _require_link(link)
    if p == 1:
        return 0.0
    return 2 * (p - 1) * link.latency + 2 * (p - 1) / p * n_bytes / link.bandwidth


@dataclass(frozen=True)
class StepPrediction:
    """Predicted time per optimizer step with and without no_sync (no overlap of communication and compute)."""

    compute: float
    allreduce: float
    with_sync: float
    with_no_sync: float

    @property
    def saving(self) -> float:
        return self.with_sync - self.with_no_sync


def predict_step(
    params: int,
    k: int,
    p: int,
    link: Interconnect,
    micro_compute: float,
    bytes_per_param: int = 4,
    buckets: int = 1,
    copy_bandwidth: float | None = None,
    copy_passes: int = 2,
) -> StepPrediction:
    """α–β prediction of one optimizer step: K micro-batches of ``micro_compute`` seconds each, plus K (naive)
    or 1 (no_sync) synchronizations of all gradients, split into ``buckets`` messages.

    A synchronization is the ring all-reduce plus, if ``copy_bandwidth`` (bytes/s) is given, ``copy_passes``
    passes over the gradients: 2 for DDP without a communication hook (copy into the bucket with the division
    by p fused into it, copy back), 3 with the default all-reduce hook registered (it divides in a pass of its
    own). Communication is assumed not to overlap with compute, so this is an upper bound on the saving when it
    does.
    """
    require_k(k)
    _require_link(link)
    require_count(params, "params (the number of parameters)")
    require_count(buckets, "buckets")
    require_count(bytes_per_param, "bytes_per_param")
    require_count(copy_passes, "copy_passes", minimum=0)
    if buckets > params:
        raise ValueError(
            f"{buckets} buckets for {params} parameters: a bucket holds at least one parameter; use at "
            f"most {params} buckets."
        )
    require_nonnegative(micro_compute, "micro_compute (s)")
    if copy_bandwidth is not None:
        require_positive(copy_bandwidth, "copy_bandwidth (bytes/s)")
    n_bytes = params * bytes_per_param
    one = buckets * ring_allreduce_time(n_bytes / buckets, p, link)
    if copy_bandwidth is not None and p > 1:
        one += copy_passes * n_bytes / copy_bandwidth
    compute = k * micro_compute
    return StepPrediction(compute, one, compute + k * one, compute + one)
