"""Chapter 6's appendix, "What practitioners meet": the data shapes where a mean of micro-batch means goes wrong,
the token count of a padding-free batch, counts under model parallelism, what the Transformers ``Trainer`` divides
by K, and the two-process demo of :mod:`gradaccum.book.ch06_ranks` (the count after the window, dropout seeds).

The book layer over :mod:`gradaccum.windows`; Transformers is imported inside the functions that use it.
"""

from __future__ import annotations

import copy
import random
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from gradaccum._tensors import relative_error
from gradaccum._validate import require_count, require_k
from gradaccum.accumulate import flat_grad, split_batch
from gradaccum.book.data import Vocab, encode_batch
from gradaccum.book.models import TinyLM
from gradaccum.windows import IGNORE, count_tokens, scale_grads, token_loss, token_mean_gradient, window_gradient

Batch = tuple[torch.Tensor, torch.Tensor]


def _stream(lines: Sequence[str], vocab: Vocab) -> list[int]:
    """The corpus as one stream of character ids (lines joined by a space)."""
    return vocab.encode(" ".join(lines))


def packed_batch(lines: Sequence[str], vocab: Vocab, rows: int, width: int, seed: int) -> Batch:
    """Pretraining-style packing: ``rows`` rows of ``width`` characters cut from the corpus stream at random
    offsets, every target labelled (each row holds ``width`` tokens)."""
    require_count(rows, "rows")
    require_count(width, "width", minimum=2)
    stream = _stream(lines, vocab)
    if width + 1 > len(stream):
        raise ValueError(f"width {width} exceeds the corpus stream of {len(stream)} characters.")
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(stream) - width, size=rows)
    x = torch.tensor([stream[s : s + width] for s in starts])
    y = torch.tensor([stream[s + 1 : s + width + 1] for s in starts])
    return x, y


def _sft_example(stream: list[int], rng: np.random.Generator, prompt: int, response: int) -> tuple[list, list]:
    """One example of ``prompt + response`` characters: its tokens and next-token targets, labelled only where the
    target is a response token (the prompt masked, and no target across the example's end)."""
    start = int(rng.integers(0, len(stream) - prompt - response))
    tokens = stream[start : start + prompt + response]
    labels = [tokens[j + 1] if prompt <= j + 1 < len(tokens) else IGNORE for j in range(len(tokens))]
    return tokens, labels


def sft_batch(
    lines: Sequence[str],
    vocab: Vocab,
    rows: int,
    width: int,
    seed: int,
    prompt: tuple[int, int] = (8, 40),
    response: tuple[int, int] = (8, 40),
) -> Batch:
    """Supervised fine-tuning, packed: rows of ``width`` characters filled with examples of a prompt (length
    uniform in ``prompt``) and a response (uniform in ``response``), cut from the corpus; only response tokens are
    labelled. The last example of a row is cut at the row's end."""
    require_count(rows, "rows")
    require_count(width, "width", minimum=2)
    stream, rng = _stream(lines, vocab), np.random.default_rng(seed)
    for name, (lo, hi) in (("prompt", prompt), ("response", response)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} lengths must be (lo, hi) with 1 <= lo <= hi, got {(lo, hi)!r}.")
    if prompt[1] + response[1] >= len(stream):
        raise ValueError(f"examples of up to {prompt[1] + response[1]} characters do not fit the corpus stream.")
    x = torch.empty(rows, width, dtype=torch.long)
    y = torch.empty(rows, width, dtype=torch.long)
    for r in range(rows):
        tokens: list[int] = []
        labels: list[int] = []
        while len(tokens) < width:
            p, q = (int(rng.integers(lo, hi + 1)) for lo, hi in (prompt, response))
            t, lab = _sft_example(stream, rng, p, q)
            tokens, labels = tokens + t, labels + lab
        x[r], y[r] = torch.tensor(tokens[:width]), torch.tensor(labels[:width])
    return x, y


