"""Chapter 8's contrastive training runs on the digits: the views, the encoder, InfoNCE, training with the full
batch, plain accumulation or GradCache, and the few-label accuracy that scores the embedding.

Re-exported by :mod:`gradaccum.book.ch08_beyond_batchnorm`. The contrastive study's worker processes
(:func:`gradaccum.book.parallel.run_jobs`) import this module to run :func:`contrastive_run`, so it imports torch,
the core and :func:`gradaccum.book.data.flat_digits` only: no figures, no scikit-learn (a second or two less per
worker started).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from gradaccum import coupled
from gradaccum._validate import require_k
from gradaccum.book.data import flat_digits

#: Temperature of the chapter's InfoNCE loss.
TAU = 0.2


def views(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """One augmented view of each digit: shifted by up to one pixel in each direction and with a random quarter of
    its pixels set to 0 (the randomness comes from ``g`` only)."""
    n = len(x)
    img = x.reshape(n, 8, 8)
    dy, dx = torch.randint(-1, 2, (n,), generator=g), torch.randint(-1, 2, (n,), generator=g)
    # torch.roll of each image by (dy, dx), all at once: out[r, c] = img[(r - dy) % 8, (c - dx) % 8]
    grid = torch.arange(8)
    rows, cols = (grid - dy[:, None]) % 8, (grid - dx[:, None]) % 8
    shifted = img[torch.arange(n)[:, None, None], rows[:, :, None], cols[:, None, :]]
    keep = (torch.rand(n, 64, generator=g, dtype=x.dtype) > 0.25).to(x.dtype)
    return shifted.reshape(n, -1) * keep


def encoder(seed: int = 0, hidden: int = 64) -> nn.Sequential:
    """Linear(64, hidden) → ReLU → Linear(hidden, 16), float64; the weights depend only on ``seed`` (drawn in
    float32 and then cast, whatever torch's default dtype)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        f32 = torch.float32
        return nn.Sequential(nn.Linear(64, hidden, dtype=f32), nn.ReLU(), nn.Linear(hidden, 16, dtype=f32)).double()


def loss(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The chapter's InfoNCE (temperature :data:`TAU`)."""
    return coupled.info_nce(a, b, TAU)


def few_label_accuracy(
    enc: nn.Module,
    x_train: torch.Tensor,
    y_train: torch.Tensor,
    x_val: torch.Tensor,
    y_val: torch.Tensor,
    per_class: int = 3,
) -> float:
    """Validation accuracy of nearest class centroid (cosine) in the embedding, the centroids from the first
    ``per_class`` training digits of each class: how well the embedding separates the classes with few labels."""
    labelled = torch.cat([torch.nonzero(y_train == c)[:per_class, 0] for c in range(10)])
    with torch.no_grad():
        a = F.normalize(enc(flat_digits(x_train[labelled])), dim=1)
        v = F.normalize(enc(flat_digits(x_val)), dim=1)
    centroids = F.normalize(torch.stack([a[y_train[labelled] == c].mean(0) for c in range(10)]), dim=1)
    return float(((v @ centroids.T).argmax(1) == y_val).double().mean())


def train_contrastive(
    method: str,
    x: torch.Tensor,
    k: int,
    b: int,
    seed: int,
    schedule: str,
    epochs: int = 4,
    lr: float = 0.05,
    one_pass: bool = True,
) -> nn.Module:
    """Contrastive training of :func:`encoder` on the training digits: SGD with momentum 0.9, batches of
    ``k · b`` digits (two views each), ``"full"`` batch, ``"plain"`` accumulation of ``k`` micro-batches or
    ``"gradcache"``, learning rate constant or cosine-decayed to 0. With ``one_pass`` (the default), plain
    accumulation is computed in one pass as :func:`gradaccum.coupled.micro_batch_info_nce`, the same gradient as
    :func:`gradaccum.coupled.plain_accumulation_backward` to rounding (a test trains both ways)."""
    if method not in ("full", "plain", "gradcache"):
        raise ValueError(f"method must be 'full', 'plain' or 'gradcache', got {method!r}.")
    if schedule not in ("constant", "cosine"):
        raise ValueError(f"schedule must be 'constant' or 'cosine', got {schedule!r}.")
    require_k(k)
    if isinstance(b, bool) or not isinstance(b, int) or b < 1:
        raise ValueError(f"the micro-batch size b must be an int >= 1, got {b!r}.")
    enc = encoder(seed)
    opt = torch.optim.SGD(enc.parameters(), lr=lr, momentum=0.9)
    g = torch.Generator().manual_seed(seed)
    xs, n = flat_digits(x), k * b
    per_epoch = len(xs) // n
    if per_epoch == 0:
        raise ValueError(
            f"a batch of K · b = {n} digits is more than the {len(xs)} given: no step would run; "
            "give more digits or a smaller K or b."
        )
    total, step = epochs * per_epoch, 0
    for _ in range(epochs):
        order = torch.randperm(len(xs), generator=g)
        for i in range(per_epoch):
            batch = xs[order[i * n : (i + 1) * n]]
            xa, xb = views(batch, g), views(batch, g)
            factor = (1 + math.cos(math.pi * step / total)) / 2 if schedule == "cosine" else 1.0
            for group in opt.param_groups:
                group["lr"] = lr * factor
            opt.zero_grad()
            if method == "full":
                loss(enc(xa), enc(xb)).backward()
            elif method == "plain" and one_pass:  # the same gradient as accumulating, to rounding
                coupled.micro_batch_info_nce(enc(xa), enc(xb), k, TAU).backward()
            elif method == "plain":
                coupled.plain_accumulation_backward([enc, enc], [xa, xb], k, loss)
            else:
                coupled.grad_cache_backward([enc, enc], [xa, xb], k, loss)
            opt.step()
            step += 1
    return enc


def contrastive_run(
    x_train: torch.Tensor,
    y_train: torch.Tensor,
    x_val: torch.Tensor,
    y_val: torch.Tensor,
    k: int,
    b: int,
    seed: int,
    schedule: str,
) -> dict[str, float]:
    """Few-label accuracy after training with the full batch (= GradCache) and with plain accumulation, for one
    (K, b), seed and schedule."""
    return {
        m: few_label_accuracy(train_contrastive(m, x_train, k, b, seed, schedule), x_train, y_train, x_val, y_val)
        for m in ("full", "plain")
    }


def preload(modules: Sequence[str]) -> None:
    """Import ``modules`` (by name) in this process: run as a job, it readies a study's worker processes
    before their first run (:func:`gradaccum.book.ch08_beyond_batchnorm.start_workers`)."""
    for name in modules:
        importlib.import_module(name)
