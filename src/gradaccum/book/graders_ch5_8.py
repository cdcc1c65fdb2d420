"""The exercise checkers of chapters 5–8 (no_sync, loss normalization, frameworks, beyond BatchNorm); each
names the slip behind a typical wrong answer. Read them through :mod:`gradaccum.book.exercises`.
"""

from __future__ import annotations

import math
import numbers

import torch

from gradaccum._validate import (
    require_count,
    require_k,
    require_momentum,
    require_nonnegative,
    require_partial,
    require_positive,
)
from gradaccum.book.grading import Feedback, Reveals, grade_number

# --------------------------------------------------------------------------------------- chapter 5


def grade_allreduce_calls(answer: object, k: int = 8, buckets: int = 3) -> Feedback:
    """Exercise: all-reduce calls per optimizer step under naive accumulation (DDP, ``buckets`` buckets)."""
    require_k(k)
    require_count(buckets, "buckets")
    if isinstance(answer, (tuple, list)) and len(answer) == 2:
        return Feedback(
            False,
            f"give one number, the count without no_sync(), not {answer!r}: the count with "
            "no_sync() is the second question, for you to check against the solution.",
        )
    return grade_number(
        answer,
        float(k * buckets),
        mistakes=[
            (float(k), "each backward pass all-reduces every *bucket*, not the model as one message."),
            (
                float(1 + (k - 1) * buckets),
                "that is the very first step, whose first backward still has all "
                "parameters in one bucket (with find_unused_parameters=False); from the "
                "second step on every synchronized backward all-reduces each bucket.",
            ),
            (float(buckets), "that is the count with no_sync: one synchronized backward per step."),
            (1.0, "DDP all-reduces once per bucket per synchronized backward pass."),
            (
                float(k * (buckets + 1)),
                "that also counts the all-reduce of the map of used parameters "
                "(find_unused_parameters=True, one per synchronized backward): the question "
                "counts gradient all-reduces, one per bucket.",
            ),
            (
                float((k - 1) * buckets),
                "that is how many no_sync saves; without it each of the K backward passes all-reduces every bucket.",
            ),
            (
                float(2 + (k - 2) * buckets),
                "that is the very first step with static_graph=True, whose first two "
                "synchronized backward passes use one bucket; from the second step on "
                "every synchronized backward all-reduces each bucket.",
            ),
        ],
        hint="Count synchronized backward passes per step, and messages per backward pass.",
        count=True,
    )


def grade_ring_bytes(answer: object, p: int = 8, megabytes: float = 100.0) -> Feedback:
    """Exercise: megabytes each rank sends in a ring all-reduce of ``megabytes`` of gradients over p ranks."""
    require_count(p, "p (the number of ranks)", minimum=2)
    require_positive(megabytes, "megabytes")
    return grade_number(
        answer,
        2 * (p - 1) / p * megabytes,
        mistakes=[
            (megabytes, "a ring all-reduce is a reduce-scatter *and* an all-gather: each sends (p−1)/p of the data."),
            ((p - 1) / p * megabytes, "that is one of the two phases; the all-gather sends as much again."),
            (2 * (p - 1) * megabytes, "each round sends a 1/p chunk, not the whole buffer."),
            (2 * megabytes, "“almost 2n” is the limit for many ranks; with p ranks it is exactly 2(p − 1)/p · n."),
            (
                2 * (p - 1) / p * megabytes * 1e6,
                "right amount, wrong unit: the question asks for megabytes, not bytes.",
            ),
            (
                2 * (p - 1) / p * megabytes / 1e3,
                "right amount, wrong unit: the question asks for megabytes, not gigabytes.",
            ),
        ]
        + (
            [(2 * (p - 1) / p, f"that is the factor 2(p − 1)/p alone; multiply it by the {megabytes:g} MB.")]
            if megabytes != 1
            else []
        ),
        hint="2(p − 1) rounds, each sending one chunk of n/p.",
    )


