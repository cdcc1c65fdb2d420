"""Chapter 8, "Beyond BatchNorm": contrastive training on the digits, the costs of GradCache, the load-balancing
loss of a small router, checkpointing with BatchNorm, and the figures.

The book layer over :mod:`gradaccum.coupled` (the torch-only tools the chapter derives).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from gradaccum import coupled
from gradaccum._validate import require_k
from gradaccum.accumulate import flat_grad
from gradaccum.book.plotting import PALETTE, decorate, figure, heatmap
from gradaccum.timing import interleaved_medians

#: Temperature of the chapter's InfoNCE loss.
TAU = 0.2


def flat_digits(x: torch.Tensor) -> torch.Tensor:
    """The 8×8 digits as 64 features (float64)."""
    return x.reshape(len(x), -1).double()


def views(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """One augmented view of each digit: shifted by up to one pixel in each direction and with a random quarter of
    its pixels set to 0 (the randomness comes from ``g`` only)."""
    n = len(x)
    img = x.reshape(n, 8, 8)
    dy, dx = torch.randint(-1, 2, (n,), generator=g), torch.randint(-1, 2, (n,), generator=g)
    shifted = torch.stack([torch.roll(img[i], (int(dy[i]), int(dx[i])), (0, 1)) for i in range(n)])
    keep = (torch.rand(n, 64, generator=g, dtype=x.dtype) > 0.25).to(x.dtype)
    return shifted.reshape(n, -1) * keep


def encoder(seed: int = 0, hidden: int = 64) -> nn.Sequential:
    """Linear(64, hidden) → ReLU → Linear(hidden, 16), float64; the weights depend only on ``seed``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 16)).double()