def padded_batch(
    lines: Sequence[str], vocab: Vocab, rows: int, lengths: tuple[int, int], seed: int, sort: bool = False
) -> Batch:
    """One example per row, ``rows`` examples of length uniform in ``lengths`` cut from the corpus, right-padded to
    the longest (padding targets :data:`~gradaccum.windows.IGNORE`); sorted by length if ``sort`` (length-grouped
    micro-batches)."""
    require_count(rows, "rows")
    lo, hi = lengths
    if not 2 <= lo <= hi:
        raise ValueError(f"lengths must be (lo, hi) with 2 <= lo <= hi, got {lengths!r}.")
    text = " ".join(lines)
    rng = np.random.default_rng(seed)
    cut = []
    for n in rng.integers(lo, hi + 1, size=rows):
        start = int(rng.integers(0, len(text) - n))
        cut.append(text[start : start + int(n)])
    return encode_batch(sorted(cut, key=len) if sort else cut, vocab)


#: the data shapes of :func:`shape_study`: name → batch maker (lines, vocab, seed) of 32 rows — packed rows of 256
#: characters, packed SFT rows of 1,024 (prompts and responses of 16–96 characters), one example of 8–120 characters
#: per padded row
SHAPES: dict[str, Callable[[Sequence[str], Vocab, int], Batch]] = {
    "packed, every token labelled": lambda lines, vocab, seed: packed_batch(lines, vocab, 32, 256, seed),
    "packed SFT, prompts masked": lambda lines, vocab, seed: sft_batch(
        lines, vocab, 32, 1024, seed, prompt=(16, 96), response=(16, 96)
    ),
    "padded, shuffled": lambda lines, vocab, seed: padded_batch(lines, vocab, 32, (8, 120), seed),
    "padded, length-grouped": lambda lines, vocab, seed: padded_batch(lines, vocab, 32, (8, 120), seed, sort=True),
}


@dataclass(frozen=True)
class ShapeResult:
    """One data shape over seeds and K: the mean of means' relative gradient errors against the token mean, and
    the smallest and largest labelled-token count of a micro-batch."""

    errors: list[float]
    min_tokens: int
    max_tokens: int


def shape_study(
    model: nn.Module, lines: Sequence[str], vocab: Vocab, seeds: Sequence[int], ks: Sequence[int]
) -> dict[str, ShapeResult]:
    """For every shape of :data:`SHAPES`, each seed's batch and each K: the relative error of the mean of
    micro-batch means against the gradient of the window's token mean (:func:`gradaccum.windows.window_gradient`)."""
    out = {}
    for name, make in SHAPES.items():
        errors, counts = [], []
        for seed in seeds:
            x, y = make(lines, vocab, seed)
            reference = token_mean_gradient(model, x, y)
            for k in ks:
                errors.append(relative_error(window_gradient(model, x, y, k, "mean_of_means"), reference))
                counts += [count_tokens(yb) for _, yb in split_batch(x, y, k)]
        out[name] = ShapeResult(errors, min(counts), max(counts))
    return out


def sum_then_scale_gradient(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, k: int, clip: float | None = None, clip_first: bool = False
) -> torch.Tensor:
    """One process's window without a count before it (:func:`gradaccum.book.ch06_ranks.sum_then_scale`), on a
    copy; with ``clip``, ``clip_grad_norm_`` after the scaling, or before it (``clip_first``: on the summed
    gradients, the mistake)."""
    work = copy.deepcopy(model)
    work.zero_grad(set_to_none=True)
    tokens = 0
    for xb, yb in split_batch(x, y, k):
        token_loss(work(xb), yb, "sum").backward()
        tokens += count_tokens(yb)
    if clip is not None and clip_first:
        nn.utils.clip_grad_norm_(work.parameters(), clip)
    scale_grads(work, tokens)
    if clip is not None and not clip_first:
        nn.utils.clip_grad_norm_(work.parameters(), clip)
    return flat_grad(work).detach()


