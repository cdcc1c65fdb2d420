r"""Chapter 8's mixture-of-experts measurements on the gradient: a linear router over tokens that come in documents.

Tokens are ``dim``-dimensional: each document draws a topic (:math:`\mathcal N(0, s^2)` per feature) and each of
its tokens is the topic plus :math:`\mathcal N(0, 1)` noise, so a document prefers some experts; at :math:`s = 0`
the tokens are i.i.d. A window of such documents is cut into micro-batches three ways (:data:`LAYOUTS`): the
documents' tokens shuffled (i.i.d. micro-batches), a few whole documents per micro-batch (as in LLM training), or
one document per micro-batch. Everything is float64 and drawn from its own seeded generators, so the numbers do
not depend on the CPU's kernels or on any process-wide random state.

Measured here: the Switch load-balancing loss per micro-batch against the window's (:func:`balancing_error`, on
the loss and on its gradient), a router with dropout whose counting pass is not replayed
(:func:`dropout_reroute`), the router z-loss over micro-batches of unequal sizes (:func:`z_loss_error`), the
loss-free balancing bias updated from part of the window (:func:`bias_update_signs`), and the tokens a capacity
factor drops per micro-batch (:func:`dropped_share`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from gradaccum import load_balancing as lb
from gradaccum._tensors import relative_error
from gradaccum._validate import require_count, require_k

EXPERTS, DIM, DOC_LEN, DOCS = 8, 32, 512, 16

#: How a window of :data:`DOCS` documents becomes micro-batches: (label, shuffled tokens?, K).
LAYOUTS: tuple[tuple[str, bool, int], ...] = (
    ("i.i.d., 2,048 tokens", True, 4),
    ("i.i.d., 512 tokens", True, 16),
    ("4 documents, 2,048 tokens", False, 4),
    ("1 document, 512 tokens", False, 16),
)


def document_tokens(strength: float, seed: int, docs: int = DOCS, doc_len: int = DOC_LEN) -> torch.Tensor:
    """``docs`` documents of ``doc_len`` tokens, one after the other: each token is its document's topic
    (N(0, strength²) per feature) plus N(0, 1) noise; float64, from a generator seeded with ``seed``."""
    require_count(docs, "docs")
    require_count(doc_len, "doc_len")
    if not strength >= 0:
        raise ValueError(f"strength must be >= 0 (0: i.i.d. tokens), got {strength!r}.")
    g = torch.Generator().manual_seed(seed)
    topics = torch.randn(docs, DIM, generator=g, dtype=torch.float64) * strength
    noise = torch.randn(docs * doc_len, DIM, generator=g, dtype=torch.float64)
    return topics.repeat_interleave(doc_len, 0) + noise


def router_weights(seed: int) -> torch.Tensor:
    """An untrained linear router's weights (experts × dim, float64, requiring a gradient), scaled so that its
    logits have unit variance on unit-variance tokens."""
    g = torch.Generator().manual_seed(10_000 + seed)
    return (torch.randn(EXPERTS, DIM, generator=g, dtype=torch.float64) / math.sqrt(DIM)).requires_grad_()


def micro_batches(x: torch.Tensor, shuffled: bool, k: int, seed: int = 0) -> list[torch.Tensor]:
    """The window ``x`` cut into ``k`` equal micro-batches, in document order or with its tokens shuffled."""
    require_k(k)
    if len(x) % k:
        raise ValueError(f"K = {k} does not divide the window's {len(x)} tokens; pick a K that divides it.")
    if shuffled:
        x = x[torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))]
    return list(x.chunk(k))


def balancing_error(micro: Sequence[torch.Tensor], w: torch.Tensor) -> tuple[float, float]:
    """Per-micro-batch balancing against the window's, for a router with weights ``w`` over equal micro-batches:
    (the mean of the micro-batches' losses over the window's loss, minus 1; the relative error of its gradient
    with respect to ``w``). The window's loss is each micro-batch's with the window's fractions, averaged."""
    f = lb.window_fractions(lambda t: t @ w.T, micro, EXPERTS)
    k = len(micro)
    window = per_micro = torch.zeros((), dtype=torch.float64)
    for x in micro:
        probs = (x @ w.T).softmax(1)
        window = window + lb.switch_aux_loss(probs, f) / k
        per_micro = per_micro + lb.switch_aux_loss(probs) / k
    g_window, g_micro = (torch.autograd.grad(loss, w, retain_graph=True)[0] for loss in (window, per_micro))
    return float(per_micro.detach() / window.detach()) - 1, relative_error(g_micro, g_window)


