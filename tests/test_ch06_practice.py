"""Chapter 6's appendix: the count after the window (windows.scale_grads), the data shapes, padding-free counts,
counts under model parallelism, dropout seeds on two ranks, and what the Trainer divides by K."""

import random

import numpy as np
import pytest
import torch
from torch import nn

from gradaccum import windows
from gradaccum.accumulate import agreement, flat_grad, split_batch
from gradaccum.book import ch06_practice as practice
from gradaccum.book import ch06_ranks as ranks
from gradaccum.book import data as book_data
from gradaccum.book import models as book_models

V = 7


class Bigram(nn.Module):
    """A next-token model written for these tests: logits from the current token and a bias (float64)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.table = nn.Parameter(torch.randn(V, V, generator=g, dtype=torch.float64))
        self.bias = nn.Parameter(torch.randn(V, generator=g, dtype=torch.float64))

    def forward(self, x):
        return self.table[x] + self.bias


def ragged(rows: int = 8, width: int = 10, seed: int = 0):
    """Rows of tokens with padding (IGNORE targets) of different lengths: unequal counts per micro-batch."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V, (rows, width), generator=g)
    y = torch.randint(0, V, (rows, width), generator=g)
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    for i, n in enumerate(lengths):
        y[i, n:] = windows.IGNORE
    return x, y


def summed_then_scaled(model, x, y, k, p=1, total=None):
    model.zero_grad(set_to_none=True)
    for xb, yb in split_batch(x, y, k):
        windows.token_loss(model(xb), yb, "sum").backward()
    return windows.scale_grads(model, windows.count_tokens(y) if total is None else total, p)


@pytest.fixture(scope="module")
def corpus():
    lines = book_data.load_corpus()
    return lines, book_data.make_vocab(lines)


def test_the_count_after_the_window_gives_the_token_mean_exactly():
    model = Bigram()
    x, y = ragged()
    factor = summed_then_scaled(model, x, y, 4)
    assert factor == 1 / windows.count_tokens(y)
    reference = windows.token_mean_gradient(model, x, y)
    assert agreement(reference, flat_grad(model).detach()).rel_error < 1e-14
    # the mean of means on the same data is not exact (the counts differ)
    assert agreement(reference, windows.window_gradient(model, x, y, 4, "mean_of_means")).rel_error > 1e-3


def test_scale_grads_times_ranks_undoes_ddps_average():
    """Two ranks with unequal counts, each scaled by p / (all ranks' tokens): DDP's average is the token mean."""
    model = Bigram(seed=1)
    x, y = ragged(rows=8, seed=3)
    total = windows.count_tokens(y)
    grads = []
    for xs, ys in split_batch(x, y, 2):
        summed_then_scaled(model, xs, ys, 2, p=2, total=torch.tensor(total))  # an all-reduced count is a tensor
        grads.append(flat_grad(model).detach().clone())
    averaged = torch.stack(grads).mean(0)
    assert agreement(windows.token_mean_gradient(model, x, y), averaged).rel_error < 1e-14


def test_scale_grads_leaves_missing_gradients_and_refuses_bad_counts():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model[0].weight.grad = torch.ones(2, 2)
    windows.scale_grads(model, 4, ranks=2)
    assert torch.equal(model[0].weight.grad, torch.full((2, 2), 0.5)) and model[1].weight.grad is None
    for bad in (0, -3, 2.5, True, torch.tensor(3.0)):
        with pytest.raises(ValueError):
            windows.scale_grads(model, bad)
    for bad in (0, 1.0, True):
        with pytest.raises(ValueError):
            windows.scale_grads(model, 4, ranks=bad)


