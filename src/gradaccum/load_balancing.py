r"""Mixture-of-experts load balancing under accumulation (chapter 8): the Switch Transformer's auxiliary loss over a
window of micro-batches.

Over T tokens routed among N experts the loss is :math:`N \sum_i f_i P_i`, with :math:`f_i` the fraction of
tokens sent to expert i (argmax, no gradient) and :math:`P_i` the mean router probability of expert i. A mean of
per-micro-batch products is not the product of the window's means:
:math:`\frac1K \sum_k \sum_i f_i^{(k)} P_i^{(k)} \neq \sum_i f_i P_i`. Because :math:`f` carries no gradient, the
window's loss is recovered exactly by counting the window's routing first and giving every micro-batch the
*window's* :math:`f` (:func:`switch_aux_loss` with ``fractions=``).

Under data parallelism the counts behind :math:`f` are all-reduced across ranks, while each rank's :math:`P` stays
the mean over its own tokens. :mod:`gradaccum.coupled` re-exports these functions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from gradaccum._validate import require_count, require_tensor


def expert_fractions(expert: torch.Tensor, n_experts: int) -> torch.Tensor:
    """:math:`f_i`: the fraction of tokens routed to each expert (``expert``: the chosen expert per token). With
    top-k routing (``expert`` of shape (T, k)) the fractions sum to 1, divided by T·k as Megatron-LM does;
    Hugging Face's Mixtral loss divides by T, so its fractions sum to k and its loss is k times larger."""
    require_count(n_experts, "n_experts")
    if not isinstance(expert, torch.Tensor):
        raise ValueError(f"expert must be a tensor of expert indices (torch.tensor(...)), got {type(expert).__name__}.")
    if expert.numel() == 0:
        raise ValueError("no tokens: the fractions are undefined.")
    if (
        expert.is_floating_point()
        or expert.is_complex()
        or expert.dtype == torch.bool
        or int(expert.min()) < 0
        or int(expert.max()) >= n_experts
    ):
        raise ValueError(
            f"expert must hold integer expert indices in [0, {n_experts}), got dtype {expert.dtype}, "
            f"values from {expert.min().item()} to {expert.max().item()}."
        )
    return torch.bincount(expert.reshape(-1), minlength=n_experts).to(torch.float64) / expert.numel()


def switch_aux_loss(probs: torch.Tensor, fractions: torch.Tensor | None = None) -> torch.Tensor:
    r"""The Switch Transformer's load-balancing loss :math:`N \sum_i f_i P_i` for router probabilities ``probs``
    (tokens × N). :math:`f` is computed from the argmax of ``probs`` unless ``fractions`` (e.g. a window's,
    :func:`window_fractions`) is given; :math:`P_i` is the mean of ``probs`` over these tokens."""
    if not isinstance(probs, torch.Tensor) or probs.dim() != 2 or probs.shape[0] == 0:
        raise ValueError(
            f"probs must be a (tokens, experts) tensor with at least one token, got "
            f"{tuple(probs.shape) if isinstance(probs, torch.Tensor) else type(probs).__name__}."
        )
    if not probs.is_floating_point():
        raise ValueError(f"probs must be floating-point router probabilities (a softmax), got {probs.dtype}.")
    sums = probs.detach().to(torch.float64).sum(1)
    slack = max(1e-4, torch.finfo(probs.dtype).eps)  # a bf16 softmax's rows sum to 1 within about 2^-8
    off = float((sums - 1).abs().max())
    if bool((probs.detach() < 0).any()) or not off <= slack:
        raise ValueError(
            f"each row of probs must be a probability distribution (non-negative, summing to 1; a row "
            f"here is off by {off:.3g}, more than {probs.dtype}'s rounding allows): pass the router's "
            "softmax, not its logits."
        )
    n = probs.shape[1]
    f = expert_fractions(probs.argmax(1), n) if fractions is None else fractions
    if not isinstance(f, torch.Tensor) or f.shape != (n,):
        raise ValueError(
            f"fractions must be a tensor with one entry per expert ({n}), got "
            f"{tuple(f.shape) if isinstance(f, torch.Tensor) else type(f).__name__}."
        )
    total = float(f.sum())
    if (
        not f.is_floating_point()
        or not bool(torch.isfinite(f).all())
        or bool((f < 0).any())
        or not abs(total - 1) <= 1e-6
    ):
        raise ValueError(
            f"fractions must be non-negative floats summing to 1 (for top-k routing, divide the counts "
            f"by tokens × k, as expert_fractions does), got a sum of {total:g}."
        )
    return n * (f.to(probs.dtype) * probs.mean(0)).sum()


def window_fractions(
    router: Callable[[torch.Tensor], torch.Tensor], micro_batches: Sequence[torch.Tensor], n_experts: int
) -> torch.Tensor:
    """:math:`f` over a whole window: route every micro-batch without a graph and count (top-1, the argmax; under
    data parallelism, all-reduce the counts and keep each rank's :math:`P` local). With it,
    :func:`switch_aux_loss` per micro-batch, weighted :math:`n_k/T` (its share of the window's tokens, 1/K for
    equal micro-batches), sums to the window's loss exactly. In a deep MoE the routers' inputs come from the
    layers before them: counting the window then costs a forward pass without a graph."""
    require_count(n_experts, "n_experts")
    if len(micro_batches) == 0:
        raise ValueError("no micro-batches: pass the window's K micro-batches.")
    for x in micro_batches:
        require_tensor(x, "each micro-batch")
    with torch.no_grad():
        scores = [router(x) for x in micro_batches]
    if not all(isinstance(sc, torch.Tensor) for sc in scores):
        raise ValueError(
            "the router must return a tensor of scores, (tokens, n_experts); got "
            f"{sorted({type(sc).__name__ for sc in scores})} (NumPy micro-batches: convert them with "
            "torch.as_tensor(...))."
        )
    if any(not bool(torch.isfinite(sc).all()) for sc in scores):
        raise ValueError(
            "the router's scores contain inf or NaN: an argmax over them would send those tokens to "
            "expert 0; fix the router first."
        )
    if any(sc.dim() != 2 or sc.shape[1] != n_experts for sc in scores):
        raise ValueError(
            f"the router must give (tokens, {n_experts}) scores, one column per expert; got shapes "
            f"{sorted({tuple(sc.shape) for sc in scores})}."
        )
    return expert_fractions(torch.cat([sc.argmax(1) for sc in scores]), n_experts)
