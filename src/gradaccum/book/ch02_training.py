"""Chapter 2's training runs: a fresh network (:data:`ARCHS`: the SmallCNN or the BatchNorm MLP) trained on the
digits with each method the chapter compares (:data:`METHODS`), the seed study behind its comparative claims, and
their tables.

Every method trains on the same batches (64 images by default) with the same optimizer; only how BatchNorm
normalizes and what gradient the step gets differ (plain accumulation, Ghost BatchNorm, the two
full-batch-statistics schemes, the corrected momentum, GroupNorm and LayerNorm). Each run reports its validation
accuracy with the running statistics training left behind and after PreciseBN, and the growth of the weights that
feed a BatchNorm. :mod:`gradaccum.book.ch02_ghost_batchnorm` re-exports the public names.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import cast

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from gradaccum._validate import require_k
from gradaccum.accumulate import BackwardFn, accuracy, train
from gradaccum.bn_statistics import corrected_momentum, set_bn_momentum
from gradaccum.book.ch02_precise_bn import _running_stats
from gradaccum.book.data import DigitsSplit
from gradaccum.book.models import NormKind, make_cnn, make_norm_mlp
from gradaccum.book.parallel import run_jobs
from gradaccum.book.tables import Table
from gradaccum.fullbatch_bn import full_batch_stats_as_constants_backward, full_batch_stats_backward
from gradaccum.ghost_bn import ghostify
from gradaccum.precise_bn import precise_bn

#: The methods chapter 2 compares, in the order of its table. "ghost BN, 1 update/step" is this book's
#: one-pass GhostBatchNorm, which updates the running statistics once per step; Hoffer et al.'s reference code
#: runs backward per chunk and updates them once per chunk, which *is* the "plain accumulation" row.
METHODS: tuple[str, ...] = (
    "full batch",
    "plain accumulation",
    "ghost BN, 1 update/step",
    "full-batch stats",
    "exact full-batch stats",
    "momentum-corrected",
    "GroupNorm",
    "LayerNorm",
)


#: The networks chapter 2 trains: the book's SmallCNN (three BatchNorm layers, two on feature maps) and an MLP
#: with two BatchNorm1d layers (:class:`gradaccum.book.models.NormMLP`); with the names the chapter gives them.
ARCHS: dict[str, str] = {"cnn": "SmallCNN", "mlp": "BatchNorm MLP"}


def make_network(arch: str, norm: NormKind = "batch", seed: int = 0, device: torch.device | str = "cpu") -> nn.Module:
    """A fresh float64 network of :data:`ARCHS` with the normalization ``norm``; its weights depend only on
    ``seed``."""
    if arch == "cnn":
        return make_cnn(norm, seed=seed, device=device)
    if arch == "mlp":
        return make_norm_mlp(norm, seed=seed, device=device)
    raise ValueError(f"unknown network {arch!r}; choose from {list(ARCHS)}.")


@dataclass(frozen=True)
class MethodRun:
    """One training run of the side-by-side experiment.

    ``k``: forward/backward passes per optimizer step (1 for the full batch and the one-pass Ghost BatchNorm);
    ``b``: how many samples each BatchNorm statistic was computed from in training (the micro-batch, the ghost
    batch, or the whole batch of 64 for the full batch and both full-batch-statistics schemes).
    ``val_acc``: eval-mode validation accuracy with the running statistics training left behind;
    ``val_acc_precise``: the same model after PreciseBN (:func:`precise_bn` over the training set in batches
    of the size the method normalized with; NaN for GroupNorm/LayerNorm, which keep no statistics);
    ``weight_growth``: for each layer whose output feeds a BatchNorm, ‖W_end‖/‖W_start‖ (empty without
    BatchNorm) — the drift Ioffe and Szegedy predicted for gradients that ignore the statistics;
    ``arch``: the network (a key of :data:`ARCHS`).
    """

    method: str
    k: int
    b: int
    seed: int
    schedule: str
    val_acc: float
    val_acc_precise: float
    weight_growth: tuple[float, ...]
    steps: int
    arch: str = "cnn"


def pre_bn_layers(model: nn.Module) -> list[str]:
    """Names of the layers whose output is the input of a BatchNorm layer (the module just before a
    ``_BatchNorm`` in an ``nn.Sequential``)."""
    names = []
    for parent, module in model.named_modules():
        if isinstance(module, nn.Sequential):
            children = list(module.named_children())
            for (name, before), (_, after) in zip(children, children[1:]):
                if isinstance(after, _BatchNorm) and getattr(before, "weight", None) is not None:
                    names.append(f"{parent}.{name}" if parent else name)
    return names


def _normalization_size(method: str, k: int, batch_size: int) -> int:
    """The number of samples each BatchNorm statistic was computed from while ``method`` trained."""
    return batch_size if method in ("full batch", "full-batch stats", "exact full-batch stats") else batch_size // k


class ShadowRunningStats:
    r"""The running statistics every BatchNorm layer of ``model`` *would* keep with another ``momentum``,
    tracked beside the real ones during training.

    A training-mode forward normalizes with the batch statistics and never reads the running ones, so the
    momentum changes nothing in training — not the gradients, not the weights — only the running statistics.
    One run can therefore serve two momenta: a forward pre-hook applies BatchNorm's own update,
    :math:`\bar\mu \leftarrow (1-m)\bar\mu + m\,\hat\mu_B` and the same for the unbiased variance, with the
    other momentum.
    """

    def __init__(self, model: nn.Module, momentum: float):
        self.momentum = momentum
        self.stats = {
            name: tuple(t.clone() for t in _running_stats(layer))
            for name, layer in model.named_modules()
            if isinstance(layer, _BatchNorm)
        }
        self._hooks = [
            layer.register_forward_pre_hook(functools.partial(self._update, name))
            for name, layer in model.named_modules()
            if isinstance(layer, _BatchNorm)
        ]

    def _update(self, name: str, layer: _BatchNorm, inputs: tuple[torch.Tensor, ...]) -> None:
        if not layer.training:
            return
        x = inputs[0].detach()
        dims = [0, *range(2, x.dim())]
        mean, var = self.stats[name]
        mean.mul_(1 - self.momentum).add_(x.mean(dims), alpha=self.momentum)
        var.mul_(1 - self.momentum).add_(x.var(dims, correction=1), alpha=self.momentum)

    def apply_to(self, model: nn.Module) -> nn.Module:
        """A copy of ``model`` (hooks removed from the original) with the shadow running statistics."""
        for h in self._hooks:
            h.remove()
        twin = copy.deepcopy(model)
        for name, (mean, var) in self.stats.items():
            running_mean, running_var = _running_stats(twin.get_submodule(name))
            running_mean.copy_(mean)
            running_var.copy_(var)
        return twin


def train_method(
    split: DigitsSplit,
    method: str,
    k: int,
    batch_size: int = 64,
    epochs: int = 8,
    seed: int = 0,
    schedule: str = "constant",
    shadow: list[MethodRun] | None = None,
    arch: str = "cnn",
) -> tuple[MethodRun, nn.Module]:
    """Train a fresh network ``arch`` (:data:`ARCHS`) with one method on 64-image batches (K micro-batches of
    b = 64/K): SGD with momentum 0.9, learning rate 0.05 (``schedule`` "constant" or "cosine"), cross-entropy, float64.

    "full batch" and "ghost BN, 1 update/step" take one forward/backward per batch (K = 1); every other method
    accumulates K micro-batches. Returns the run and the trained model (in eval mode).

    With ``shadow`` (a list, for "plain accumulation" only), the momentum-corrected run is read off the same
    training run with :class:`ShadowRunningStats` and appended to it: it has the same weights, so only its
    running statistics differ.
    """

    require_k(k)
    if batch_size % k or batch_size // k < 2:
        raise ValueError(f"K = {k} must divide the batch size {batch_size} into micro-batches of at least 2.")
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {list(METHODS)}.")
    model, steps_k, backward_fn = _method_model(method, k, batch_size // k, seed, split.x_train.device, arch)
    if shadow is not None and method != "plain accumulation":
        raise ValueError("shadow running statistics are read off a plain-accumulation run only.")
    tracker = ShadowRunningStats(model, corrected_momentum(0.1, k)) if shadow is not None else None
    watched = {
        name: m.weight.detach().norm().item() for name, m in model.named_modules() if name in pre_bn_layers(model)
    }
    result = train(
        model,
        split.x_train,
        split.y_train,
        split.x_val,
        split.y_val,
        batch_size=batch_size,
        k=steps_k,
        epochs=epochs,
        seed=seed,
        backward_fn=backward_fn,
        schedule=schedule,
    )
    growth = tuple(
        cast(torch.Tensor, model.get_submodule(name).weight).detach().norm().item() / start
        for name, start in watched.items()
    )
    group = _normalization_size(method, k, batch_size)
    precise = _precise_bn_accuracy(model, split, group) if method not in ("GroupNorm", "LayerNorm") else float("nan")
    run = MethodRun(
        method, steps_k, group, seed, schedule, result.val_acc, precise, growth, result.optimizer_steps, arch
    )
    if tracker is not None and shadow is not None:  # the same weights: only the running statistics differ
        twin = tracker.apply_to(model).eval()
        shadow.append(replace(run, method="momentum-corrected", val_acc=accuracy(twin, split.x_val, split.y_val)))
    return run, model.eval()


def _method_model(
    method: str, k: int, b: int, seed: int, device: torch.device, arch: str = "cnn"
) -> tuple[nn.Module, int, BackwardFn | None]:
    """A fresh network ``arch`` set up for ``method`` (its normalization; Ghost BatchNorm layers, or BatchNorm's
    corrected momentum), the K :func:`train` runs it with (1 for the full batch and the one-pass Ghost BatchNorm),
    and the backward function that replaces plain accumulation (None: plain accumulation)."""
    norms: dict[str, NormKind] = {"GroupNorm": "group", "LayerNorm": "layer"}
    model = make_network(arch, norms.get(method, "batch"), seed=seed, device=device)
    steps_k, backward_fn = k, None
    if method == "full batch":
        steps_k = 1
    elif method == "ghost BN, 1 update/step":
        model, steps_k = ghostify(model, b), 1
    elif method == "full-batch stats":
        backward_fn = full_batch_stats_as_constants_backward
    elif method == "exact full-batch stats":  # with its cache: the same gradient, a third of the time
        backward_fn = functools.partial(full_batch_stats_backward, cache=True)
    elif method == "momentum-corrected":
        set_bn_momentum(model, corrected_momentum(0.1, k))
    return model, steps_k, backward_fn


def _precise_bn_accuracy(model: nn.Module, split: DigitsSplit, size: int) -> float:
    """Validation accuracy of a copy of ``model`` after PreciseBN over the training set in batches of ``size`` (the
    size the method normalized with in training)."""
    recomputed = copy.deepcopy(model)
    precise_bn(recomputed, split.x_train, size)
    return accuracy(recomputed.eval(), split.x_val, split.y_val)


def train_methods(
    split: DigitsSplit,
    k: int,
    batch_size: int = 64,
    epochs: int = 8,
    seed: int = 0,
    methods: Sequence[str] = METHODS,
    schedule: str = "constant",
    arch: str = "cnn",
) -> list[MethodRun]:
    """:func:`train_method` for each of ``methods`` (in the order of :data:`METHODS`), on the same batches.

    When both "plain accumulation" and "momentum-corrected" are asked for, one training run serves both
    (:class:`ShadowRunningStats`; a test checks it against a separate momentum-corrected run).
    """
    unknown = set(methods) - set(METHODS)
    if unknown:
        raise ValueError(f"unknown method(s) {sorted(unknown)}; choose from {list(METHODS)}.")
    runs: dict[str, MethodRun] = {}
    for m in METHODS:
        if m not in methods or m in runs:
            continue
        if m == "plain accumulation" and "momentum-corrected" in methods:  # one run, two momenta
            shadow: list[MethodRun] = []
            runs[m] = train_method(split, m, k, batch_size, epochs, seed, schedule, shadow=shadow, arch=arch)[0]
            runs["momentum-corrected"] = shadow[0]
        else:
            runs[m] = train_method(split, m, k, batch_size, epochs, seed, schedule, arch=arch)[0]
    return [runs[m] for m in METHODS if m in methods]


def train_many(split: DigitsSplit, jobs: Sequence[dict], workers: int = 1) -> list[list[MethodRun]]:
    """:func:`train_methods` ``(split, **job)`` for every job, in order; with ``workers > 1`` in that many
    spawned processes (:func:`gradaccum.book.parallel.run_jobs`): every run seeds itself, so the results are the
    ones the jobs give one after the other (a test checks it), in about ``1/workers`` of the time on as many
    cores."""
    return run_jobs(train_methods, [dict(split=split, **job) for job in jobs], workers)


def study_jobs(
    seeds: Sequence[int] = (0, 1, 2),
    schedules: Sequence[str] = ("constant", "cosine"),
    k: int = 16,
    k_small: int = 4,
    batch_size: int = 64,
    epochs: int = 8,
    archs: Sequence[str] = ("cnn",),
) -> list[dict]:
    """The :func:`train_methods` jobs of :func:`seed_study`, network by network."""
    unknown = set(archs) - set(ARCHS)
    if unknown:
        raise ValueError(f"unknown network(s) {sorted(unknown)}; choose from {list(ARCHS)}.")
    jobs = []
    for arch in archs:
        for schedule in schedules:
            for seed in seeds:
                common = dict(batch_size=batch_size, epochs=epochs, seed=seed, schedule=schedule, arch=arch)
                jobs.append(dict(k=k, methods=("full batch", "plain accumulation", "momentum-corrected"), **common))
                jobs.append(dict(k=k_small, methods=("plain accumulation",), **common))
    return jobs


def seed_study(
    split: DigitsSplit,
    seeds: Sequence[int] = (0, 1, 2),
    schedules: Sequence[str] = ("constant", "cosine"),
    k: int = 16,
    k_small: int = 4,
    batch_size: int = 64,
    epochs: int = 8,
    workers: int = 1,
    archs: Sequence[str] = ("cnn",),
) -> list[MethodRun]:
    """The runs behind chapter 2's comparative claims, for every network, seed and learning-rate schedule: the
    full batch, plain accumulation at ``k_small`` and at ``k``, and momentum-corrected accumulation at ``k`` (each
    with its PreciseBN accuracy); ``workers`` as in :func:`train_many`."""
    parts = train_many(split, study_jobs(seeds, schedules, k, k_small, batch_size, epochs, archs), workers)
    return [run for part in parts for run in part]


StudyKey = tuple[str, str, int, str, int]


def study_table(runs: Sequence[MethodRun]) -> dict[StudyKey, MethodRun]:
    """Index runs by (network, method, K, schedule, seed); refuses duplicates."""
    table: dict[StudyKey, MethodRun] = {}
    for r in runs:
        key = (r.arch, r.method, r.k, r.schedule, r.seed)
        if key in table:
            raise ValueError(f"two runs for {key}; pass each run once.")
        table[key] = r
    return table


def format_study(runs: Sequence[MethodRun]) -> Table:
    """Validation accuracy per network, schedule and seed: each column as "running stats → after PreciseBN"
    (a run the study lacks is "—")."""
    table = study_table(runs)
    columns = list(dict.fromkeys((m, k) for _, m, k, _, _ in table))
    heads = {("full batch", 1): "full batch"}
    names = [
        heads.get(c, c[0].replace("accumulation", "accum.").replace("momentum-", "mom.-") + f" K={c[1]}")
        for c in columns
    ]

    def cell(key: StudyKey) -> str:
        r = table.get(key)
        return "—" if r is None else f"{100 * r.val_acc:.1f} → {100 * r.val_acc_precise:.1f}%"

    rows = [
        [ARCHS.get(arch, arch), schedule, seed] + [cell((arch, m, k, schedule, seed)) for m, k in columns]
        for arch in dict.fromkeys(key[0] for key in table)
        for schedule in dict.fromkeys(key[3] for key in table)
        for seed in dict.fromkeys(key[4] for key in table)
    ]
    return Table(["network", "schedule", "seed", *names], rows)


#: How a table or figure names a method whose short name could mislead: "full-batch stats" are used as constants.
SHOWN = {"full-batch stats": "full-batch stats as constants"}


def _span(lo: float, hi: float) -> str:
    """A growth range to one decimal, "1.4–1.7×"; one value, "1.8×", when both ends round alike."""
    a, b = f"{lo:.1f}", f"{hi:.1f}"
    return f"{a}×" if a == b else f"{a}–{b}×"


def format_methods(runs: list[MethodRun]) -> Table:
    """The side-by-side table: validation accuracy per method with its running statistics and after
    PreciseBN, and the growth of the weights that feed BatchNorm layers."""
    rows = []
    for r in runs:
        precise = "—" if r.val_acc_precise != r.val_acc_precise else f"{100 * r.val_acc_precise:.1f}%"
        growth = "—" if not r.weight_growth else _span(min(r.weight_growth), max(r.weight_growth))
        group = f"{r.b}" if r.weight_growth else "—"  # GroupNorm/LayerNorm: per-sample statistics
        rows.append([r.method, r.k, group, f"{100 * r.val_acc:.1f}%", precise, growth])
    return Table(["method", "K", "BN n", "val acc", "after PreciseBN", "pre-BN weight growth"], rows)
