"""How the full-batch reference is clipped to compare with a loop that clips: at the threshold the caller gave,
else at the loop's own (one threshold), per group of parameters when the loop clips groups once after the last
backward; clip calls that only measure the norm (an infinite threshold) or cannot reach the gradient the step
applies (after the last optimizer step, before the first backward) are set apart. :mod:`.pipeline` and
:mod:`.partial` clip their references with it; the findings about clipping are in :mod:`.run_rules` and
:mod:`.weights`."""

from __future__ import annotations

import math

import torch
from torch import nn

from .measure import clip_vec
from .recorder import Event
from .references import _Refs
from .report import Report, num
from .run import _Run, _trainable
from .run_rules import Clipping


def _clipping(given: float | None, model: nn.Module, run: _Run, refs: _Refs, report: Report) -> Clipping:
    """How the reference is clipped: at the threshold given, else at the loop's own (one threshold), per group
    when the loop clips groups once; clip calls that cannot reach the applied gradient are set apart."""
    # a clip call with an infinite threshold only measures the norm (a common way to log it): not a clip
    clips = [e for e in run.events if e.kind == "clip" and not _measures_only(e)]
    c = Clipping(
        given=given,
        clip=given,
        clips=clips,
        target=refs.full,
        thresholds={
            (e.detail.get("fn"), e.detail.get("max_norm", e.detail.get("clip_value")), e.detail.get("norm_type", 2.0))
            for e in clips
        },
    )
    if given is not None:
        c.source = "the clip argument"
        # v is None when the loop's threshold was not a number (e.g. a tensor); num(None) raises: left as is
        loop = ", ".join(f"{fn} with threshold {num(v)}" for fn, v, _ in sorted(c.thresholds, key=str))
        report.notes.append(
            f"clipping: the full batch is clipped once at threshold {num(given)} (the clip "
            "argument)" + (f"; your loop calls {loop}" if loop else "; your loop makes no clip call")
        )
    elif len(c.thresholds) == 1:
        fn, value, c.norm_type = next(iter(c.thresholds))
        if value is not None:
            c.clip, c.source = value, "your loop's threshold"
            c.kind = "value" if fn == "clip_grad_value_" else "norm"
            report.notes.append(
                f"clipping: your loop calls {fn} with threshold {num(c.clip)}; the full batch is "
                "clipped once at the same threshold"
            )
    # clip calls that cannot reach the gradient the step applies (after the last step, or on the empty buffer
    # before the first backward): a bug when no other clip does, harmless beside a clip that does
    c.misplaced = [(e, where) for e, where in _misplaced_clips(run.events) if not _measures_only(e)]
    c.placed = [e for e in clips if all(e is not m for m, _ in c.misplaced)]
    if c.misplaced and not c.placed and c.given is None:
        c.clip, c.source = None, None  # compare with the unclipped full batch
        report.notes = [n for n in report.notes if not n.startswith("clipping:")]
    c.target = clip_vec(refs.full, c.clip, c.kind, c.norm_type) if c.clip is not None else refs.full
    same = c.given is None or all(e.detail.get("max_norm", e.detail.get("clip_value")) == c.given for e in c.placed)
    by_group = _clipped_by_group(refs.full, c.placed, model, len(run.passes)) if same else None
    if by_group is not None:
        c.target = by_group
        report.notes = [n for n in report.notes if not n.startswith("clipping:")]
        report.notes.append(
            f"clipping: your loop clips {len(c.placed)} group(s) of parameters on their own, once, "
            "after the last backward; the full batch is clipped the same way"
        )
    return c


def _measures_only(event: Event) -> bool:
    """A clip call whose threshold is infinite: it returns the norm and changes nothing."""
    value = event.detail.get("max_norm", event.detail.get("clip_value"))
    return isinstance(value, float) and math.isinf(value)


def _misplaced_clips(events: list[Event]) -> list[tuple[Event, str]]:
    """Clip calls that cannot have clipped what the optimizer applied: after the window's last optimizer step, or
    before the first backward pass (the buffer is still empty)."""
    steps = [i for i, e in enumerate(events) if e.kind in ("optimizer.step", "scaler.step")]
    out = []
    for i, e in enumerate(events):
        if e.kind != "clip":
            continue
        if steps and i > steps[-1]:
            out.append((e, "after the last optimizer.step()"))
        elif e.after == 0:
            out.append((e, "before the first backward pass, on an empty gradient"))
    return out


def _clipped_by_group(full: torch.Tensor, clips: list[Event], model: nn.Module, last: int) -> torch.Tensor | None:
    """The full-batch gradient clipped as the loop clips: each clip call on its own parameters, in order, when
    every call comes after the last backward pass and some call clips a subset (a layer, a parameter group);
    None otherwise (one call on every parameter is the plain case)."""
    sizes = [p.numel() for p in _trainable(model)]
    if not clips or any(e.after < last or "params" not in e.detail for e in clips):
        return None
    if len(clips) == 1 and _clips_all(clips[0], len(sizes)):
        return None
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + size)
    out = full.clone()
    for e in clips:
        value = e.detail.get("max_norm", e.detail.get("clip_value"))
        if value is None or not e.detail["params"]:
            return None
        index = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in e.detail["params"]])
        kind = "value" if e.detail.get("fn") == "clip_grad_value_" else "norm"
        out[index] = clip_vec(out[index], value, kind, e.detail.get("norm_type", 2.0))
    return out


def _clips_all(event: Event, count: int) -> bool:
    """Whether a clip call clipped every trainable parameter."""
    return sorted(event.detail.get("params", [])) == list(range(count))