def moe_gradient_study(
    strengths: Iterable[float] = (0.1, 0.2, 0.3), seeds: Iterable[int] = range(5)
) -> dict[tuple[str, float, int], tuple[float, float]]:
    """:func:`balancing_error` for every layout of :data:`LAYOUTS`, document strength and seed:
    ``{(layout, strength, seed): (loss drift, gradient error)}``."""
    out = {}
    for s in strengths:
        for seed in seeds:
            x, w = document_tokens(s, seed), router_weights(seed)
            for label, shuffled, k in LAYOUTS:
                out[label, s, seed] = balancing_error(micro_batches(x, shuffled, k, seed), w)
    return out


def favourite_share(strength: float, seed: int, shuffled: bool = False) -> float:
    """The mean share of a document's tokens (or of a random group of as many) that the router sends to that
    group's most used expert."""
    x = document_tokens(strength, seed)
    if shuffled:
        x = x[torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))]
    with torch.no_grad():
        chosen = (x @ router_weights(seed).T).argmax(1).reshape(DOCS, DOC_LEN)
    counts = torch.stack([torch.bincount(row, minlength=EXPERTS) for row in chosen])
    return float(counts.max(1).values.double().mean()) / DOC_LEN


def dropout_reroute(p: float = 0.1, strength: float = 0.2, seed: int = 0) -> dict[str, float]:
    """A router with dropout ``p`` on its input, over the window of 4-document micro-batches: the share of tokens
    the training pass sends to another expert than the counting pass did, when the training pass draws fresh
    masks and when it replays the counting pass's random state; and the L1 distance between the counted
    fractions and those of the fresh pass. The process's random state is left as it was."""
    x = document_tokens(strength, seed)
    micro = micro_batches(x, False, 4)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        router = nn.Sequential(nn.Dropout(p), nn.Linear(DIM, EXPERTS, dtype=torch.float64)).train()
        counted: list[torch.Tensor] = []

        def counting(t: torch.Tensor) -> torch.Tensor:
            scores = router(t)
            counted.append(scores.argmax(1))
            return scores

        window = lb.count_window(counting, micro, EXPERTS)
        fresh = [router(m).argmax(1) for m in micro]  # the training pass, masks drawn anew
        replayed = []
        for k, m in enumerate(micro):
            with window.replay(k):
                replayed.append(router(m).argmax(1))
    before, after, again = torch.cat(counted), torch.cat(fresh), torch.cat(replayed)
    return {
        "fresh masks": float((before != after).double().mean()),
        "replayed": float((before != again).double().mean()),
        "fractions L1, fresh": float((lb.expert_fractions(after, EXPERTS) - window.fractions).abs().sum()),
    }


def z_loss_error(sizes: Sequence[int] = (1200, 500, 300, 48), seed: int = 0) -> dict[str, float]:
    """The router z-loss's gradient over micro-batches of unequal ``sizes`` (documents packed without padding),
    against the window's: each micro-batch's own mean averaged over K, and each micro-batch's sum divided by the
    window's token count (:func:`gradaccum.load_balancing.router_z_loss` with ``tokens``)."""
    x = document_tokens(0.2, seed, docs=1, doc_len=sum(sizes))
    w = router_weights(seed)
    micro = list(x.split(list(sizes)))
    reference = torch.autograd.grad(lb.router_z_loss(x @ w.T), w)[0]
    means = torch.stack([lb.router_z_loss(m @ w.T) for m in micro]).mean()
    window = torch.stack([lb.router_z_loss(m @ w.T, tokens=len(x)) for m in micro]).sum()
    return {
        "mean of micro-batch means": relative_error(torch.autograd.grad(means, w)[0], reference),
        "divided by the window's tokens": relative_error(torch.autograd.grad(window, w)[0], reference),
    }


