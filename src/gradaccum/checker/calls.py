"""The fingerprints read from the recorded calls: optimizer, scheduler and GradScaler steps, unscale_ and zero_grad
inside the window, micro-batches the forward passes did not see; see :mod:`.rules`."""

from __future__ import annotations

from .measure import (
    Measurements,
    _after,
    _counts,
    _inside,
    _most_per,
)
from .report import (
    CLIP_FIX,
    CLIP_PER_MICRO,
    CLIP_RUNNING,
    _Findings,
    num,
    nums,
)
from .weights import (
    _trace_per_micro,
)


def _event_findings(m: Measurements, out: _Findings, last: int) -> None:
    """The findings read from the recorded calls, in the order a report lists them (``last``: backward passes)."""
    _step_call_findings(m, out, last)
    _scaler_call_findings(m, out, last)
    _clip_call_findings(m, out, last)
    _average_findings(m, out, last)
    _seed_findings(m, out)
    foreign = [e for e in _counts(m.events, "optimizer.step") if not e.detail.get("owns_params", True)]
    if foreign:
        out.add(
            "optimizer_not_on_model",
            "your step steps an optimizer that holds none of the model's parameters",
            "the checker runs your step on a copy of the model; an optimizer built outside step holds the "
            "original's parameters",
            "build the optimizer (and scheduler) inside step from model.parameters(), or leave them out of step",
            None,
            "note",
        )


def _step_call_findings(m: Measurements, out: _Findings, last: int) -> None:
    """optimizer.step(), scaler.step() and scheduler.step() more than once per window, or before its last backward."""
    events, k = m.events, m.k
    own = [e for e in _counts(events, "optimizer.step") if not e.detail.get("via_scaler")]
    sstep = _counts(events, "scaler.step")
    # several optimizers (one per parameter group, e.g. Muon beside AdamW) each step once per window, with one
    # scheduler each and one GradScaler for all: counted per optimizer (per scheduler)
    if _most_per(own, "opt") > 1 or _inside(own, last):
        out.add(
            "optimizer_step_inside_window",
            "optimizer.step() inside the accumulation window",
            f"optimizer.step() ran {len(own)}× in one window of {k} micro-batches "
            f"({', '.join(_after(e) for e in own[:4])}{', …' if len(own) > 4 else ''}): every call applies a "
            "partial gradient and the later micro-batches see changed weights",
            "step the optimizer once per window, after the last micro-batch's backward",
            6,
        )
    if _most_per(sstep, "opt") > 1 or _inside(sstep, last):
        out.add(
            "scaler_step_inside_window",
            "scaler.step() (an optimizer step) inside the accumulation window",
            f"scaler.step(optimizer) ran {len(sstep)}× in one window of {k} micro-batches "
            f"({', '.join(_after(e) for e in sstep[:4])}); after an overflow only that micro-batch's step "
            "is skipped",
            "scaler.step(optimizer) and scaler.update() once per window, after the last backward",
            4,
        )
    sched = _counts(events, "scheduler.step")
    if _most_per(sched, "sched") > 1 or _inside(sched, last):
        out.add(
            "scheduler_step_inside_window",
            "scheduler.step() inside the accumulation window",
            f"{len(sched)} scheduler step(s) in one window of {k} micro-batches "
            f"({', '.join(_after(e) for e in sched[:4])}{', …' if len(sched) > 4 else ''}; the step a "
            "scheduler's constructor makes is not counted): warmup and decay run up to "
            f"{k}× too fast",
            "step the scheduler once per optimizer step, after it",
            6,
        )


def _scaler_call_findings(m: Measurements, out: _Findings, last: int) -> None:
    """scaler.update() and scaler.unscale_() more than once per window, or before its last backward."""
    events = m.events
    updates = _counts(events, "scaler.update")
    if (len(updates) > 1 or _inside(updates, last)) and m.error is None:
        scales = [p.scale for p in m.passes if p.scale is not None]
        changed = f"; loss scale at each backward {nums(scales)}" if len(set(scales)) > 1 else ""
        out.add(
            "scaler_update_inside_window",
            "scaler.update() inside the window: the loss scale changes inside the window",
            f"scaler.update() called {len(updates)}×, {len(_inside(updates, last))} before the last backward{changed}",
            "call scaler.update() once per window, after scaler.step()",
            4,
        )
    unscales = _counts(events, "scaler.unscale_")
    if (_most_per(unscales, "opt") > 1 or _inside(unscales, last)) and "scaler_unscale_inside_window" not in out:
        out.add(
            "scaler_unscale_inside_window",
            "scaler.unscale_() inside the window",
            f"unscale_() called {len(unscales)}×, {len(_inside(unscales, last))} before the last backward",
            "unscale_ once, after the last backward, then clip, then scaler.step",
            4,
        )