def grade_nosync_saving(
    answer: object, k: int = 8, p: int = 8, megabytes: float = 100.0, gb_per_s: float = 10.0
) -> Feedback:
    """Exercise: milliseconds per optimizer step that no_sync saves (α–β model, latency and copies ignored)."""
    require_k(k)
    require_count(p, "p (the number of ranks)", minimum=2)
    require_positive(megabytes, "megabytes")
    require_positive(gb_per_s, "gb_per_s")
    one = 2 * (p - 1) / p * megabytes / gb_per_s  # ms per ring all-reduce (MB / (GB/s) is ms)
    k_slip = "no_sync saves K − 1 all-reduces, not K: one remains at the end of the window."
    large_p = (
        f"the ring sends 2(p − 1)/p · n = {2 * (p - 1) / p:g} n per all-reduce at p = {p}, not the large-p limit 2n."
    )
    two_n = (k - 1) * 2 * megabytes / gb_per_s
    # at K = p the two slips give the same number: name both
    both = math.isclose(k * one, two_n, rel_tol=1e-9)
    return grade_number(
        answer,
        (k - 1) * one,
        mistakes=[
            (
                k * one,
                f"either {k_slip[0].lower()}{k_slip[1:]} Or {large_p[0].lower()}{large_p[1:]} (Both slips "
                f"give this number here.)"
                if both
                else k_slip,
            ),
            (two_n, large_p),
            (one, "that is one all-reduce; no_sync saves K − 1 of them per step."),
            ((k - 1) * megabytes / gb_per_s, "a ring all-reduce sends 2(p − 1)/p · n bytes, not n."),
            ((k - 1) * one / 2, "a ring all-reduce has two phases (reduce-scatter and all-gather): 2(p − 1)/p · n."),
            (
                (k - 1) * one / 1000,
                "right number, wrong unit: that is in seconds; the answer is asked in milliseconds.",
            ),
        ],
        hint="(K − 1) · 2(p − 1)/p · n / β.",
    )


# --------------------------------------------------------------------------------------- chapter 6


def grade_window_token_loss(
    answer: object, sums: tuple[float, ...] = (30.0, 10.0), tokens: tuple[int, ...] = (100, 10)
) -> Feedback:
    """Exercise: the loss of a window whose micro-batches have summed token losses ``sums`` over ``tokens``."""
    if len(sums) != len(tokens) or len(sums) < 2:
        raise ValueError(
            f"give one summed loss and one token count per micro-batch, at least two of each; got "
            f"{len(sums)} sums and {len(tokens)} counts."
        )
    for n in tokens:
        require_count(n, "every micro-batch's token count")
    for s_ in sums:
        require_nonnegative(s_, "a summed token loss")
    mean_of_means = sum(s / n for s, n in zip(sums, tokens)) / len(sums)
    fewest, most = min(tokens), max(tokens)
    weights = (
        f"it weighs each of the {fewest} tokens of the shortest micro-batch {most / fewest:.3g} times as "
        f"much as a token of the longest."
        if fewest < most
        else "here every micro-batch holds as many tokens, so it happens to agree; it does not in general."
    )
    return grade_number(
        answer,
        sum(sums) / sum(tokens),
        mistakes=[
            (mean_of_means, f"that is the mean of the micro-batch means: {weights}"),
            (sum(sums), "divide by the number of tokens."),
            (sum(sums) / len(sums), "divide by tokens, not by micro-batches."),
            (
                mean_of_means * len(sums),
                "that is the sum of the micro-batch means (each divided by its own tokens, "
                "never by K); the window's loss divides the total by the window's "
                "tokens.",
            ),
        ],
        hint="Total loss over total tokens.",
    )