def test_clipping_belongs_after_the_scaling(corpus):
    lines, vocab = corpus
    model = book_models.make_lm(vocab, seed=2)
    x, y = book_data.encode_batch(book_data.spread_lines(lines, 8, 40, 20, seed=1), vocab)
    reference = windows.token_mean_gradient(model, x, y)
    c = 0.5 * float(reference.norm())  # a threshold the full batch's gradient exceeds
    clipped_full = reference * (c / (float(reference.norm()) + 1e-6))
    after = practice.sum_then_scale_gradient(model, x, y, 4, clip=c)
    before = practice.sum_then_scale_gradient(model, x, y, 4, clip=c, clip_first=True)
    assert agreement(clipped_full, after).rel_error < 1e-12
    assert agreement(clipped_full, before).rel_error > 0.9
    assert agreement(reference, practice.sum_then_scale_gradient(model, x, y, 4)).rel_error < 1e-12


def test_layouts_have_the_shapes_and_labels_they_promise(corpus):
    lines, vocab = corpus
    x, y = practice.packed_batch(lines, vocab, 8, 32, seed=0)
    assert x.shape == y.shape == (8, 32) and windows.count_tokens(y) == 8 * 32
    assert torch.equal(x[:, 1:], y[:, :-1])  # the next character
    x, y = practice.sft_batch(lines, vocab, 6, 200, seed=0, prompt=(5, 10), response=(5, 10))
    assert x.shape == y.shape == (6, 200)
    labelled = y != windows.IGNORE
    assert 0 < labelled.sum() < y.numel()  # prompts (and example ends) unlabelled
    assert torch.equal(y[:, :-1][labelled[:, :-1]], x[:, 1:][labelled[:, :-1]])  # a target is the next token
    x, y = practice.padded_batch(lines, vocab, 10, (5, 30), seed=0, sort=True)
    counts = [windows.count_tokens(row) for row in y]
    assert counts == sorted(counts) and 4 <= min(counts) and max(counts) <= 29
    with pytest.raises(ValueError):
        practice.padded_batch(lines, vocab, 4, (1, 3), seed=0)
    with pytest.raises(ValueError):
        practice.packed_batch(lines, vocab, 2, 10**6, seed=0)
    for prompt in ((0, 4), (5, 3)):
        with pytest.raises(ValueError):
            practice.sft_batch(lines, vocab, 2, 50, seed=0, prompt=prompt)


def test_equal_counts_make_the_mean_of_means_exact_and_unequal_ones_do_not(corpus):
    lines, vocab = corpus
    model = book_models.make_lm(vocab, seed=3)
    study = practice.shape_study(model, lines, vocab, seeds=(0,), ks=(4,))
    packed = study["packed, every token labelled"]
    assert packed.min_tokens == packed.max_tokens and max(packed.errors) < 1e-12
    for name in ("packed SFT, prompts masked", "padded, shuffled", "padded, length-grouped"):
        assert study[name].min_tokens < study[name].max_tokens and min(study[name].errors) > 1e-4, name


def test_a_count_over_ranks_that_share_a_batch_must_be_divided_by_them():
    model = Bigram(seed=4)
    x, y = ragged(rows=12, seed=5)
    reference = windows.token_mean_gradient(model, x, y)
    for dp, replicas in ((2, 2), (3, 4), (1, 3)):
        exact = practice.replicated_gradient(model, x, y, 2, dp, replicas, divide=True)
        over = practice.replicated_gradient(model, x, y, 2, dp, replicas, divide=False)
        assert agreement(reference, exact).rel_error < 1e-14
        assert agreement(reference, over * replicas).rel_error < 1e-14  # 1/replicas of the gradient
    with pytest.raises(ValueError):
        practice.replicated_gradient(model, x, y, 2, 2, 0, divide=True)


