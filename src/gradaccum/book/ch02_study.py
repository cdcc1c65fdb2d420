"""Chapter 2's training study on two networks, as the chapter reads it: a recorded run, the claims it supports,
and its tables.

The study trains the SmallCNN and the BatchNorm MLP (:data:`gradaccum.book.ch02_training.ARCHS`) with every
method, on three seeds and two learning-rate schedules (:func:`study_plan`). That takes minutes of CPU, more than
a chapter may spend, so the chapter reads the run recorded by ``python -m gradaccum.book.ch02_study --json
src/gradaccum/book/ch02_study.json`` (shipped with the package; :func:`load_study`), and a slow test trains it again
(:func:`run_study`): on the kernel path it was recorded with it must give the recorded numbers, and on any path
the claims must hold (:func:`study_claims`).

Training in float32 or float64 is chaotic: another CPU kernel (another summation order) moves accuracies by
points, like another seed. So a claim here is a sign, an ordering with a margin, or a range, never a digit, and the
rules (what holds on both networks and every seed) are kept apart from what was measured on these seeds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from gradaccum.book.ch02_training import (
    ARCHS,
    METHODS,
    SHOWN,
    MethodRun,
    StudyKey,
    format_methods,
    format_study,
    study_jobs,
    study_table,
    train_many,
)
from gradaccum.book.data import DigitsSplit, load_digits_split
from gradaccum.book.tables import Table

#: The recorded study shipped with the package.
STUDY_FILE = "ch02_study.json"
#: What the chapter's study trains: seeds and schedules of the seed study, K of the comparisons.
SEEDS, SCHEDULES, K, K_SMALL = (0, 1, 2), ("constant", "cosine"), 16, 4


def study_plan(seeds: Sequence[int] = SEEDS, archs: Sequence[str] = tuple(ARCHS)) -> list[dict]:
    """The :func:`gradaccum.book.ch02_training.train_methods` jobs of the study, longest first: for each network,
    the side-by-side methods on the first seed with a constant learning rate, full-batch statistics as constants on
    every seed, and the seed study (:func:`gradaccum.book.ch02_training.study_jobs`)."""
    if not seeds:
        raise ValueError("give at least one seed.")
    first = dict(k=K, seed=seeds[0], schedule="constant")
    jobs = [dict(methods=("exact full-batch stats",), arch=arch, **first) for arch in archs]
    jobs += [
        dict(k=K, seed=seed, schedule="constant", methods=("full-batch stats",), arch=arch)
        for arch in archs
        for seed in seeds
    ]
    jobs += [dict(methods=("ghost BN, 1 update/step", "GroupNorm", "LayerNorm"), arch=arch, **first) for arch in archs]
    return jobs + study_jobs(seeds, SCHEDULES, K, K_SMALL, archs=archs)


def run_study(
    split: DigitsSplit, seeds: Sequence[int] = SEEDS, archs: Sequence[str] = tuple(ARCHS), workers: int = 2
) -> list[MethodRun]:
    """Train the study (:func:`study_plan`) in ``workers`` one-thread processes; the runs in plan order."""
    return [run for part in train_many(split, study_plan(seeds, archs), workers) for run in part]


def kernel_path() -> dict[str, Any]:
    """What decides a training run's digits besides the code: torch's version and the CPU kernels ATen runs."""
    return {"torch": torch.__version__, "capability": torch.backends.cpu.get_cpu_capability()}


def study_record(runs: Sequence[MethodRun]) -> dict[str, Any]:
    """The runs as JSON-ready data, with the kernel path they were trained on (NaN accuracies as ``None``)."""

    def row(r: MethodRun) -> dict[str, Any]:
        d = dataclasses.asdict(r)
        d["val_acc_precise"] = None if math.isnan(r.val_acc_precise) else r.val_acc_precise
        d["weight_growth"] = list(r.weight_growth)
        return d

    return {**kernel_path(), "threads": 1, "runs": [row(r) for r in runs]}


def runs_from_record(record: dict[str, Any]) -> list[MethodRun]:
    """The runs of a :func:`study_record` (the inverse of it: every float comes back to the bit)."""
    out = []
    for d in record["runs"]:
        d = dict(d)
        d["val_acc_precise"] = float("nan") if d["val_acc_precise"] is None else d["val_acc_precise"]
        d["weight_growth"] = tuple(d["weight_growth"])
        out.append(MethodRun(**d))
    return out


def load_study() -> tuple[list[MethodRun], dict[str, Any]]:
    """The recorded study (the runs, and the kernel path they were trained on)."""
    text = resources.files("gradaccum.book").joinpath(STUDY_FILE).read_text(encoding="utf-8")
    record = json.loads(text)
    return runs_from_record(record), {k: v for k, v in record.items() if k != "runs"}


@dataclass(frozen=True)
class Claim:
    """One statement the chapter makes about the study. ``rule``: it should hold on both networks and on any seed
    (a test reruns it on other seeds); otherwise it states what these seeds measured (a range with a margin).
    ``measured``: the numbers behind it, as the chapter's fine print reads them."""

    name: str
    rule: bool
    holds: bool
    measured: str