def grade_warmup_end(answer: object, warmup: int = 1000, k: int = 8) -> Feedback:
    """Exercise: the optimizer step after which a ``warmup``-step warmup has been counted when the scheduler steps
    once per micro-batch: ⌈warmup / K⌉ (each optimizer step counts K schedule steps)."""
    require_count(warmup, "warmup (schedule steps)")
    require_k(k)
    mistakes = [
        (float(warmup), "that is where it should end; the scheduler here advances K times per optimizer step."),
        (float(warmup * k), "the scheduler runs *faster*, not slower: K steps of the schedule per optimizer step."),
    ]
    if warmup % k:
        mistakes.append(
            (
                float(warmup // k),
                f"after {warmup // k} optimizer steps the schedule has counted "
                f"{warmup // k * k} < {warmup} steps: round up.",
            )
        )
    end = -(-warmup // k)
    if end + 1 not in (warmup, warmup * k):
        uses = (
            f"{end + 1} can be the first optimizer step that *uses* the full rate (depending on the schedule's "
            "convention and on the order of the window's optimizer and scheduler steps); "
        )
        steps = f"its {warmup} step{'s' if warmup != 1 else ''}"
        mistakes.append(
            (
                float(end + 1),
                Reveals(
                    f"{uses}the schedule has *counted* {steps} after {end}.",
                    course=f"{uses}the question asks after which optimizer step the schedule has *counted* {steps}.",
                ),
            )
        )
    return grade_number(
        answer,
        float(end),
        mistakes=mistakes,
        hint="Each optimizer step advances the schedule by K; count whole optimizer steps.",
        count=True,
    )


def grade_partial_scale(answer: object, present: int = 3, k: int = 16) -> Feedback:
    """Exercise: the factor by which a last window of ``present`` micro-batches is too small when divided by K."""
    require_k(k)
    require_partial(present, k)
    return grade_number(
        answer,
        present / k,
        mistakes=[
            (
                k / present,
                "upside down: that is how many times smaller the gradient is; the question asks for the "
                "fraction that remains.",
            ),
            (1.0, "the last window holds fewer than K micro-batches but is still divided by K."),
            ((k - present) / k, "that is the share that is *missing*; the question asks for the factor that remains."),
        ]
        + (
            [(present / 8, f"that is {present}/8, the chapter's study (K = 8); here K = {k}.")]
            if k != 8 and present / 8 < 1
            else []
        ),
        hint="Sum of `present` terms, each divided by K, against the mean of those terms.",
    )


# --------------------------------------------------------------------------------------- chapter 7


def grade_accelerate_warmup_end(answer: object, warmup: int = 600, processes: int = 8, k: int = 4) -> Feedback:
    """Exercise: the optimizer step at which a ``warmup``-step warmup, prepared by Accelerate on ``processes``
    processes (``split_batches=False``) with ``k`` accumulation steps, reaches its peak: ⌈warmup / processes⌉."""
    require_count(warmup, "warmup (schedule steps)")
    require_count(processes, "processes")
    require_k(k)
    rounded_down = (
        [
            (
                float(warmup // processes),
                f"after {warmup // processes} optimizer steps the schedule has "
                f"counted {warmup // processes * processes} < {warmup} steps: round "
                "up.",
            )
        ]
        if warmup % processes
        else []
    )
    return grade_number(
        answer,
        float(-(-warmup // processes)),
        mistakes=rounded_down
        + [
            (
                float(warmup),
                "that is where it would end in one process; the prepared scheduler steps num_processes "
                "times per optimizer step.",
            ),
            (float(warmup * processes), "the schedule runs *faster* on several processes, not slower."),
            (
                warmup / (processes * k),
                "the prepared scheduler does not step on micro-batches that only accumulate: K does not enter.",
            ),
            (
                warmup / k,
                "K does not enter (the prepared scheduler skips accumulation steps); the number of processes does.",
            ),
        ],
        hint="Count the calls that reach the wrapped scheduler per optimizer step.",
        count=True,
    )


def grade_framework_partial_weight(answer: object, micro_batches: int = 90, k: int = 16) -> Feedback:
    """Exercise: the weight Lightning gives the last (partial) window of an epoch of ``micro_batches``
    micro-batches with ``accumulate_grad_batches = k``: its gradient over the mean gradient of its micro-batches."""
    require_k(k)
    require_count(micro_batches, "micro_batches")
    if not 0 < micro_batches % k:
        raise ValueError(
            f"{micro_batches} micro-batches fill windows of {k} exactly: pick a count that leaves a partial window."
        )
    present = micro_batches % k
    return grade_number(
        answer,
        present / k,
        mistakes=[
            (
                1.0,
                "that is what the Transformers Trainer and the timm-style loop do (they divide by the micro-batches "
                "present); Lightning divides every loss by accumulate_grad_batches.",
            ),
            ((k - present) / k, "that is the share that is *missing*; the question asks for the weight."),
            (k / present, "upside down: that is how many times too small the step is."),
            (micro_batches / k, "that is how many windows the epoch holds, not the last one's weight."),
        ],
        hint="How many micro-batches does the last window hold, and what does each loss get divided by?",
    )


def grade_accelerate_token_factor(
    answer: object,
    rank_tokens: tuple[tuple[int, ...], ...] = ((30, 50, 20, 40), (40, 40, 10, 30)),
) -> Feedback:
    """Exercise: the factor by which Accelerate's token recipe multiplies a micro-batch's summed token loss, for
    one window of K micro-batches per process with the given target-token counts (``rank_tokens[p][k]``)."""
    if (
        not isinstance(rank_tokens, (tuple, list))
        or not rank_tokens
        or not all(isinstance(r, (tuple, list)) and r for r in rank_tokens)
    ):
        raise ValueError("give one tuple of token counts per process, each with at least one micro-batch.")
    k, processes = len(rank_tokens[0]), len(rank_tokens)
    if any(len(r) != k for r in rank_tokens) or any(
        isinstance(t, bool) or not isinstance(t, int) or t < 1 for r in rank_tokens for t in r
    ):
        raise ValueError(
            "give every process the same number of micro-batches, each with a whole number (>= 1) of tokens."
        )
    total = sum(sum(r) for r in rank_tokens)
    own = sum(rank_tokens[0])
    return grade_number(
        answer,
        k * processes / total,
        mistakes=[
            (
                1 / total,
                "that would be right if nothing divided afterwards, but Accelerate's backward divides by K "
                "and DDP averages over the processes: the recipe multiplies by K · num_processes.",
            ),
            (k / total, "DDP averages the gradients over the processes: multiply by num_processes too."),
            (processes / total, "Accelerate's backward divides every loss by K: multiply by K too."),
            (
                k * processes / own,
                "count the tokens of *all* processes' micro-batches (the recipe gathers the "
                "counts), not only this process's.",
            ),
            (k / own, "count the tokens of all processes (gather), and multiply by K · num_processes."),
        ],
        hint="The recipe: summed loss × K × num_processes / (tokens of the whole window, all processes).",
    )


# --------------------------------------------------------------------------------------- chapter 8


def grade_negatives_per_sample(answer: object, k: int = 12, b: int = 7) -> Feedback:
    """Exercise: in-batch negatives each sample sees under plain accumulation of ``k`` micro-batches of ``b``."""
    require_k(k)
    require_count(b, "b (pairs per micro-batch)", minimum=2)
    return grade_number(
        answer,
        float(b - 1),
        mistakes=[
            (
                float(k * b - 1),
                "that is what the full batch gives; plain accumulation computes the loss inside each micro-batch.",
            ),
            (float(b), "the sample's own partner is its positive, not a negative."),
            (float(k * b), "that counts the whole window, positive included; the loss sees one micro-batch."),
            (float(k - 1), "negatives come from the other samples of the micro-batch, not from other micro-batches."),
            *(
                [
                    (
                        float(k),
                        "that is K, the number of micro-batches"
                        + (
                            " (and, here, also NT-Xent's count 2(b − 1), both views of every other sample)"
                            if k == 2 * (b - 1)
                            else ""
                        )
                        + "; the negatives are the other documents of one micro-batch.",
                    )
                ]
                if k not in (b - 1, k * b - 1, b, k * b, k - 1)
                else []
            ),
            *(
                [
                    (
                        float(2 * (b - 1)),
                        "that is NT-Xent's count (both views of every other sample); this exercise is "
                        "one-directional InfoNCE over query–document pairs: the other documents of "
                        "the micro-batch.",
                    )
                ]
                if 2 * (b - 1) not in (b - 1, k * b - 1, b, k * b, k - 1, k)
                else []
            ),
            *(
                [
                    (
                        float(2 * (k * b - 1)),
                        "that is NT-Xent's count over the full batch; this is one-directional "
                        "InfoNCE within one micro-batch.",
                    )
                ]
                if 2 * (k * b - 1) not in (b - 1, k * b - 1, b, k * b, k - 1, k, 2 * (b - 1))
                else []
            ),
        ],
        hint="Which samples share a softmax with a given sample under plain accumulation?",
        count=True,
    )


def grade_recompute_momentum(answer: object, m: float = 0.02, k: int = 5) -> Feedback:
    """Exercise: the effective BatchNorm momentum per optimizer step under activation checkpointing."""
    require_k(k)
    require_momentum(m)
    return grade_number(
        answer,
        1 - (1 - m) ** (2 * k),
        mistakes=[
            (1 - (1 - m) ** k, "that is accumulation without checkpointing: the rerun updates the statistics again."),
            (1 - (1 - m) ** 2, "that is per micro-batch; an optimizer step has K of them."),
            (2 * k * m, "that is the first-order approximation; compound the 2K updates: 1 − (1 − m)^(2K)."),
            (
                (1 - m) ** (2 * k),
                "that is the weight the old statistics keep after the 2K updates; the new ones get 1 minus that.",
            ),
            (m, "the momentum applies per forward pass, and there are 2K of them per step."),
        ],
        hint="Each forward in training mode multiplies the old value's weight by (1 − m). How many per step?",
    )


def _numbers(values: object, name: str) -> tuple[object, ...]:
    """``values`` (a list, tuple, NumPy array or tensor) as a tuple of its entries; anything else is refused."""
    tolist = getattr(values, "tolist", None)
    if callable(tolist) and not isinstance(values, (list, tuple)):
        values = tolist()
    if not isinstance(values, (list, tuple)):
        raise ValueError(
            f"{name} must be a sequence of numbers, one per expert, got {type(values).__name__} {values!r}."
        )
    return tuple(v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v for v in values)


def grade_switch_aux(
    answer: object, fractions: tuple[float, ...] = (0.75, 0.25), probs: tuple[float, ...] = (0.6, 0.4)
) -> Feedback:
    """Exercise: the Switch load-balancing loss N Σ f_i P_i for given fractions and mean probabilities."""
    fractions, probs = _numbers(fractions, "fractions"), _numbers(probs, "probs")  # type: ignore[assignment]
    if len(fractions) != len(probs) or not fractions:
        raise ValueError("give one fraction and one mean probability per expert.")
    for name, values in (("fractions", fractions), ("probs", probs)):
        if (
            any(isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v < 0 for v in values)
            or not abs(sum(values) - 1) <= 1e-6
        ):
            raise ValueError(f"{name} must be finite non-negative numbers summing to 1, got {tuple(values)}.")
    fractions, probs = tuple(float(v) for v in fractions), tuple(float(v) for v in probs)
    n = len(fractions)
    # 12 significant digits: binary noise (1.0999999999999999 for 1.1) would make 1.09 read as a truncation
    value = float(f"{n * math.fsum(f * p for f, p in zip(fractions, probs)):.12g}")
    swapped = float(f"{n * math.fsum(f * p for f, p in zip(fractions, reversed(probs))):.12g}")
    return grade_number(
        answer,
        value,
        # the swapped pairing before 1: near-balanced routers put it next to 1 (0.995 is a swap, not a "1")
        mistakes=[
            (value / n, "multiply by the number of experts N: a perfectly balanced router then scores 1."),
            *(
                [(swapped, "that pairs each expert's fraction with another expert's probability: f_i goes with P_i.")]
                if n == 2 and swapped not in (value, value / n, 1.0)
                else []
            ),
            (1.0, "1 is the value of a perfectly balanced router; this one is not balanced."),
        ],
        hint="N Σ_i f_i P_i.",
    )
