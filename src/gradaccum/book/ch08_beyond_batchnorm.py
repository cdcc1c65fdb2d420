"""Chapter 8, "Beyond BatchNorm": contrastive training on the digits, the costs of GradCache, the load-balancing
loss of a small router, checkpointing with BatchNorm, and the figures.

The book layer over :mod:`gradaccum.coupled` (the torch-only tools the chapter derives). Here: GradCache's
errors and costs, the contrastive study and the figures; the contrastive training runs are in
:mod:`gradaccum.book.ch08_contrastive`, the router's load-balancing loss in :mod:`gradaccum.book.ch08_routing`,
checkpointing with BatchNorm in :mod:`gradaccum.book.ch08_checkpointing`, the batch-size scaling study's runs in
:mod:`gradaccum.book.ch08_scaling`, all re-exported here. The fine print's measurements have modules of their own,
which the chapter imports directly: mixture-of-experts routing on the gradient (:mod:`gradaccum.book.ch08_moe`),
the EMA, weight-decay and batch-size rules (:mod:`gradaccum.book.ch08_rules`), and contrastive losses across gloo
ranks (:mod:`gradaccum.book.ch08_ddp`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import matplotlib.pyplot as plt
import numpy as np
import torch

from gradaccum import coupled
from gradaccum._tensors import relative_error
from gradaccum._validate import require_count, require_k
from gradaccum.accumulate import flat_grad
from gradaccum.book import ch08_contrastive
from gradaccum.book.ch08_checkpointing import CHECKPOINT_METHODS as CHECKPOINT_METHODS
from gradaccum.book.ch08_checkpointing import Checkpointed as Checkpointed
from gradaccum.book.ch08_checkpointing import CheckpointRun as CheckpointRun
from gradaccum.book.ch08_checkpointing import bn_block as bn_block
from gradaccum.book.ch08_checkpointing import checkpoint_window as checkpoint_window
from gradaccum.book.ch08_checkpointing import measured_momentum as measured_momentum
from gradaccum.book.ch08_checkpointing import plot_checkpoint_momentum as plot_checkpoint_momentum
from gradaccum.book.ch08_contrastive import TAU as TAU
from gradaccum.book.ch08_contrastive import contrastive_run as contrastive_run
from gradaccum.book.ch08_contrastive import encoder as encoder
from gradaccum.book.ch08_contrastive import few_label_accuracy as few_label_accuracy
from gradaccum.book.ch08_contrastive import loss as loss
from gradaccum.book.ch08_contrastive import train_contrastive as train_contrastive
from gradaccum.book.ch08_contrastive import views as views
from gradaccum.book.ch08_ddp import start_fork_server
from gradaccum.book.ch08_routing import aux_covariance as aux_covariance
from gradaccum.book.ch08_routing import aux_losses as aux_losses
from gradaccum.book.ch08_routing import plot_aux as plot_aux
from gradaccum.book.ch08_routing import plot_aux_window as plot_aux_window
from gradaccum.book.ch08_routing import router as router
from gradaccum.book.ch08_scaling import BASE_LR as BASE_LR
from gradaccum.book.ch08_scaling import SCALING_RUNS as SCALING_RUNS
from gradaccum.book.ch08_scaling import Recipe as Recipe
from gradaccum.book.ch08_scaling import accuracy as accuracy
from gradaccum.book.ch08_scaling import max_parameter_difference as max_parameter_difference
from gradaccum.book.ch08_scaling import optimizer_for as optimizer_for
from gradaccum.book.ch08_scaling import scaling_run as scaling_run
from gradaccum.book.ch08_scaling import scaling_study as scaling_study
from gradaccum.book.ch08_scaling import train_classifier as train_classifier
from gradaccum.book.data import flat_digits as flat_digits
from gradaccum.book.parallel import run_jobs
from gradaccum.book.plotting import PALETTE, decorate, figure, heatmap
from gradaccum.timing import interleaved_medians


def start_workers(workers: int = 2) -> threading.Thread:
    """Start the chapter's worker processes now and return at once, so they import torch while the next cells run:
    the fork server of the DDP cell (:func:`gradaccum.book.ch08_ddp.start_fork_server`), and the studies'
    ``workers`` processes, to which a thread hands a job that imports the modules of :func:`contrastive_run` and
    :func:`scaling_run` (:func:`gradaccum.book.ch08_contrastive.preload`): the first study (``workers=2``) finds
    them ready. The thread is returned (join it to wait); an error in it is left to the study that needs the
    processes, which raises it."""
    start_fork_server()
    modules = (contrastive_run.__module__, scaling_run.__module__)

    def run() -> None:
        try:
            run_jobs(ch08_contrastive.preload, [dict(modules=modules)] * workers, workers)
        except Exception:  # noqa: BLE001, S110 - the study's own call reports it, in its cell
            pass

    thread = threading.Thread(target=run, name="ch8-start-workers", daemon=True)
    thread.start()
    return thread


def accumulation_error(x: torch.Tensor, k: int, b: int, seed: int = 0) -> tuple[float, float]:
    """Relative error against the full batch of ``k · b`` digits (two views each, a shared encoder) of plain
    accumulation and of GradCache, for one step."""
    require_k(k)
    require_count(b, "b (pairs per micro-batch)")
    if k * b > len(x):
        raise ValueError(f"K · b = {k * b} pairs need {k * b} digits; only {len(x)} given.")
    g = torch.Generator().manual_seed(seed)
    xs = flat_digits(x[: k * b])
    xa, xb = views(xs, g), views(xs, g)
    full, plain, cache = encoder(seed), encoder(seed), encoder(seed)
    loss(full(xa), full(xb)).backward()
    coupled.plain_accumulation_backward([plain, plain], [xa, xb], k, loss)
    coupled.grad_cache_backward([cache, cache], [xa, xb], k, loss)
    ref = flat_grad(full)
    return relative_error(flat_grad(plain), ref), relative_error(flat_grad(cache), ref)


@dataclass
class Costs:
    """Seconds per step (interleaved medians) and the peak bytes of tensors saved for backward."""

    seconds: dict[str, float]
    saved_bytes: dict[str, int]


class _Held:
    """A tensor saved for backward; its storage is counted once, while any graph holds a tensor on it."""

    __slots__ = ("t", "key", "meter")

    def __init__(self, t: torch.Tensor, meter: _Meter):
        self.t, self.key, self.meter = t, t.untyped_storage().data_ptr(), meter
        meter.hold(self.key, t.untyped_storage().nbytes())

    def __del__(self) -> None:
        self.meter.release(self.key)


class _Meter:
    """Bytes of the distinct storages that saved tensors occupy, now and at the peak; storages in ``skip`` (the
    parameters' and the inputs', held whatever the method) are not counted."""

    def __init__(self, skip: set[int]):
        self.skip, self.now, self.peak = skip, 0, 0
        self.refs: dict[int, int] = {}
        self.size: dict[int, int] = {}

    def hold(self, key: int, nbytes: int) -> None:
        if key in self.skip:
            return
        if self.refs.get(key, 0) == 0:
            self.size[key] = nbytes
            self.now += nbytes
            self.peak = max(self.peak, self.now)
        self.refs[key] = self.refs.get(key, 0) + 1

    def release(self, key: int) -> None:
        if key in self.skip:
            return
        self.refs[key] -= 1
        if self.refs[key] == 0:
            self.now -= self.size.pop(key)


def peak_saved_bytes(fn, skip: Iterable[torch.Tensor] = ()) -> int:  # noqa: ANN001
    """The largest number of bytes that tensors saved for backward occupy at once while ``fn`` runs (a graph's
    saved tensors are released when its backward is done): each storage counted once, however many operations
    save it or views of it, and the storages of the tensors in ``skip`` (the model's parameters and the inputs,
    which every method holds) not at all."""
    meter = _Meter({t.untyped_storage().data_ptr() for t in skip})
    with torch.autograd.graph.saved_tensors_hooks(lambda t: _Held(t, meter), lambda h: h.t):
        fn()
    return meter.peak


def step_costs(x: torch.Tensor, k: int, b: int, hidden: int = 2048, repeat: int = 5) -> Costs:
    """Time and graph memory of one step of the full batch, plain accumulation and GradCache (``k`` micro-batches
    of ``b`` digits, two views) with an encoder of ``hidden`` units. Graph memory: :func:`peak_saved_bytes`, without
    the parameters and the two views (GradCache also keeps the window's embeddings and their gradient,
    2 · k · b · 16 numbers each, outside the encoders' graphs; its loss graph saves the embeddings, so they count)."""
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
    held = [*enc.parameters(), xa, xb]
    return Costs(seconds, {name: peak_saved_bytes(fn, held) for name, fn in fns.items()})


def contrastive_study(
    x_train: torch.Tensor,
    y_train: torch.Tensor,
    x_val: torch.Tensor,
    y_val: torch.Tensor,
    settings: Sequence[tuple[int, int]] = ((16, 2), (4, 8)),
    seeds: Sequence[int] = (0, 1, 2),
    schedules: Sequence[str] = ("constant", "cosine"),
    workers: int = 1,
) -> dict[tuple[int, int, int, str], dict]:
    """:func:`contrastive_run` for each (K, b), seed and schedule (batch K · b = 32), keyed by
    (K, b, seed, schedule); with ``workers > 1`` in that many spawned processes
    (:func:`gradaccum.book.parallel.run_jobs`: every run seeds itself, the same results to the bit)."""
    keys = [(k, b, seed, schedule) for k, b in settings for seed in seeds for schedule in schedules]
    data = dict(x_train=x_train, y_train=y_train, x_val=x_val, y_val=y_val)
    jobs = [dict(data, k=k, b=b, seed=seed, schedule=schedule) for k, b, seed, schedule in keys]
    return dict(zip(keys, run_jobs(contrastive_run, jobs, workers)))


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
    decorate(
        ax,
        "few-label accuracy, full batch (= GradCache)",
        "plain accumulation",
        "Contrastive training, batch 32: one point per seed and schedule",
    )
    return fig


def error_grid(x: torch.Tensor, ks: Sequence[int], bs: Sequence[int]) -> np.ndarray:
    """Plain accumulation's gradient error (one step) over K × b."""
    return np.array([[accumulation_error(x, k, b)[0] for b in bs] for k in ks])


def plot_error_grid(grid: np.ndarray, ks: Sequence[int], bs: Sequence[int]):
    fig, (ax,) = figure(1, 6.4, 3.6)
    image = heatmap(
        ax,
        grid,
        ks,
        bs,
        vmin=0.0,
        xlabel="micro-batch size b",
        ylabel="K",
        title="InfoNCE: plain accumulation vs full batch",
    )
    fig.colorbar(image, ax=ax, label="relative gradient error")
    return fig


def plot_error_widget(x: torch.Tensor, k: int, b: int):
    """The widget's picture: plain accumulation's and GradCache's gradient error at one K and b."""
    if b < 2:
        raise ValueError("b must be at least 2: a micro-batch of one pair has no negative at all (its InfoNCE is 0).")
    plain, cache = accumulation_error(x, k, b)
    fig, (ax,) = figure(1, 6.4, 3.0)
    bars = ax.bar(["plain accumulation", "GradCache"], [plain, cache], color=[PALETTE["vermillion"], PALETTE["blue"]])
    # a bar of height 0 (GradCache is exact) is invisible: every bar gets its value written on it
    ax.bar_label(bars, labels=[f"{plain:.2f}", "0 (exact)" if cache < 1e-12 else f"{cache:.0e}"], padding=2)
    ax.margins(y=0.15)  # room above the tallest bar for its label, below the title
    decorate(ax, "", "relative gradient error", f"K = {k}, b = {b}: {b - 1} vs {k * b - 1} negatives per sample")
    return fig


def _scaling_panel(
    ax,
    study: dict[tuple[str, str, int, str], float],
    optimizer: str,
    schedule: str,
    fontsize: int = 7,
    ylim: tuple[float, float] | None = None,
) -> None:
    if optimizer not in SCALING_RUNS:
        raise ValueError(f"optimizer must be one of {list(SCALING_RUNS)}, got {optimizer!r}.")
    recipes = SCALING_RUNS[optimizer]
    seeds = sorted({key[2] for key in study if key[0] == optimizer and key[3] == schedule})
    if not seeds:
        raise ValueError(f"the study has no {optimizer} run with the {schedule!r} schedule.")
    for i, r in enumerate(recipes):
        accs = [study[optimizer, r.label, s, schedule] for s in seeds]
        ax.plot([i - 0.25, i + 0.25], [sum(accs) / len(accs)] * 2, "-", color=PALETTE["blue"], linewidth=2.5)
        ax.plot([i] * len(accs), accs, "o", color=PALETTE["black"], fillstyle="none")
    ax.set_xticks(range(len(recipes)), [r.label.replace(", ", ",\n", 1) for r in recipes], fontsize=fontsize)
    ax.set_xlim(-0.6, len(recipes) - 0.4)
    if ylim is not None:
        ax.set_ylim(*ylim)
    decorate(
        ax,
        "",
        "validation accuracy",
        f"{optimizer}, {schedule} rate: line = mean, circles = seeds {seeds[0]}–{seeds[-1]}",
        legend=False,
    )


def plot_scaling(study: dict[tuple[str, str, int, str], float], optimizer: str, schedule: str):
    """The widget's picture: validation accuracy of each recipe of :data:`SCALING_RUNS` for one optimizer and
    schedule, one circle per seed, the mean as a bar."""
    fig, (ax,) = figure(1, 6.4, 3.4)
    _scaling_panel(ax, study, optimizer, schedule, ylim=(min(study.values()) - 0.01, 1.0))
    return fig


def plot_scaling_grid(study: dict[tuple[str, str, int, str], float]):
    """The static figure: :func:`plot_scaling` for every optimizer and schedule, side by side."""
    fig, axes = plt.subplots(2, 2, figsize=(9.6, 6.0), layout="constrained")
    low = min(study.values())
    for row, optimizer in zip(axes, SCALING_RUNS):
        for ax, schedule in zip(row, ("constant", "cosine")):
            _scaling_panel(ax, study, optimizer, schedule, fontsize=6, ylim=(low - 0.01, 1.0))
    return fig