#: One validation image, as a fraction of the 576 (0.17 points).
IMAGE = 1 / 576

Table_ = dict[StudyKey, MethodRun]


def _index(runs: Sequence[MethodRun]) -> tuple[Table_, list[int], list[str]]:
    """The runs by key, the seeds of the seed study (in order) and the networks."""
    t = study_table(runs)
    seeds = sorted({key[4] for key in t if key[1] == "full-batch stats"})
    archs = [a for a in ARCHS if any(key[0] == a for key in t)]
    return t, seeds, archs


def _diffs(t: Table_, arch: str, a: str, b: str, schedule: str, key: str = "val_acc") -> list[float]:
    """Per seed: run ``a`` minus run ``b`` (each "method K", e.g. "plain accumulation 4"), on ``key``."""
    (ma, ka), (mb, kb) = (x.rsplit(" ", 1) for x in (a, b))
    seeds = sorted(s for (ar, m, k, sch, s) in t if (ar, m, str(k), sch) == (arch, ma, ka, schedule))
    return [
        getattr(t[arch, ma, int(ka), schedule, s], key) - getattr(t[arch, mb, int(kb), schedule, s], key) for s in seeds
    ]


def _signed(values: Sequence[float]) -> str:
    """ "min to max" of ``values`` in points, signed, one decimal."""
    return f"{100 * min(values):+.1f} to {100 * max(values):+.1f}"


def _span(values: Sequence[float], scale: float = 100) -> str:
    """ "min–max" of ``values`` (points by default), one decimal."""
    return f"{scale * min(values):.1f}–{scale * max(values):.1f}"


def _constants(t: Table_, seeds: list[int], arch: str) -> list[Claim]:
    """Full-batch statistics as constants, seed by seed against the full batch (constant learning rate)."""
    pairs = [(t[arch, "full-batch stats", K, "constant", s], t[arch, "full batch", 1, "constant", s]) for s in seeds]
    ratio = [min(c.weight_growth) / max(f.weight_growth) for c, f in pairs]
    lost = [f.val_acc - c.val_acc for c, f in pairs]
    acc, precise = [c.val_acc for c, _ in pairs], [c.val_acc_precise for c, _ in pairs]
    unrescued = [f.val_acc - c.val_acc_precise for c, f in pairs]
    claims = [
        Claim(f"{arch}: constants make the pre-BN weights drift", True, min(ratio) > 2, f"{_span(ratio, 1)}×"),
        Claim(f"{arch}: constants cost accuracy", True, min(lost) > 0.05, f"{_span(lost)} points"),
        Claim(f"{arch}: PreciseBN does not rescue constants", False, min(unrescued) > 0.05, _span(unrescued)),
    ]
    if arch == "cnn":  # collapse: below 55%, below 60% after PreciseBN
        holds = max(acc) < 0.55 and max(precise) < 0.6
        return claims + [Claim("cnn: constants collapse", False, holds, f"{_span(acc)}% → {_span(precise)}%")]
    holds = max(lost) < 0.15 and min(acc) > 0.8  # costs points, no collapse
    return claims + [Claim(f"{arch}: constants cost points", False, holds, f"{_span(acc)}% → {_span(precise)}%")]