def replicated_gradient(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, k: int, dp: int, replicas: int, divide: bool
) -> torch.Tensor:
    """What ``dp`` data-parallel groups apply when each group has ``replicas`` ranks that see the same batch (a
    tensor-, context- or sequence-parallel group): every rank counts its batch's tokens, the counts are summed over
    all ``dp · replicas`` ranks (``replicas`` times the tokens), divided by ``replicas`` if ``divide``; each group
    backpropagates its summed loss and scales by dp / count; DDP averages over the dp groups. Simulated in one
    process (the replicas' computation is the group's)."""
    require_count(dp, "dp (data-parallel groups)")
    require_count(replicas, "replicas (ranks that share a batch)")
    shares = split_batch(x, y, dp)
    gathered = replicas * sum(count_tokens(ys) for _, ys in shares)
    count = gathered // replicas if divide else gathered
    grads = []
    for xs, ys in shares:
        work = copy.deepcopy(model)
        work.zero_grad(set_to_none=True)
        for xb, yb in split_batch(xs, ys, k):
            token_loss(work(xb), yb, "sum").backward()
        scale_grads(work, count, dp)
        grads.append(flat_grad(work).detach())
    return torch.stack(grads).mean(0)


@dataclass(frozen=True)
class RankDemo:
    """What :func:`rank_demo` measured on two processes."""

    errors: list[float]  # each rank's gradient against the one-process token mean
    own_tokens: list[int]
    total_tokens: int
    dropped_on_both: dict[str, float]  # share of rank 0's dropped units that rank 1 dropped too, per seeding
    dropped: float  # share of units rank 0 dropped (same seed)
    init_gap_before: float  # largest parameter difference between ranks, seeded with the rank added, before DDP
    init_gap_after: float  # the same after DDP wrapped the model


def rank_demo(model: nn.Module, x: torch.Tensor, y: torch.Tensor, k: int, world_size: int = 2) -> RankDemo:
    """Launch task ``"ch6"`` (:func:`gradaccum.book.ch06_ranks.rank_task`) on ``world_size`` gloo processes with
    ``model`` (a float64 ``TinyLM``) and the batch ``(x, y)`` shared between them."""
    from gradaccum.book.ddp_workers import launch

    if not isinstance(model, TinyLM):
        raise ValueError(f"rank_demo runs the book's TinyLM, got {type(model).__name__}.")
    require_k(k)
    vocab = model.out.out_features
    res = launch("ch6", world_size, timeout=120, x=x, y=y, k=k, state=model.state_dict(), vocab_size=vocab)
    reference = token_mean_gradient(model, x, y)
    both = {}
    for how in res[0]["masks"]:
        a, b = res[0]["masks"][how], res[1]["masks"][how]
        both[how] = float((a & b).sum() / a.sum())
    first = res[0]["masks"]
    return RankDemo(
        [relative_error(r["grad"], reference) for r in res],
        [r["own_tokens"] for r in res],
        res[0]["total_tokens"],
        both,
        float(next(iter(first.values())).float().mean()),
        float((res[0]["init_before_ddp"] - res[1]["init_before_ddp"]).abs().max()),
        float((res[0]["init_after_ddp"] - res[1]["init_after_ddp"]).abs().max()),
    )


# --------------------------------------------------------------------------------- Transformers


def trainer_count(batch: dict[str, torch.Tensor], shifts: bool = True) -> int:
    """The Trainer's count of one batch (``Trainer._get_num_items_in_batch``, transformers 5.23): the labels that
    are not -100, over ``shift_labels`` if the batch has them, else over ``labels[..., 1:]`` for a loss that
    shifts labels (causal LMs), else over ``labels``."""
    labels = batch.get("shift_labels")
    if labels is None:
        labels = batch["labels"][..., 1:] if shifts else batch["labels"]
    return int(labels.ne(IGNORE).sum())