def loss(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The chapter's InfoNCE (temperature :data:`TAU`)."""
    return coupled.info_nce(a, b, TAU)


def accumulation_error(x: torch.Tensor, k: int, b: int, seed: int = 0) -> tuple[float, float]:
    """Relative error against the full batch of ``k · b`` digits (two views each, a shared encoder) of plain
    accumulation and of GradCache, for one step."""
    require_k(k)
    g = torch.Generator().manual_seed(seed)
    xs = flat_digits(x[: k * b])
    xa, xb = views(xs, g), views(xs, g)
    full, plain, cache = encoder(seed), encoder(seed), encoder(seed)
    loss(full(xa), full(xb)).backward()
    coupled.plain_accumulation_backward([plain, plain], [xa, xb], k, loss)
    coupled.grad_cache_backward([cache, cache], [xa, xb], k, loss)
    ref = flat_grad(full)
    return (float((flat_grad(plain) - ref).norm() / ref.norm()), float((flat_grad(cache) - ref).norm() / ref.norm()))


@dataclass
class Costs:
    """Seconds per step (interleaved medians) and the peak bytes of tensors saved for backward."""

    seconds: dict[str, float]
    saved_bytes: dict[str, int]


class _Held:
    """A tensor saved for backward, counted while the graph holds it."""

    __slots__ = ("t", "n", "live")

    def __init__(self, t: torch.Tensor, live: list[int]):
        self.t, self.n, self.live = t, t.numel() * t.element_size(), live
        live[0] += self.n
        live[1] = max(live[1], live[0])

    def __del__(self) -> None:
        self.live[0] -= self.n


def peak_saved_bytes(fn) -> int:  # noqa: ANN001
    """The largest number of bytes that tensors saved for backward occupy at once while ``fn`` runs (a graph's
    saved tensors are released when its backward is done)."""
    live = [0, 0]
    with torch.autograd.graph.saved_tensors_hooks(lambda t: _Held(t, live), lambda h: h.t):
        fn()
    return live[1]


def step_costs(x: torch.Tensor, k: int, b: int, hidden: int = 2048, repeat: int = 5) -> Costs:
    """Time and graph memory of one step of the full batch, plain accumulation and GradCache (``k`` micro-batches
    of ``b`` digits, two views) with an encoder of ``hidden`` units. Graph memory: :func:`peak_saved_bytes`
    (GradCache also keeps the window's embeddings and their gradient, 2 · k · b · 16 numbers each, outside any
    graph)."""
    g = torch.Generator().manual_seed(0)
    xs = flat_digits(x[: k * b])
    xa, xb = views(xs, g), views(xs, g)
    enc = encoder(0, hidden)

    def full() -> None:
        enc.zero_grad()
        loss(enc(xa), enc(xb)).backward()

    def plain() -> None:
        enc.zero_grad()
        coupled.plain_accumulation_backward([enc, enc], [xa, xb], k, loss)

    def cache() -> None:
        enc.zero_grad()
        coupled.grad_cache_backward([enc, enc], [xa, xb], k, loss)

    fns: dict[str, Callable[[], object]] = {"full batch": full, "plain accumulation": plain, "GradCache": cache}
    seconds = interleaved_medians(fns, repeat=repeat)
    return Costs(seconds, {name: peak_saved_bytes(fn) for name, fn in fns.items()})


def few_label_accuracy(enc: nn.Module, x_train: torch.Tensor, y_train: torch.Tensor, x_val: torch.Tensor,
                       y_val: torch.Tensor, per_class: int = 3) -> float:
    """Validation accuracy of nearest class centroid (cosine) in the embedding, the centroids from the first
    ``per_class`` training digits of each class: how well the embedding separates the classes with few labels."""
    labelled = torch.cat([torch.nonzero(y_train == c)[:per_class, 0] for c in range(10)])
    with torch.no_grad():
        a = F.normalize(enc(flat_digits(x_train[labelled])), dim=1)
        v = F.normalize(enc(flat_digits(x_val)), dim=1)
    centroids = F.normalize(torch.stack([a[y_train[labelled] == c].mean(0) for c in range(10)]), dim=1)
    return float(((v @ centroids.T).argmax(1) == y_val).double().mean())


def train_contrastive(method: str, x: torch.Tensor, k: int, b: int, seed: int, schedule: str, epochs: int = 4,
                      lr: float = 0.05) -> nn.Module:
    """Contrastive training of :func:`encoder` on the training digits: SGD with momentum 0.9, batches of
    ``k · b`` digits (two views each), ``"full"`` batch or ``"plain"`` accumulation of ``k`` micro-batches,
    learning rate constant or cosine-decayed to 0."""
    if method not in ("full", "plain", "gradcache"):
        raise ValueError(f"method must be 'full', 'plain' or 'gradcache', got {method!r}.")
    if schedule not in ("constant", "cosine"):
        raise ValueError(f"schedule must be 'constant' or 'cosine', got {schedule!r}.")
    enc = encoder(seed)
    opt = torch.optim.SGD(enc.parameters(), lr=lr, momentum=0.9)
    g = torch.Generator().manual_seed(seed)
    xs, n = flat_digits(x), k * b
    per_epoch = len(xs) // n
    total, step = epochs * per_epoch, 0
    for _ in range(epochs):
        order = torch.randperm(len(xs), generator=g)
        for i in range(per_epoch):
            batch = xs[order[i * n:(i + 1) * n]]
            xa, xb = views(batch, g), views(batch, g)
            factor = (1 + math.cos(math.pi * step / total)) / 2 if schedule == "cosine" else 1.0
            for group in opt.param_groups:
                group["lr"] = lr * factor
            opt.zero_grad()
            if method == "full":
                loss(enc(xa), enc(xb)).backward()
            elif method == "plain":
                coupled.plain_accumulation_backward([enc, enc], [xa, xb], k, loss)
            else:
                coupled.grad_cache_backward([enc, enc], [xa, xb], k, loss)
            opt.step()
            step += 1
    return enc


def contrastive_study(x_train: torch.Tensor, y_train: torch.Tensor, x_val: torch.Tensor, y_val: torch.Tensor,
                      settings: Sequence[tuple[int, int]] = ((16, 2), (4, 8)), seeds: Sequence[int] = (0, 1, 2),
                      schedules: Sequence[str] = ("constant", "cosine")) -> dict[tuple[int, int, int, str], dict]:
    """Few-label accuracy after training with the full batch (= GradCache) and with plain accumulation, for each
    (K, b), seed and schedule (batch K · b = 32)."""
    out = {}
    for k, b in settings:
        for seed in seeds:
            for schedule in schedules:
                out[k, b, seed, schedule] = {
                    m: few_label_accuracy(train_contrastive(m, x_train, k, b, seed, schedule), x_train, y_train,
                                          x_val, y_val) for m in ("full", "plain")}
    return out


def plot_contrastive(study: dict[tuple[int, int, int, str], dict]):
    """Accuracy of plain accumulation against the full batch, one point per run, per (K, b)."""
    fig, (ax,) = figure(1, 6.4, 3.4)
    colors = [PALETTE["vermillion"], PALETTE["blue"], PALETTE["green"]]
    for color, marker, kb in zip(colors, "os^", sorted({key[:2] for key in study})):
        pts = [(r["full"], r["plain"]) for key, r in study.items() if key[:2] == kb]
        ax.plot(*zip(*pts), marker, color=color, label=f"K = {kb[0]}, b = {kb[1]}")
    lo = min(min(r.values()) for r in study.values()) - 0.02
    hi = max(max(r.values()) for r in study.values()) + 0.02
    ax.plot([lo, hi], [lo, hi], ":", color="black", linewidth=1)
    decorate(ax, "few-label accuracy, full batch (= GradCache)", "plain accumulation",
             "Contrastive training, batch 32: one point per seed and schedule")
    return fig


def error_grid(x: torch.Tensor, ks: Sequence[int], bs: Sequence[int]) -> np.ndarray:
    """Plain accumulation's gradient error (one step) over K × b."""
    return np.array([[accumulation_error(x, k, b)[0] for b in bs] for k in ks])


def plot_error_grid(grid: np.ndarray, ks: Sequence[int], bs: Sequence[int]):
    fig, (ax,) = figure(1, 6.4, 3.6)
    image = heatmap(ax, grid, ks, bs, vmin=0.0, xlabel="micro-batch size b", ylabel="K",
                    title="InfoNCE: plain accumulation vs full batch")
    fig.colorbar(image, ax=ax, label="relative gradient error")
    return fig


def plot_error_widget(x: torch.Tensor, k: int, b: int):
    """The widget's picture: plain accumulation's and GradCache's gradient error at one K and b."""
    if b < 2:
        raise ValueError("b must be at least 2: a micro-batch of one pair has no negative at all (its InfoNCE is 0).")
    plain, cache = accumulation_error(x, k, b)
    fig, (ax,) = figure(1, 6.4, 3.0)
    ax.bar(["plain accumulation", "GradCache"], [plain, cache], color=[PALETTE["vermillion"], PALETTE["blue"]])
    decorate(ax, "", "relative gradient error", f"K = {k}, b = {b}: {b - 1} vs {k * b - 1} negatives per sample")
    return fig


# ------------------------------------------------------------------------------------------------ routing


def router(seed: int = 0, experts: int = 4) -> nn.Linear:
    """A linear router from the 64 pixels to ``experts`` experts (float64)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Linear(64, experts).double()


def aux_losses(x: torch.Tensor, ks: Sequence[int], n: int = 64, seed: int = 0) -> dict[str, list[float]]:
    """The Switch load-balancing loss of ``n`` digits: the window's, the mean of per-micro-batch losses, and the
    per-micro-batch losses with the window's fractions (the fix), for each K."""
    r = router(seed)
    xs = flat_digits(x[:n])
    probs = lambda t: r(t).softmax(1)  # noqa: E731
    with torch.no_grad():
        window = float(coupled.switch_aux_loss(probs(xs)))
        out: dict[str, list[float]] = {"window": [], "per micro-batch": [], "window fractions": []}
        for k in ks:
            micro = list(xs.chunk(k))
            f = coupled.window_fractions(probs, micro, r.out_features)
            out["window"].append(window)
            out["per micro-batch"].append(float(sum(coupled.switch_aux_loss(probs(m)) for m in micro) / k))
            out["window fractions"].append(float(sum(coupled.switch_aux_loss(probs(m), f) for m in micro) / k))
    return out


def plot_aux(ks: Sequence[int], losses: dict[str, list[float]]):
    fig, (ax,) = figure(1, 6.4, 3.2)
    styles = {"window": ("-", PALETTE["black"]), "per micro-batch": ("o-", PALETTE["vermillion"]),
              "window fractions": ("s--", PALETTE["blue"])}
    for name, values in losses.items():
        style, color = styles[name]
        ax.plot(ks, values, style, color=color, label=name)
    decorate(ax, "K (micro-batches of 64 / K digits)", "load-balancing loss", "Switch auxiliary loss, 4 experts",
             xscale="log", xticks=ks)
    return fig


# ------------------------------------------------------------------------------------ checkpointing and BN


def bn_block(seed: int = 0, momentum: float = 0.1) -> nn.Sequential:
    """Linear(64, 16) → BatchNorm1d(16) → ReLU → Linear(16, 10), float64."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(64, 16), nn.BatchNorm1d(16, momentum=momentum), nn.ReLU(),
                             nn.Linear(16, 10)).double()


@dataclass
class CheckpointRun:
    tracked: dict[str, int]  # num_batches_tracked after one window
    mean_error: dict[str, float]  # running mean against the run without checkpointing (relative)
    grad_error: dict[str, float]


def checkpoint_window(x: torch.Tensor, y: torch.Tensor, k: int, b: int, momentum: float = 0.1) -> CheckpointRun:
    """One window of ``k`` micro-batches through :func:`bn_block` without checkpointing, with
    ``torch.utils.checkpoint``, with the momentum corrected to :math:`1-\\sqrt{1-m}`, and with
    :func:`gradaccum.coupled.checkpoint_keeping_bn_stats`."""
    require_k(k)
    xs, ys = flat_digits(x[: k * b]), y[: k * b]
    corrected = 1 - math.sqrt(1 - momentum)
    nets = {"no checkpointing": bn_block(0, momentum), "checkpoint": bn_block(0, momentum),
            "checkpoint, momentum 1 − √(1 − m)": bn_block(0, corrected),
            "checkpoint, statistics kept": bn_block(0, momentum)}
    ce = nn.CrossEntropyLoss()
    for xb, yb in zip(xs.chunk(k), ys.chunk(k)):
        for name, net in nets.items():
            if name == "no checkpointing":
                out = net(xb)
            elif name == "checkpoint, statistics kept":
                out = coupled.checkpoint_keeping_bn_stats(net, xb)
            else:
                out = checkpoint(net, xb, use_reentrant=False)
            (ce(out, yb) / k).backward()
    ref = nets["no checkpointing"]
    rel = lambda a, c: float((a - c).norm() / c.norm())  # noqa: E731
    return CheckpointRun(
        tracked={n: int(net[1].num_batches_tracked) for n, net in nets.items()},  # type: ignore[arg-type]
        mean_error={n: rel(net[1].running_mean, ref[1].running_mean) for n, net in nets.items()},
        grad_error={n: rel(flat_grad(net), flat_grad(ref)) for n, net in nets.items()},
    )


# ------------------------------------------------------------------------------------ when K changes


def mlp(seed: int = 0) -> nn.Sequential:
    """Linear(64, 64) → ReLU → Linear(64, 10), float64 (nothing couples the samples)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)).double()