def _same_weights(t: Table_, seeds: list[int], arch: str) -> list[Claim]:
    """What has the same weights as another run: the momentum-corrected and the plain run (same training), the
    exact scheme and the full batch, the one-pass Ghost BatchNorm and plain accumulation (same gradients)."""
    moot = [
        t[arch, "momentum-corrected", K, sched, s].val_acc_precise
        == t[arch, "plain accumulation", K, sched, s].val_acc_precise
        for sched in SCHEDULES
        for s in seeds
    ]
    first = seeds[0]
    exact, full = t[arch, "exact full-batch stats", K, "constant", first], t[arch, "full batch", 1, "constant", first]
    same = max(abs(exact.val_acc - full.val_acc), abs(exact.val_acc_precise - full.val_acc_precise))
    ghost, plain = (
        t[arch, "ghost BN, 1 update/step", 1, "constant", first],
        t[arch, "plain accumulation", K, "constant", first],
    )
    gap = abs(ghost.val_acc_precise - plain.val_acc_precise)
    before = ghost.val_acc - plain.val_acc  # other running statistics: lower on the CNN, higher on the MLP
    return [
        Claim(f"{arch}: momentum is moot after PreciseBN", True, all(moot), f"{sum(moot)}/{len(moot)} runs"),
        Claim(f"{arch}: exact scheme trains as the full batch", True, same <= IMAGE, f"{same / IMAGE:.0f} images"),
        Claim(f"{arch}: one-pass ghost BN = plain after PreciseBN", True, gap <= IMAGE, f"{gap / IMAGE:.0f} images"),
        Claim(
            f"{arch}: one-pass ghost BN before PreciseBN",
            False,
            (before < 0) == (arch == "cnn"),
            f"{100 * before:+.1f}",
        ),
    ]


def _momentum(t: Table_, arch: str) -> list[Claim]:
    """Momentum-corrected minus plain accumulation at K, before PreciseBN: the sign depends on network and
    schedule (on the CNN it hurt with a constant rate and tied or helped with cosine decay; on the MLP it took
    either sign with a constant rate and helped on some seed with cosine decay)."""
    const, cos = (_diffs(t, arch, f"momentum-corrected {K}", f"plain accumulation {K}", s) for s in SCHEDULES)
    if arch == "cnn":
        holds = max(const) < 0 <= min(cos)
    else:
        holds = min(const) < 0 < max(const) and max(cos) > 0.005
    measured = f"constant {_signed(const)}; cosine {_signed(cos)}"
    return [Claim(f"{arch}: momentum correction before PreciseBN", False, holds, measured)]


def _precise_and_groups(t: Table_, seeds: list[int], archs: list[str]) -> list[Claim]:
    """PreciseBN's effect over every run of the seed study, and b = 16 against the full batch."""
    runs = ("full batch 1", f"plain accumulation {K}", f"plain accumulation {K_SMALL}")
    gains = [
        r.val_acc_precise - r.val_acc for (arch, m, k, sched, s), r in t.items() if f"{m} {k}" in runs and arch in archs
    ]
    small, full = f"plain accumulation {K_SMALL}", "full batch 1"
    ahead = _diffs(t, "cnn", small, full, "constant") if "cnn" in archs else [1.0]
    after = [g for a in archs for sched in SCHEDULES for g in _diffs(t, a, small, full, sched, "val_acc_precise")]
    gn_ln = [t[a, m, K, "constant", seeds[0]].val_acc for a in archs for m in ("GroupNorm", "LayerNorm")]
    return [
        Claim(
            "PreciseBN's effect",
            False,
            min(gains) > -0.005 and 0.015 < max(gains) < 0.03,
            f"{len(gains)} runs: {_signed(gains)}",
        ),
        Claim("cnn: b = 16 ahead of the full batch before PreciseBN", False, min(ahead) > 0, _span(ahead)),
        Claim(
            "b = 16 and the full batch within a point after PreciseBN",
            False,
            max(map(abs, after)) < 0.01,
            _signed(after),
        ),
        Claim("GroupNorm and LayerNorm land at 95-96%", False, 0.945 < min(gn_ln) and max(gn_ln) < 0.97, _span(gn_ln)),
    ]