def _loads(micro: Sequence[torch.Tensor], w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Each micro-batch's token count per expert (top-1 of the logits plus ``bias``), one row per micro-batch."""
    with torch.no_grad():
        b = torch.zeros(EXPERTS, dtype=torch.float64) if bias is None else bias
        return torch.stack([torch.bincount((m @ w.T + b).argmax(1), minlength=EXPERTS) for m in micro]).double()


def bias_update_signs(
    seed: int = 0, steps: int = 60, rate: float = 0.01, ranks: int = 2, strength: float = 0.2
) -> dict[str, float]:
    r"""Loss-free balancing: a bias :math:`b` added to the router's logits for the choice of expert only, updated
    after every step by :math:`b_i \mathrel{+}= \gamma\,\mathrm{sign}(\bar c - c_i)` from the window's expert
    counts :math:`c` (``ranks`` ranks × 4 micro-batches of 4 documents of 128 tokens, a fresh window each step).
    Returned: over the second half of the ``steps``, the mean share of the experts whose update would have the
    other sign with the counts of the last micro-batch on one rank, or of one rank's window."""
    require_count(steps, "steps", minimum=2)
    w, bias = router_weights(seed), torch.zeros(EXPERTS, dtype=torch.float64)
    seen: dict[str, list[float]] = {"last micro-batch": [], "one rank's window": []}

    def sign(c: torch.Tensor) -> torch.Tensor:
        return torch.sign(c.mean() - c)

    for step in range(steps):
        x = document_tokens(strength, 1000 * seed + step, docs=4 * 4 * ranks, doc_len=128)
        loads = _loads(list(x.chunk(4 * ranks)), w, bias)
        full = sign(loads.sum(0))
        if step >= steps // 2:
            seen["last micro-batch"].append(float((sign(loads[3]) != full).double().mean()))
            seen["one rank's window"].append(float((sign(loads[:4].sum(0)) != full).double().mean()))
        bias += rate * full
    return {name: sum(v) / len(v) for name, v in seen.items()}


def dropped_share(micro: Sequence[torch.Tensor], w: torch.Tensor, capacity_factor: float = 1.25) -> float:
    """The share of tokens dropped when each expert takes at most ⌈capacity_factor · n / N⌉ of a micro-batch's n
    tokens (top-1 routing, DeepSpeed's capacity), over all micro-batches."""
    if not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be positive, got {capacity_factor!r}.")
    dropped = 0.0
    for m, c in zip(micro, _loads(micro, w)):
        capacity = math.ceil(capacity_factor * len(m) / EXPERTS)
        dropped += float((c - capacity).clamp(min=0).sum())
    return dropped / sum(len(m) for m in micro)


def capacity_study(strength: float = 0.2, seeds: Iterable[int] = range(5)) -> dict[str, list[float]]:
    """:func:`dropped_share` at a capacity factor of 1.25 for the window as one batch and for each layout of
    :data:`LAYOUTS`, per seed."""
    out: dict[str, list[float]] = {"the window, 8,192 tokens": [], **{label: [] for label, _, _ in LAYOUTS}}
    for seed in seeds:
        x, w = document_tokens(strength, seed), router_weights(seed)
        out["the window, 8,192 tokens"].append(dropped_share([x], w))
        for label, shuffled, k in LAYOUTS:
            out[label].append(dropped_share(micro_batches(x, shuffled, k, seed), w))
    return out