def _clip_call_findings(m: Measurements, out: _Findings, last: int) -> None:
    """A clip before unscale_, and a clip inside the window (on the running buffer or per micro-batch)."""
    clips = _counts(m.events, "clip")
    scaled = [e for e in clips if e.detail.get("scaled")]
    if scaled:
        e = scaled[0]
        seen = e.detail.get("norm_before", float("nan"))
        out.add(
            "clip_before_unscale",
            "clipping before scaler.unscale_(): the threshold is applied to scaled gradients",
            f"{e.detail.get('fn', 'clip')} ran {_after(e)} on gradients still multiplied by the "
            f"loss scale (it saw a norm of {num(seen)}) and scaled them by {num(e.detail.get('factor', 1.0))}",
            "call scaler.unscale_(optimizer) first, then clip, then scaler.step(optimizer)",
            3,
        )
    inside = [e for e in clips if e.after < last]
    if inside:
        # the placement: per micro-batch when the buffer held one micro-batch only at each clip
        per_micro = _trace_per_micro(m, inside)
        factors = [e.detail.get("factor", 1.0) for e in inside]
        bites = any(abs(f - 1) > 1e-12 for f in factors)
        by_value = all(e.detail.get("fn") == "clip_grad_value_" for e in inside)
        effect = (
            (
                f"it clipped entries of the gradient (its norm changed by {nums(factors[:6])}×)"
                if by_value
                else f"it scaled the gradient by {nums(factors[:6])}"
            )
            if bites
            else "it did not change this window's gradient (every norm was below the threshold) but will when "
            "gradients grow"
        )
        evidence = (
            f"{len(clips)} clip call(s), {len(inside)} before the last backward "
            f"({', '.join(_after(e) for e in inside[:4])}); {effect}"
        )
        if per_micro:
            out.add("clip_per_micro_batch", CLIP_PER_MICRO, evidence, CLIP_FIX, 3)
        else:
            out.add("clip_running_buffer", CLIP_RUNNING, evidence, CLIP_FIX, 3)
        out.value_clip_bit = out.value_clip_bit or (bites and by_value)


def _average_findings(m: Measurements, out: _Findings, last: int) -> None:
    """A model average (``AveragedModel.update_parameters``, or an EMA written by hand) updated between backward
    passes: once per micro-batch instead of once per optimizer step."""
    updates = _counts(m.events, "average.update")
    if not any(0 < e.after < last for e in updates):
        return
    names = sorted({str(e.detail.get("cls")).strip("()") for e in updates})
    out.add(
        "ema_per_micro_batch",
        "a model average (EMA or SWA) updated per micro-batch, not once per optimizer step",
        f"{' and '.join(names)}: updated {len(updates)}× in one window of {m.k} micro-batches "
        f"({', '.join(_after(e) for e in updates[:4])}{', …' if len(updates) > 4 else ''}): the average moves "
        f"up to {m.k}× as often as the weights, towards weights the step has not made yet",
        "update the average once per optimizer step, after optimizer.step(); if the batch per step grew "
        "κ-fold, use the decay ρ^κ (Busbridge et al. 2023, How to Scale Your EMA)",
        None,
    )


def _seed_findings(m: Measurements, out: _Findings) -> None:
    """The RNG re-seeded inside the window (the masks repeat), or a seed set in a window that draws nothing."""
    events = m.events
    if m.reseeded is not None and m.reseeded[0] > 0:
        same, compared = m.reseeded
        seeds = _counts(events, "seed")
        calls = (
            f"; seeding calls in the window: {len(seeds)} ({', '.join(_after(e) for e in seeds[:4])})" if seeds else ""
        )
        out.add(
            "rng_reseeded",
            "the RNG is re-seeded inside the window",
            f"{same} of {compared} random draws (dropout masks) were identical when the window started from two "
            f"different random states{calls}: the masks repeat from window to window",
            "seed once, at the start of training; never inside the accumulation loop",
            6,
        )
    elif _counts(events, "seed") and m.random_draws == 0:
        out.add(
            "seed_inside_window",
            "a seed is set inside the window",
            f"{len(_counts(events, 'seed'))} seeding "
            "call(s); this window draws no random numbers, so nothing repeats yet",
            "seed once, at the start of training (dropout added later would repeat its masks)",
            6,
            "note",
        )