def train_classifier(x: torch.Tensor, y: torch.Tensor, batch: int, k: int, lr: float, seed: int, schedule: str,
                     epochs: int = 10, warmup: int = 0, momentum: float = 0.9) -> nn.Sequential:
    """SGD (momentum 0.9) on the digits with batches of ``batch`` samples accumulated over ``k`` micro-batches;
    a linear warmup over ``warmup`` optimizer steps, then constant or cosine-decayed to 0 (counted in optimizer
    steps). The data order depends only on ``seed``."""
    require_k(k)
    if batch % k:
        raise ValueError(f"K = {k} does not divide the batch of {batch}.")
    if schedule not in ("constant", "cosine"):
        raise ValueError(f"schedule must be 'constant' or 'cosine', got {schedule!r}.")
    model, ce = mlp(seed), nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    g = torch.Generator().manual_seed(seed)
    xs, per_epoch = flat_digits(x), len(x) // batch
    total, step = epochs * per_epoch, 0
    for _ in range(epochs):
        order = torch.randperm(len(xs), generator=g)
        for i in range(per_epoch):
            idx = order[i * batch:(i + 1) * batch]
            factor = min(1.0, (step + 1) / warmup) if warmup else 1.0
            if schedule == "cosine":
                factor *= (1 + math.cos(math.pi * step / total)) / 2
            for group in opt.param_groups:
                group["lr"] = lr * factor
            opt.zero_grad()
            for xb, yb in zip(xs[idx].chunk(k), y[idx].chunk(k)):
                (ce(model(xb), yb) / k).backward()
            opt.step()
            step += 1
    return model


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(flat_digits(x)).argmax(1) == y).double().mean())


def max_parameter_difference(a: nn.Module, b: nn.Module) -> float:
    with torch.no_grad():
        return max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


#: The scaling study's three runs: (label, batch, K, learning rate, warmup steps).
SCALING_RUNS = (("b = 16", 16, 1, 0.05, 0), ("K·b = 64, same rate", 64, 4, 0.05, 0),
                ("K·b = 64, rate × 4, warmup", 64, 4, 0.2, 20))


def scaling_study(x: torch.Tensor, y: torch.Tensor, x_val: torch.Tensor, y_val: torch.Tensor,
                  seeds: Sequence[int] = (0, 1, 2), schedules: Sequence[str] = ("constant", "cosine"),
                  epochs: int = 10) -> dict[tuple[str, int, str], float]:
    """Validation accuracy of :data:`SCALING_RUNS` after ``epochs`` epochs, per seed and schedule."""
    return {(label, seed, schedule): accuracy(train_classifier(x, y, batch, k, lr, seed, schedule, epochs, warmup),
                                              x_val, y_val)
            for label, batch, k, lr, warmup in SCALING_RUNS for seed in seeds for schedule in schedules}
