"""Models, data and training loops the checker's tests run on: loops the book did not write for it.

Families: an MLP with two dropout layers; a CNN with BatchNorm (and the same CNN with GroupNorm); a
transformer-style block (LayerNorm, multi-head attention with dropout, an MLP with dropout); a padded character
language model with a functional token loss (a lambda around ``F.cross_entropy(..., ignore_index=-100)``).

Loops are written the way people write them: ``x.chunk``, index tensors and copies, optimizers and schedulers built
inside the step, ``clip_grad_norm_`` imported by name, ``GradScaler``. Each bug loop lists the finding codes the
checker must name.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import (
    clip_grad_norm_,  # imported by name, before the checker exists
)

from gradaccum.book.models import make_cnn

K = 4
IGNORE = -100


# --------------------------------------------------------------------------------------------- models


def mlp(seed: int = 0, p: float = 0.2, hidden: int = 32) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(
            nn.Flatten(),
            nn.Linear(64, hidden),
            nn.ReLU(),
            nn.Dropout(p),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Dropout(p),
            nn.Linear(hidden, 10),
        ).double()


class Block(nn.Module):
    """A pre-norm transformer block over the 8 rows of a digit (8 tokens of 8 pixels), mean-pooled."""

    def __init__(self, d: int = 16, heads: int = 2, p: float = 0.1):
        super().__init__()
        self.embed = nn.Linear(8, d)
        self.pos = nn.Parameter(torch.randn(8, d) * 0.1)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, dropout=p, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Dropout(p), nn.Linear(2 * d, d))
        self.drop = nn.Dropout(p)
        self.head = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x.reshape(x.shape[0], 8, 8)) + self.pos
        a = self.ln1(h)
        h = h + self.drop(self.attn(a, a, a, need_weights=False)[0])
        h = h + self.mlp(self.ln2(h))
        return self.head(h.mean(1))


def block(seed: int = 0, p: float = 0.1) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Block(p=p).double()


class CharLM(nn.Module):
    """Embedding → causal convolution over the last 3 tokens → GELU → dropout → vocabulary logits (N, T, V)."""

    def __init__(self, vocab: int = 20, d: int = 16, p: float = 0.1):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.conv = nn.Conv1d(d, d, 3)
        self.drop = nn.Dropout(p)
        self.out = nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.pad(self.embed(x).transpose(1, 2), (2, 0))
        return self.out(self.drop(F.gelu(self.conv(h).transpose(1, 2))))


def char_lm(seed: int = 0, p: float = 0.1) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return CharLM(p=p).double()


def token_loss(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), t.reshape(-1), ignore_index=IGNORE)


#: The functional loss the issue reported as missed: a lambda, not an nn.CrossEntropyLoss instance.
LAMBDA_TOKEN_LOSS = lambda out, t: F.cross_entropy(  # noqa: E731
    out.reshape(-1, out.shape[-1]), t.reshape(-1), ignore_index=-100
)


def lm_batch(lengths: list[int], t: int = 12, vocab: int = 20, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded sequences with the given lengths; targets of padding positions are -100."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.zeros(len(lengths), t, dtype=torch.long)
    y = torch.full((len(lengths), t), IGNORE, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids = torch.randint(1, vocab, (n + 1,), generator=gen)
        x[i, :n], y[i, :n] = ids[:-1], ids[1:]
    return x, y


#: 16 sequences whose micro-batches of 4 all hold 30 tokens (padding differs between sequences).
EQUAL_TOKENS = [12, 9, 6, 3, 3, 12, 9, 6, 6, 3, 12, 9, 9, 6, 3, 12]
#: 16 sequences sorted by length (length-grouped batching): micro-batches hold 10, 22, 34 and 46 tokens.
SORTED_TOKENS = [1, 2, 3, 4, 4, 5, 6, 7, 7, 8, 9, 10, 10, 11, 12, 12]


def family(name: str, digits) -> tuple[nn.Module, object, torch.Tensor, torch.Tensor]:
    """(model, loss_fn, x, y) of one family."""
    x, y = digits.x_train[:32], digits.y_train[:32]
    ce = nn.CrossEntropyLoss()
    if name == "mlp":
        return mlp(), ce, x, y
    if name == "cnn_bn":
        return make_cnn("batch"), ce, x, y
    if name == "cnn_gn":
        return make_cnn("group"), ce, x, y
    if name == "block":
        return block(), ce, x, y
    if name == "lm":
        tx, ty = lm_batch(EQUAL_TOKENS)
        return char_lm(), LAMBDA_TOKEN_LOSS, tx, ty
    if name == "lm_sorted":
        tx, ty = lm_batch(SORTED_TOKENS)
        return char_lm(), LAMBDA_TOKEN_LOSS, tx, ty
    raise ValueError(name)


FAMILIES = ("mlp", "cnn_bn", "cnn_gn", "block", "lm")
HAS_DROPOUT = {"mlp", "block", "lm", "lm_sorted"}
#: What a family adds to every loop's findings (BatchNorm couples samples whatever the loop does).
FAMILY_CODES = {"cnn_bn": {"batch_coupled_layer"}}


# ---------------------------------------------------------------------------------------------- loops


def correct_plain(model, loss_fn, x, y, k):
    for xb, yb in zip(x.chunk(k), y.chunk(k)):
        (loss_fn(model(xb), yb) / k).backward()


def correct_divide_at_end(model, loss_fn, x, y, k):
    for xb, yb in zip(x.chunk(k), y.chunk(k)):
        loss_fn(model(xb), yb).backward()
    for p in model.parameters():
        p.grad /= k


def correct_index_copies(model, loss_fn, x, y, k):
    b = x.shape[0] // k
    for i in range(k):
        idx = torch.arange(i * b, (i + 1) * b)
        xb, yb = x[idx].clone(), y[idx].clone()
        loss = loss_fn(model(xb), yb) * (1.0 / k)
        loss.backward()


def correct_whole_iteration(model, loss_fn, x, y, k):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=100)  # steps once when built
    opt.zero_grad(set_to_none=True)
    for xb, yb in zip(x.chunk(k), y.chunk(k)):
        (loss_fn(model(xb), yb) / k).backward()
    opt.step()
    warmup.step()
    opt.zero_grad(set_to_none=True)


def correct_clip_once(model, loss_fn, x, y, k):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=100)
    for xb, yb in zip(x.chunk(k), y.chunk(k)):
        (loss_fn(model(xb), yb) / k).backward()
    clip_grad_norm_(model.parameters(), 0.05)
    opt.step()
    sched.step()


def correct_amp(model, loss_fn, x, y, k):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for xb, yb in zip(x.chunk(k), y.chunk(k)):
        scaler.scale(loss_fn(model(xb), yb) / k).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    scaler.step(opt)
    scaler.update()


CORRECT = {
    "plain (the checker's own loop)": None,
    "chunk, loss / k": correct_plain,
    "sum, then .grad /= k": correct_divide_at_end,
    "index tensors and copies": correct_index_copies,
    "whole iteration, SGD + LinearLR": correct_whole_iteration,
    "clip once (imported by name), AdamW + OneCycleLR": correct_clip_once,
    "GradScaler: unscale_, clip, step, update": correct_amp,
}


def bug_missing_k(model, loss_fn, x, y, k):
    for xb, yb in zip(x.chunk(k), y.chunk(k)):
        loss_fn(model(xb), yb).backward()


def bug_double_k(model, loss_fn, x, y, k):
    for xb, yb in zip(x.chunk(k), y.chunk(k)):
        (loss_fn(model(xb), yb) / k).backward()
    for p in model.parameters():
        p.grad /= k


def bug_zero_grad_inside(model, loss_fn, x, y, k):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for xb, yb in zip(x.chunk(k), y.chunk(k)):
        opt.zero_grad()
        (loss_fn(model(xb), yb) / k).backward()
    opt.step()


def bug_grad_none_inside(model, loss_fn, x, y, k):
    for xb, yb in zip(x.chunk(k), y.chunk(k)):
        for p in model.parameters():
            p.grad = None
        (loss_fn(model(xb), yb) / k).backward()


def bug_clip_running(model, loss_fn, x, y, k):
    for xb, yb in zip(x.chunk(k), y.chunk(k)):
        (loss_fn(model(xb), yb) / k).backward()
        clip_grad_norm_(model.parameters(), 0.02)  # imported by name


def bug_clip_per_micro(model, loss_fn, x, y, k):
    total = [torch.zeros_like(p) for p in model.parameters()]
    for xb, yb in zip(x.chunk(k), y.chunk(k)):
        model.zero_grad()
        (loss_fn(model(xb), yb) / k).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.02)
        for t, p in zip(total, model.parameters()):
            t += p.grad
    for t, p in zip(total, model.parameters()):
        p.grad = t


def bug_clip_before_unscale(model, loss_fn, x, y, k):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for xb, yb in zip(x.chunk(k), y.chunk(k)):
        scaler.scale(loss_fn(model(xb), yb) / k).backward()
    clip_grad_norm_(model.parameters(), 0.05)
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()


def bug_scaler_update_each(model, loss_fn, x, y, k):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    for xb, yb in zip(x.chunk(k), y.chunk(k)):
        scaler.scale(loss_fn(model(xb), yb) / k).backward()
        scaler.update()  # raises: no inf checks were recorded
    scaler.step(opt)


def bug_scaler_growth_each(model, loss_fn, x, y, k):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    for xb, yb in zip(x.chunk(k), y.chunk(k)):
        scaler.scale(loss_fn(model(xb), yb) / k).backward()
        scaler.update(new_scale=scaler.get_scale() * 2)
    for p in model.parameters():
        p.grad /= scaler.get_scale()


def bug_scaler_step_each(model, loss_fn, x, y, k):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    for xb, yb in zip(x.chunk(k), y.chunk(k)):
        scaler.scale(loss_fn(model(xb), yb) / k).backward()
        scaler.step(opt)
        scaler.update()


def bug_unscale_each(model, loss_fn, x, y, k):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    for xb, yb in zip(x.chunk(k), y.chunk(k)):
        scaler.scale(loss_fn(model(xb), yb) / k).backward()
        scaler.unscale_(opt)  # raises the second time
    scaler.step(opt)
    scaler.update()


def bug_scale_not_removed(model, loss_fn, x, y, k):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for xb, yb in zip(x.chunk(k), y.chunk(k)):
        scaler.scale(loss_fn(model(xb), yb) / k).backward()


def bug_optimizer_each(model, loss_fn, x, y, k):
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for xb, yb in zip(x.chunk(k), y.chunk(k)):
        (loss_fn(model(xb), yb) / k).backward()
        opt.step()
        opt.zero_grad()


def bug_scheduler_each(model, loss_fn, x, y, k):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=100)
    for xb, yb in zip(x.chunk(k), y.chunk(k)):
        (loss_fn(model(xb), yb) / k).backward()
        sched.step()
    opt.step()


def bug_reseed_each(model, loss_fn, x, y, k):
    for i, (xb, yb) in enumerate(zip(x.chunk(k), y.chunk(k))):
        torch.manual_seed(100 + i)
        (loss_fn(model(xb), yb) / k).backward()


def bug_generator_reseed(model, loss_fn, x, y, k):
    for xb, yb in zip(x.chunk(k), y.chunk(k)):
        torch.default_generator.manual_seed(7)
        (loss_fn(model(xb), yb) / k).backward()


ACCUMULATION_STEPS = 4  # the training script's constant


def bug_fixed_k(model, loss_fn, x, y, k):
    for xb, yb in zip(x.chunk(k), y.chunk(k)):
        (loss_fn(model(xb), yb) / ACCUMULATION_STEPS).backward()


#: name → (step, codes the checker must name, families it applies to)
BUGS = {
    "missing 1/K": (bug_missing_k, {"missing_1_over_k"}, FAMILIES),
    "1/K twice": (bug_double_k, {"double_1_over_k"}, FAMILIES),
    "optimizer.zero_grad() inside": (bug_zero_grad_inside, {"zero_grad_inside_window"}, FAMILIES),
    "p.grad = None inside": (bug_grad_none_inside, {"zero_grad_inside_window"}, ("mlp", "cnn_gn", "lm")),
    "clip the running buffer (by name)": (bug_clip_running, {"clip_running_buffer"}, FAMILIES),
    "clip each micro-batch": (bug_clip_per_micro, {"clip_per_micro_batch"}, ("mlp", "cnn_gn", "block")),
    "clip before unscale_": (bug_clip_before_unscale, {"clip_before_unscale"}, FAMILIES),
    "scaler.update() every micro-batch": (
        bug_scaler_update_each,
        {"step_raised", "scaler_update_inside_window"},
        ("mlp", "cnn_gn"),
    ),
    "scale doubled every micro-batch": (
        bug_scaler_growth_each,
        {"scaler_update_inside_window"},
        ("mlp", "cnn_gn", "block"),
    ),
    "scaler.step() every micro-batch": (
        bug_scaler_step_each,
        {"scaler_step_inside_window", "scaler_update_inside_window"},
        ("mlp", "cnn_bn"),
    ),
    "unscale_ every micro-batch": (bug_unscale_each, {"step_raised", "scaler_unscale_inside_window"}, ("cnn_gn",)),
    "loss scale never removed": (bug_scale_not_removed, {"loss_scale_not_removed"}, ("mlp", "lm")),
    "optimizer.step() every micro-batch": (bug_optimizer_each, {"optimizer_step_inside_window"}, FAMILIES),
    "scheduler.step() every micro-batch": (bug_scheduler_each, {"scheduler_step_inside_window"}, FAMILIES),
    "torch.manual_seed every micro-batch": (bug_reseed_each, {"rng_reseeded"}, ("mlp", "block", "lm")),
    "generator re-seeded every micro-batch": (bug_generator_reseed, {"rng_reseeded"}, ("mlp",)),
    "partial window divided by K": (bug_fixed_k, {"partial_window"}, FAMILIES),
}


def token_window_correct(model, loss_fn, x, y, k):
    """The token fix: sum over tokens, divided by the tokens of the whole window."""
    total = int((y != IGNORE).sum())
    for xb, yb in zip(x.chunk(k), y.chunk(k)):
        out = model(xb)
        (
            F.cross_entropy(out.reshape(-1, out.shape[-1]), yb.reshape(-1), ignore_index=IGNORE, reduction="sum")
            / total
        ).backward()


def all_cases() -> list[tuple[str, str, object, set[str]]]:
    """(family, loop name, step, expected codes) for every correct and planted loop."""
    cases = []
    for fam in FAMILIES:
        for name, step in CORRECT.items():
            cases.append((fam, name, step, set(FAMILY_CODES.get(fam, set()))))
        for name, (step, codes, families) in BUGS.items():
            if fam in families:
                cases.append((fam, name, step, codes | FAMILY_CODES.get(fam, set())))
    cases.append(("lm_sorted", "token loss: sum / window tokens", token_window_correct, set()))
    cases.append(("lm_sorted", "token loss: mean of micro-batch means", correct_plain, {"token_normalization"}))
    cases.append(("lm_sorted", "token loss: no 1/K either", bug_missing_k, {"token_normalization", "missing_1_over_k"}))
    return cases


def test_the_zoo_has_enough_loops_and_families():
    cases = all_cases()
    loops = {name for _, name, _, _ in cases}
    assert len(loops) >= 20 and len({fam for fam, *_ in cases}) >= 4
    assert math.isclose(sum(EQUAL_TOKENS[:4]), 30) and len({sum(EQUAL_TOKENS[i : i + 4]) for i in (0, 4, 8, 12)}) == 1


@pytest.mark.parametrize("fam", FAMILIES + ("lm_sorted",))
def test_each_family_runs_and_has_its_features(fam, digits):
    model, loss_fn, x, y = family(fam, digits)
    out = model(x)
    assert out.shape[0] == x.shape[0] and loss_fn(out, y).dim() == 0
    kinds = {type(m).__name__ for m in model.modules()}
    assert ("Dropout" in kinds) == (fam in HAS_DROPOUT)
    if fam == "block":
        assert {"LayerNorm", "MultiheadAttention"} <= kinds
    if fam.startswith("lm"):
        assert (y == IGNORE).any() and not isinstance(loss_fn, nn.Module)