def test_flattening_keeps_the_count_and_restarts_positions():
    examples = [[1, 2, 3, 4], [5, 6], [1, 1, 1]]
    flat, padded = practice.flattened_and_padded(examples)
    assert flat["input_ids"].tolist() == [sum(examples, [])]
    assert flat["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 0, 1, 2]]
    starts = [0, 4, 6]
    assert all(flat["labels"][0, s] == windows.IGNORE for s in starts)
    assert padded["labels"].shape == (3, 4) and padded["labels"][1, 2:].eq(windows.IGNORE).all()
    expected = sum(len(e) - 1 for e in examples)
    assert practice.trainer_count(flat) == practice.trainer_count(padded) == expected
    assert practice.trainer_count(padded, shifts=False) == sum(map(len, examples))
    assert practice.trainer_count({"labels": flat["labels"], "shift_labels": torch.tensor([[1, -100]])}) == 1


@pytest.mark.slow
def test_trainer_count_is_the_trainers_own(tmp_path):
    """The mirror of the Trainer's count agrees with ``Trainer._get_num_items_in_batch`` for a causal LM."""
    from transformers import Trainer, TrainingArguments

    flat, padded = practice.flattened_and_padded([[1, 2, 3, 4, 5], [2, 3], [4, 4, 4, 4]])
    model = practice.CausalLMForTrainer(6)
    state = torch.get_rng_state()
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], save_strategy="no")
    trainer = Trainer(model=model, args=args)
    torch.set_rng_state(state)
    assert trainer._loss_shifts_labels  # the model declares Transformers' causal-LM loss
    for batch in (flat, padded):
        assert int(trainer._get_num_items_in_batch([batch], torch.device("cpu"))) == practice.trainer_count(batch)


@pytest.mark.slow
def test_loss_is_scaled_for_ga_decides_the_division_by_k():
    _, padded = practice.flattened_and_padded([[1, 2, 3, 4, 5], [2, 3], [4, 4, 4, 4]])

    def seed(n):
        random.seed(n)
        np.random.seed(n)
        torch.manual_seed(n)

    def draw():
        return random.random(), float(np.random.rand()), float(torch.rand(1))

    seed(7)
    fresh = draw()
    seed(7)
    for k in (3, 4):
        factors = practice.trainer_step_factors(padded, 6, k=k)
        expected = {"None, loss kwargs": 1, "None, no loss kwargs": 1 / k, "True": 1, "False": 1 / k}
        assert factors == pytest.approx(expected, rel=1e-6)  # Transformers computes the loss in float32
    assert draw() == fresh  # the Trainer seeds when it is built; the caller's random state is put back


@pytest.mark.slow
def test_two_ranks_scale_after_the_window_and_draw_masks_by_their_seeds(corpus):
    lines, vocab = corpus
    model = book_models.make_lm(vocab, seed=5)
    x, y = book_data.encode_batch(book_data.spread_lines(lines, 8, 40, 30, seed=2, sort=True), vocab)
    demo = practice.rank_demo(model, x, y, k=2)
    assert max(demo.errors) < 1e-12
    assert sum(demo.own_tokens) == demo.total_tokens == windows.count_tokens(y)
    same, offset = (demo.dropped_on_both[how] for how in ranks.SEEDINGS)
    assert same == 1.0 and offset < 0.3
    assert demo.init_gap_before > 0 and demo.init_gap_after == 0.0
    with pytest.raises(ValueError):
        practice.rank_demo(Bigram(), x, y, k=2)


def test_the_same_seed_draws_the_same_masks_in_one_process():
    a = ranks.dropout_draws(ranks.SEEDINGS[0], 0, 1, 2, (4, 8), 0.5)
    b = ranks.dropout_draws(ranks.SEEDINGS[0], 1, 2, 2, (4, 8), 0.5)  # the rank plays no part
    assert a.shape == (2, 4, 8) and a.dtype == torch.bool and torch.equal(a, b)
    assert not torch.equal(a[0], a[1])  # fresh masks per micro-batch


def test_the_helper_processes_module_loads_no_figures_and_no_scikit_learn():
    """The fork server preloads gradaccum.book.ch06_ranks and the partial-window study's processes run its
    partial_step_run: importing it must not pull in matplotlib or scikit-learn (seconds in every worker)."""
    import subprocess
    import sys

    code = (
        "import sys, gradaccum.book.ch06_ranks; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('sklearn', 'matplotlib')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
