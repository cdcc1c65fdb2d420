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

A router with dropout (or any randomness) before it routes the counting pass and the training pass differently
unless the training pass replays the random state the counting pass started from: :func:`count_window` saves it,
:meth:`CountedWindow.replay` restores it. The router z-loss (:func:`router_z_loss`) is a mean over tokens, so over a
window it is divided by the window's token count, like a token-mean loss.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

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


#: A saved random state: the CPU generator's, and each CUDA device's.
RngState = tuple[torch.Tensor, tuple[torch.Tensor, ...]]


def _rng_state() -> RngState:
    devices = range(torch.cuda.device_count()) if torch.cuda.is_available() else range(0)
    cuda = tuple(torch.cuda.get_rng_state(d) for d in devices)
    return torch.get_rng_state(), cuda


@dataclass(frozen=True)
class CountedWindow:
    """A window's routing counted without a graph: the fractions :math:`f` (top-1), and the random state each
    micro-batch's counting pass started from (CPU and every CUDA device)."""

    fractions: torch.Tensor
    rng_states: tuple[RngState, ...]

    @contextlib.contextmanager
    def replay(self, k: int) -> Iterator[None]:
        """Run micro-batch ``k``'s training forward inside this block: it draws the random numbers (dropout masks)
        its counting pass drew, so it routes every token as counted. The random state outside is left as it was."""
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < len(self.rng_states):
            raise ValueError(f"k must be a micro-batch index in [0, {len(self.rng_states)}), got {k!r}.")
        cpu, cuda = self.rng_states[k]
        with torch.random.fork_rng(devices=list(range(len(cuda)))):
            torch.set_rng_state(cpu)
            for device, state in enumerate(cuda):
                torch.cuda.set_rng_state(state, device)
            yield


def count_window(
    router: Callable[[torch.Tensor], torch.Tensor], micro_batches: Sequence[torch.Tensor], n_experts: int
) -> CountedWindow:
    """:math:`f` over a whole window, as :func:`window_fractions`, with the random state saved before each
    micro-batch's pass: replay it (:meth:`CountedWindow.replay`) around that micro-batch's training forward when
    anything random (dropout) runs before the router, or the counted routing is not the trained one."""
    require_count(n_experts, "n_experts")
    if len(micro_batches) == 0:
        raise ValueError("no micro-batches: pass the window's K micro-batches.")
    for x in micro_batches:
        require_tensor(x, "each micro-batch")
    states, scores = [], []
    with torch.no_grad():
        for x in micro_batches:
            states.append(_rng_state())
            scores.append(router(x))
    _require_scores(scores, n_experts)
    return CountedWindow(expert_fractions(torch.cat([sc.argmax(1) for sc in scores]), n_experts), tuple(states))


def window_fractions(
    router: Callable[[torch.Tensor], torch.Tensor], micro_batches: Sequence[torch.Tensor], n_experts: int
) -> torch.Tensor:
    """:math:`f` over a whole window: route every micro-batch without a graph and count (top-1, the argmax; under
    data parallelism, all-reduce the counts and keep each rank's :math:`P` local). With it,
    :func:`switch_aux_loss` per micro-batch, weighted :math:`n_k/T` (its share of the window's tokens, 1/K for
    equal micro-batches), sums to the window's loss exactly. In a deep MoE the routers' inputs come from the
    layers before them: counting the window then costs a forward pass without a graph. With dropout before the
    router, use :func:`count_window` and replay its random states."""
    return count_window(router, micro_batches, n_experts).fractions


def _require_scores(scores: list, n_experts: int) -> None:
    """Refuse router outputs that are not finite (tokens, n_experts) tensors."""
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


def router_z_loss(logits: torch.Tensor, tokens: int | None = None) -> torch.Tensor:
    r"""ST-MoE's router z-loss :math:`\frac1T \sum_t \big(\log \sum_i e^{z_{ti}}\big)^2`: the squared log-sum-exp of
    each token's router ``logits`` (tokens × N), summed over this micro-batch and divided by ``tokens``. Pass the
    window's token count (every micro-batch's), and the micro-batches' z-losses add up to the window's, whatever
    their sizes; the default, this micro-batch's count, gives its own mean, which averaged over micro-batches of
    unequal sizes weighs their tokens unequally. Under DDP, which averages the ranks' gradients, divide by the
    window's tokens over all ranks and multiply by the number of ranks."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.shape[0] == 0:
        raise ValueError(
            f"logits must be a (tokens, experts) tensor with at least one token, got "
            f"{tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__}."
        )
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating-point router logits, got {logits.dtype}.")
    count = logits.shape[0] if tokens is None else require_count(tokens, "tokens")
    if count < logits.shape[0]:
        raise ValueError(
            f"tokens = {count} is fewer than this micro-batch's {logits.shape[0]}: pass the window's token count "
            "(all its micro-batches), or nothing for this micro-batch's mean."
        )
    return torch.logsumexp(logits, dim=1).square().sum() / count