def study_claims(runs: Sequence[MethodRun]) -> list[Claim]:
    """Every claim the chapter makes about the study, checked on ``runs`` (a :func:`study_plan` run): the rules
    first (``rule=True``), then what these seeds measured."""
    t, seeds, archs = _index(runs)
    claims = [c for arch in archs for c in _constants(t, seeds, arch) + _same_weights(t, seeds, arch)]
    claims += [c for arch in archs for c in _momentum(t, arch)] + _precise_and_groups(t, seeds, archs)
    return sorted(claims, key=lambda c: not c.rule)


def side_by_side(runs: Sequence[MethodRun], seed: int = SEEDS[0], schedule: str = "constant") -> list[MethodRun]:
    """One run per network and method on ``seed`` and ``schedule``, plain accumulation at K (not at K_SMALL), in the
    order of :data:`gradaccum.book.ch02_training.METHODS`, network by network."""
    picked = [r for r in runs if (r.seed, r.schedule) == (seed, schedule) and r.k != K_SMALL]
    return sorted(picked, key=lambda r: (list(ARCHS).index(r.arch), METHODS.index(r.method)))


def format_side_by_side(runs: Sequence[MethodRun], seed: int = SEEDS[0], schedule: str = "constant") -> Table:
    """The side-by-side table (:func:`side_by_side`): for each network, each method's validation accuracy with its
    running statistics, after PreciseBN, and the growth of the weights that feed a BatchNorm."""
    picked = side_by_side(runs, seed, schedule)
    archs = list(dict.fromkeys(r.arch for r in picked))
    cells = {(r.arch, r.method): format_methods([r]).rows[0][3:] for r in picked}
    rows = []
    for method in dict.fromkeys(r.method for r in picked):
        row: list[object] = [SHOWN.get(method, method)]
        for arch in archs:
            row += cells.get((arch, method), ["—"] * 3)
        rows.append(row)
    cols = ["method"] + ["val acc", "after PreciseBN", "pre-BN weight growth"] * len(archs)
    return Table(cols, rows, groups=[("", 1)] + [(ARCHS[a], 3) for a in archs])


def format_seed_study(runs: Sequence[MethodRun]) -> Table:
    """The seed study as a table (:func:`gradaccum.book.ch02_training.format_study`): every network, schedule and
    seed, "running stats → after PreciseBN"; full-batch statistics as constants ran with the constant rate only."""
    order = [("full batch", 1), ("plain accumulation", K), ("momentum-corrected", K), ("plain accumulation", K_SMALL)]
    order.append(("full-batch stats", K))
    picked = [r for r in runs if (r.method, r.k) in order]
    return format_study(sorted(picked, key=lambda r: order.index((r.method, r.k))))


def main(argv: Sequence[str] | None = None) -> None:
    """Train the study and write its record (``--json PATH``), or print its claims."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the record here (the chapter reads src/gradaccum/book/)")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    runs = run_study(load_digits_split(), workers=args.workers)
    if args.json:
        args.json.write_text(json.dumps(study_record(runs), indent=1) + "\n", encoding="utf-8")
    for claim in study_claims(runs):
        print(("✓" if claim.holds else "✗"), claim.name, "—", claim.measured)


if __name__ == "__main__":
    main()