def flattened_and_padded(examples: Sequence[Sequence[int]]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The same examples (token ids, every token its own label) collated by Transformers'
    ``DataCollatorWithFlattening`` (one row, no padding) and padded into rows (labels -100 on padding)."""
    from transformers.data.data_collator import DataCollatorWithFlattening

    features = [{"input_ids": list(e), "labels": list(e)} for e in examples]
    flat = DataCollatorWithFlattening()(features)
    width = max(len(e) for e in examples)
    ids = torch.zeros(len(examples), width, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    for i, e in enumerate(examples):
        ids[i, : len(e)] = torch.tensor(e)
        labels[i, : len(e)] = torch.tensor(e)
    return flat, {"input_ids": ids, "labels": labels}


class CausalLMForTrainer(nn.Module):
    """A ``TinyLM`` behind the interface of Transformers' causal LMs: ``forward(input_ids, labels, **kwargs)``
    returns ``{"loss", "logits"}``, the loss computed by Transformers' own ``ForCausalLMLoss`` (a mean, or the sum
    over ``num_items_in_batch`` when the Trainer passes it); ``loss_type = "ForCausalLM"``. With
    ``loss_kwargs=False`` it sets ``accepts_loss_kwargs = False``: the Trainer passes no count (and the forward would
    ignore one). ``ForCausalLMLoss``
    computes in float32 whatever the logits' type (``logits.float()``, ``transformers/loss/loss_utils.py`` line 61
    in 5.23), so gradients through it agree with float64 ones to about 1e-7."""

    loss_type = "ForCausalLM"

    def __init__(self, vocab_size: int, seed: int = 0, loss_kwargs: bool = True):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.lm = TinyLM(vocab_size).double()
        self.accepts_loss_kwargs = loss_kwargs

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, **kwargs: Any) -> dict[str, torch.Tensor]:
        from transformers.loss.loss_utils import ForCausalLMLoss

        logits = self.lm(input_ids)
        count = kwargs.get("num_items_in_batch") if self.accepts_loss_kwargs else None
        loss = ForCausalLMLoss(logits, labels, logits.shape[-1], num_items_in_batch=count)
        return {"loss": loss.to(logits.dtype), "logits": logits}


def _step_factor(
    trainer_cls: Any,
    args_cls: Any,
    out_dir: str,
    batch: dict[str, torch.Tensor],
    vocab_size: int,
    k: int,
    scaled: bool | None,
    loss_kwargs: bool,
) -> float:
    """One case of :func:`trainer_step_factors`: the norm of the gradient ``training_step`` leaves over the norm of
    the gradient of the loss the model returns."""
    count = torch.tensor(trainer_count(batch))
    model = CausalLMForTrainer(vocab_size, loss_kwargs=loss_kwargs)
    args = args_cls(
        output_dir=out_dir,
        gradient_accumulation_steps=k,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        average_tokens_across_devices=False,
    )
    trainer = trainer_cls(model=model, args=args)
    trainer.loss_is_scaled_for_ga = scaled
    trainer.current_gradient_accumulation_steps = k  # what train() sets: the batches of this window
    model.zero_grad(set_to_none=True)
    trainer.training_step(model, dict(batch), num_items_in_batch=count)
    applied = flat_grad(model).detach().clone()
    model.zero_grad(set_to_none=True)
    model(**batch, num_items_in_batch=count)["loss"].backward()
    return float(applied.norm() / flat_grad(model).norm())


def trainer_step_factors(batch: dict[str, torch.Tensor], vocab_size: int, k: int = 4) -> dict[str, float]:
    """How the Trainer's ``training_step`` scales one micro-batch's gradient (as a multiple of the gradient of
    the loss the model returns), with ``gradient_accumulation_steps = k`` and the window's count passed, for:
    the default ``loss_is_scaled_for_ga = None`` with a model that takes loss kwargs and one that does not, and the
    attribute set to ``True`` and ``False``. Runs one process on the CPU; the random state is put back (the
    Trainer seeds ``random``, NumPy and torch when it is built)."""
    from transformers import Trainer, TrainingArguments

    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cases = {
        "None, loss kwargs": (None, True),
        "None, no loss kwargs": (None, False),
        "True": (True, True),
        "False": (False, True),
    }
    factors = {}
    try:
        with tempfile.TemporaryDirectory() as out_dir:
            for name, (scaled, kwargs) in cases.items():
                factors[name] = _step_factor(Trainer, TrainingArguments, out_dir, batch, vocab_size, k, scaled, kwargs)
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
    return factors
