import functools
import itertools
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradaccum import windows
from gradaccum.accumulate import agreement
from gradaccum.book import ch06_loss_normalization_and_friends as ch6
from gradaccum.book import data as book_data
from gradaccum.book import exercises as ex
from gradaccum.book import models as book_models


@pytest.fixture(scope="module")
def lm():
    lines = book_data.load_corpus()
    vocab = book_data.make_vocab(lines)
    return lines, vocab, book_models.make_lm(vocab)


def test_corpus_and_encoding(lm):
    lines, vocab, _ = lm
    assert len(lines) == 52 and min(map(len, lines)) == 19 and max(map(len, lines)) == 157
    x, y = book_data.encode_batch(["abc", "hello"], book_data.make_vocab(["abc", "hello"]))
    assert x.shape == (2, 4) and windows.count_tokens(y) == 2 + 4 and (y[0, 2:] == windows.IGNORE).all()
    with pytest.raises(ValueError):
        book_data.encode_batch([], vocab)


def test_equal_token_counts_make_mean_of_means_exact(lm):
    lines, vocab, model = lm
    x, y = book_data.encode_batch(book_data.spread_lines(lines, 16, 40, 0), vocab)
    ref = windows.token_mean_gradient(model, x, y)
    assert agreement(ref, windows.window_gradient(model, x, y, 4, "mean_of_means")).rel_error < 1e-12


def test_unequal_counts_need_window_tokens(lm):
    lines, vocab, model = lm
    x, y = book_data.encode_batch(book_data.spread_lines(lines, 16, 50, 39, seed=1, sort=True), vocab)
    ref = windows.token_mean_gradient(model, x, y)
    assert agreement(ref, windows.window_gradient(model, x, y, 4, "mean_of_means")).rel_error > 0.05
    assert agreement(ref, windows.window_gradient(model, x, y, 4, "window_tokens")).rel_error < 1e-12
    assert agreement(ref, windows.ranks_gradient(model, x, y, 2, 2, global_count=True)).rel_error < 1e-12
    assert agreement(ref, windows.ranks_gradient(model, x, y, 2, 2, global_count=False)).rel_error > 0.05


def test_window_backward_errors(lm):
    lines, vocab, model = lm
    x, y = book_data.encode_batch(lines[:4], vocab)
    with pytest.raises(ValueError, match="normalization"):
        windows.window_backward(model, x, y, 2, "median")  # type: ignore[arg-type]
    y_pad = torch.full_like(y, windows.IGNORE)
    with pytest.raises(ValueError, match="no tokens"):
        windows.window_backward(model, x, y_pad, 2)
    with pytest.raises(ValueError, match="only padding"):
        windows.window_backward(model, x, y_pad, 2, "mean_of_means")
    with pytest.raises(ValueError, match="spread"):
        book_data.spread_lines(lines, 4, 10, 10)


def test_dropout_masks():
    fresh = windows.mask_agreement(windows.dropout_masks(8, 4, (256,)))
    reset = windows.mask_agreement(windows.dropout_masks(8, 4, (256,), reset_seed=True))
    assert abs(fresh[0] - 0.5) < 0.05 and reset[0] == 1.0 and abs(reset[1] - 0.5) < 0.05
    with pytest.raises(ValueError):
        windows.dropout_masks(2, 2, (4,), p=1.0)


def test_step_counting():
    right, warned_right = windows.lr_trajectory(8, 4, 8, per_micro=False)
    wrong, warned_wrong = windows.lr_trajectory(8, 4, 8, per_micro=True)
    assert right == pytest.approx([(i + 1) / 8 for i in range(8)]) and not warned_right
    assert wrong[1] == 1.0 and warned_wrong  # warmup over after 2 optimizer steps instead of 8
    assert windows.adam_step_count(5, 4, False) == 5 and windows.adam_step_count(5, 4, True) == 20


def test_partial_window(digits, loss_fn):
    from gradaccum.accumulate import full_batch_gradient
    from gradaccum.book.models import make_cnn

    model = make_cnn("group")
    x, y = digits.x_train[:24], digits.y_train[:24]  # 3 micro-batches of 8, K = 4
    mean = full_batch_gradient(model, loss_fn, x, y)
    by_k = windows.partial_window_gradient(model, loss_fn, x, y, 8, 4, "divide_by_K")
    actual = windows.partial_window_gradient(model, loss_fn, x, y, 8, 4, "divide_by_actual")
    assert agreement(mean, actual).rel_error < 1e-12 and torch.allclose(by_k, 0.75 * actual, atol=1e-14)
    assert windows.partial_window_gradient(model, loss_fn, x, y, 8, 4, "drop") is None
    with pytest.raises(ValueError, match="between 1 and K"):
        windows.partial_window_gradient(model, loss_fn, x, y, 8, 3, "drop")


def test_window_log(lm):
    lines, vocab, model = lm
    x, y = book_data.encode_batch(book_data.spread_lines(lines, 8, 50, 39, seed=1, sort=True), vocab)
    log = windows.window_log(model, x, y, 4)
    with torch.no_grad():
        assert log.token_mean == pytest.approx(float(windows.token_loss(model(x), y)))
    assert log.last_micro < log.token_mean


@pytest.mark.slow
def test_dropout_masks_match_in_distribution_only(digits, loss_fn):
    x, y = digits.x_train[:32], digits.y_train[:32]
    two = book_models.dropout_mlp(2)
    same = lambda net, k: (  # noqa: E731
        agreement(
            windows.dropout_gradient(net, loss_fn, x, y, 1, 0),
            windows.dropout_gradient(net, loss_fn, x, y, k, 0),
        ).rel_error
    )
    # one layer: whether one (32, 32) draw equals four (8, 32) draws depends on the mask layout and the torch
    # build, so it is not tested
    assert same(two, 4) > 0.3 and same(two, 2) > 0.3  # a second layer interleaves the draws
    cmp = ch6.compare_dropout(two, loss_fn, x, y, 4, draws=100)
    assert cmp.single_draw > 0.3 and cmp.mean_gap < 2 * cmp.noise and cmp.draws == 100
    state = torch.random.get_rng_state()
    windows.dropout_gradient(two, loss_fn, x, y, 4, 7)
    assert torch.equal(state, torch.random.get_rng_state())  # the caller's random stream is left alone
    with pytest.raises(ValueError, match="layers"):
        book_models.dropout_mlp(3)
    with pytest.raises(ValueError, match="2 draws"):
        ch6.compare_dropout(two, loss_fn, x, y, 4, draws=1)


def test_scheduler_order_warning_fires_once():
    assert len(windows.scheduler_order_warnings(4, 10, optimizer_first=False)) == 1
    assert windows.scheduler_order_warnings(4, 10, optimizer_first=True) == []


def test_warmup_exercise_solution():
    """ex-ch6-warmup: warmup 1000, K = 8, scheduler per micro-batch: full lr first at optimizer step 125."""
    wrong, _ = windows.lr_trajectory(130, 8, 1000, per_micro=True)
    assert wrong.index(1.0) + 1 == 125 and wrong[123] < 1.0


@pytest.mark.slow
def test_partial_step_ratio(digits, loss_fn):
    """ex-ch6-partial: 3 micro-batches of K = 8 divided by K: gradient and SGD step 3/8; Adam's step about 1 early,
    noticeably smaller after 200 windows."""
    from gradaccum.book.models import make_cnn

    model, x, y = make_cnn("group"), digits.x_train, digits.y_train
    by_k = windows.partial_window_gradient(model, loss_fn, x[:24], y[:24], 8, 8, "divide_by_K")
    actual = windows.partial_window_gradient(model, loss_fn, x[:24], y[:24], 8, 8, "divide_by_actual")
    assert abs(float(by_k.norm() / actual.norm()) - 0.375) < 1e-12
    assert abs(windows.partial_step_ratio(model, loss_fn, x, y, 8, 8, 3, "sgd", 0.1, warm_windows=2) - 0.375) < 1e-9
    assert abs(windows.partial_step_ratio(model, loss_fn, x, y, 8, 8, 3, "adam", 1e-3) - 1) < 1e-3
    assert abs(windows.partial_step_ratio(model, loss_fn, x, y, 8, 8, 3, "adam", 1e-3, warm_windows=2) - 1) < 0.1
    # later, Adam's second moment remembers many full-size gradients and the step shrinks (seed 0: 0.875)
    late = windows.partial_step_ratio(model, loss_fn, x, y, 8, 8, 3, "adam", 1e-3, warm_windows=200)
    assert 0.375 < late < 0.93
    # beta1 = 0: no memory of earlier gradients in the numerator; after 2 windows the step is far smaller than Adam's
    early = windows.partial_step_ratio(model, loss_fn, x, y, 8, 8, 3, "adam", 1e-3, warm_windows=2)
    no_memory = windows.partial_step_ratio(model, loss_fn, x, y, 8, 8, 3, "adam_beta1_0", 1e-3, warm_windows=2)
    assert 0.375 < no_memory < 0.75 < early
    assert abs(windows.partial_step_ratio(model, loss_fn, x, y, 8, 8, 3, "adam_beta1_0", 1e-3) - 1) < 1e-3
    with pytest.raises(ValueError, match="unknown optimizer"):
        windows.partial_step_ratio(model, loss_fn, x, y, 8, 8, 3, "lion", 1e-3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="between 1 and K"):
        windows.partial_step_ratio(model, loss_fn, x, y, 8, 8, 8, "sgd", 0.1)


def test_window_tools_refuse_what_they_cannot_compute(lm):
    """Found by review: a count of True or 3.7, a count below the window's own tokens, a count given to the mean of
    means, an all-padding micro-batch in the log, b = 0, K = 0 and one-step masks all passed or failed obscurely; a
    NumPy integer K is refused with the advice to convert it (accepted, it leaked NumPy scalars into results)."""
    import numpy as np

    lines, vocab, model = lm
    x, y = book_data.encode_batch(lines[:8], vocab)
    own = windows.count_tokens(y)
    for bad in (True, 3.7, 0, "12", torch.tensor(2.0)):
        with pytest.raises(ValueError, match="total_tokens"):
            windows.window_backward(model, x, y, 4, total_tokens=bad)
    with pytest.raises(ValueError, match="less than the"):
        windows.window_backward(model, x, y, 4, total_tokens=own - 1)
    with pytest.raises(ValueError, match="only with normalization='window_tokens'"):
        windows.window_backward(model, x, y, 4, "mean_of_means", total_tokens=own)
    # an all-reduced count as a tensor, or a NumPy int, is the same as the count itself
    grads = []
    for count in (own, torch.tensor(own), np.int64(own)):
        model.zero_grad(set_to_none=True)
        windows.window_backward(model, x, y, 4, total_tokens=count)
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    assert all(torch.equal(g, grads[0]) for g in grads)
    model.zero_grad(set_to_none=True)
    padded = y.clone()
    padded[-2:] = windows.IGNORE  # the last micro-batch of 2 lines: padding only
    with pytest.raises(ValueError, match="only padding"):
        windows.window_log(model, x, padded, 4)
    with pytest.raises(ValueError, match="micro-batch size"):
        windows.partial_window_gradient(model, windows.token_loss, x, y, 0, 8, "divide_by_K")
    with pytest.raises(ValueError, match="K"):
        windows.adam_step_count(3, 0, False)
    with pytest.raises(ValueError, match="windows must be"):
        windows.adam_step_count(-1, 2, False)
    with pytest.raises(ValueError, match="NumPy integer"):
        windows.adam_step_count(np.int64(3), 2, False)
    with pytest.raises(ValueError, match="steps >= 2"):
        windows.mask_agreement(windows.dropout_masks(1, 4, (5,)))
    with pytest.raises(ValueError, match="NumPy integer"):
        windows.window_backward(model, x, y, np.int64(4))
    assert windows.adam_step_count(0, 4, True) == 0


def test_window_tools_refuse_bad_input_with_what_to_pass():
    """Found by review: these ran on (or crashed with a ZeroDivisionError / TypeError / a K-message); token_loss
    with reduction='none' returned a flattened per-token tensor (fifth review)."""
    with pytest.raises(ValueError, match="'mean' or 'sum'"):
        windows.token_loss(torch.randn(2, 3, 5), torch.zeros(2, 3, dtype=torch.int64), reduction="none")
    model = nn.Linear(2, 2)
    x, y = torch.randn(16, 2), torch.randint(0, 2, (16,))
    ratio = functools.partial(windows.partial_step_ratio, model, nn.CrossEntropyLoss(), x, y)
    for kwargs, message in (
        (dict(b=2, k=4, present=3, optimizer="sgd", lr=0.0), "learning rate"),
        (dict(b=2, k=4, present=3, optimizer="sgd", lr=float("nan")), "learning rate"),
        (dict(b=0, k=4, present=3, optimizer="sgd", lr=0.1), "micro-batch size"),
        (dict(b=2.5, k=4, present=3, optimizer="sgd", lr=0.1), "micro-batch size"),
        (dict(b=2, k=4, present=2.0, optimizer="sgd", lr=0.1), "partial window"),
        (dict(b=2, k=4, present=3, optimizer="sgd", lr=0.1, warm_windows=-3), "warm_windows"),
    ):
        with pytest.raises(ValueError, match=message):
            ratio(**kwargs)
    with pytest.raises(ValueError, match="optimizer_steps"):
        windows.lr_trajectory(optimizer_steps=-2, k=2, warmup=4, per_micro=False)
    with pytest.raises(ValueError, match="warmup"):
        windows.lr_trajectory(optimizer_steps=2, k=2, warmup=True, per_micro=False)
    with pytest.raises(ValueError, match="per_micro"):
        windows.lr_trajectory(optimizer_steps=2, k=2, warmup=4, per_micro="no")
    for bad in (0, -1):
        with pytest.raises(ValueError, match="windows"):
            windows.scheduler_order_warnings(k=2, windows=bad, optimizer_first=False)
    with pytest.raises(ValueError, match="steps"):
        windows.dropout_masks(steps=-1, k=2, shape=(3,))
    tokens = torch.randint(1, 5, (6, 4))
    lm = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5))
    for p, message in ((0, "ranks"), (4, "ranks")):
        with pytest.raises(ValueError, match=message):
            windows.ranks_gradient(lm, tokens, tokens, p, 1, global_count=True)
    with pytest.raises(ValueError, match="global_count"):
        windows.ranks_gradient(lm, tokens, tokens, 2, 1, global_count="yes")


def test_graders_refuse_impossible_exercises_and_round_warmups_up():
    from gradaccum.book import exercises

    assert exercises.grade_warmup_end(334, warmup=1000, k=3).correct
    wrong = exercises.grade_warmup_end(333, warmup=1000, k=3)
    assert not wrong.correct and "round up" in wrong.message
    assert not exercises.grade_warmup_end(333.33, warmup=1000, k=3).correct
    assert exercises.grade_warmup_end(125, warmup=1000, k=8).correct
    assert exercises.grade_accelerate_warmup_end(76, warmup=601, processes=8, k=4).correct
    for kwargs in (dict(warmup=1000, k=0), dict(warmup=-8, k=8), dict(warmup=10, k=1.5)):
        with pytest.raises(ValueError):
            exercises.grade_warmup_end(1, **kwargs)
    for kwargs in (dict(present=16, k=16), dict(present=20, k=16), dict(present=0, k=16), dict(present=1, k=1.5)):
        with pytest.raises(ValueError):
            exercises.grade_partial_scale(0.5, **kwargs)
    for kwargs in (
        dict(sums=(1.0, 2.0, 3.0), tokens=(1, 2)),
        dict(sums=(1.0, 2.0), tokens=(0, 2)),
        dict(sums=(1.0, 2.0), tokens=(-1, 2)),
        dict(sums=(1.0,), tokens=(3,)),
    ):
        with pytest.raises(ValueError):
            exercises.grade_window_token_loss(0.5, **kwargs)
    message = exercises.grade_window_token_loss((0.3 + 0.5) / 2, sums=(30.0, 10.0), tokens=(100, 20)).message
    assert "20 tokens" in message and "5 times" in message


def _first_full_rate_step(convention, optimizer_first: bool, k: int = 8) -> int:
    """The optimizer step that first uses the full rate when ``scheduler.step()`` follows every micro-batch; with
    ``optimizer_first`` the window's ``optimizer.step()`` comes before its last scheduler step."""
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, convention)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PyTorch's order warning at the scheduler's first step
        for step in itertools.count(1):
            for micro in range(k):
                if micro == k - 1 and optimizer_first:
                    if opt.param_groups[0]["lr"] == 1.0:
                        return step
                    opt.step()
                sched.step()
            if not optimizer_first:
                if opt.param_groups[0]["lr"] == 1.0:
                    return step
                opt.step()
    raise AssertionError("unreachable")


def test_when_the_full_rate_is_first_used_depends_on_convention_and_order():
    """Exercise ex-ch6-warmup's solution: a 1000-step warmup stepped per micro-batch (K = 8) has been counted after
    125 optimizer steps; the full rate is first used at step 125 or 126, depending on the schedule's convention
    and on whether the window's optimizer step comes before its last scheduler step."""
    plus_one, plain = (lambda t: min(1.0, (t + 1) / 1000)), (lambda t: min(1.0, t / 1000))
    assert [_first_full_rate_step(c, False) for c in (plus_one, plain)] == [125, 125]
    assert [_first_full_rate_step(c, True) for c in (plus_one, plain)] == [125, 126]


@pytest.mark.slow
def test_partial_step_study_in_two_processes_is_the_sequential_one(lm):
    """The chapter runs the late study in two spawned processes: the same ratios, to the bit."""
    lines, vocab, _ = lm
    digits = book_data.load_digits_split()
    kwargs = dict(seeds=(0, 1), warm=(2,), optimizers=("momentum", "adam"))
    one = ch6.partial_step_study(digits.x_train, digits.y_train, lines, vocab, **kwargs)
    assert list(one) == [(s, o, 2) for s in ch6.STUDY_LR for o in ("momentum", "adam")]
    assert one == ch6.partial_step_study(digits.x_train, digits.y_train, lines, vocab, **kwargs, workers=2)
    with pytest.raises(ValueError, match="setup must be one of"):
        ch6.partial_step_run("MLP", "adam", 0, 0, digits.x_train, digits.y_train, vocab)


def test_window_tools_refuse_flags_targets_and_steps_they_cannot_use():
    """Second review: truthy strings and None switched flags on or off, a float seed drew seed 0's masks, an int
    shape or a list of masks raised TypeError/AttributeError, int32 targets or padding written as -1 raised
    RuntimeError/IndexError, a NaN model gave NaN logs, and a partial window with no counted target raised
    ZeroDivisionError; OneCycleLR stepped per micro-batch raises after total_steps scheduler steps."""
    import numpy as np

    with pytest.raises(ValueError, match="step_per_micro"):
        windows.adam_step_count(5, 4, "no")
    with pytest.raises(ValueError, match="reset_seed"):
        windows.dropout_masks(20, 4, (512,), reset_seed="no")
    with pytest.raises(ValueError, match="optimizer_first"):
        windows.scheduler_order_warnings(4, 3, optimizer_first=None)
    for kwargs in (dict(seed=0.5), dict(shape=4), dict(shape=(-1,))):
        with pytest.raises(ValueError):
            windows.dropout_masks(**(dict(steps=2, k=2, shape=(4,)) | kwargs))
    with pytest.raises(ValueError, match="tensor"):
        windows.mask_agreement([[1, 0], [1, 1]])
    with pytest.raises(ValueError, match="lr"):
        windows.lr_trajectory(3, 4, 8, False, lr=float("nan"))
    with pytest.raises(ValueError, match="int64"):
        windows.token_loss(torch.randn(2, 5, 7), torch.zeros(2, 5, dtype=torch.int32))
    with pytest.raises(ValueError, match="-100"):
        windows.token_loss(torch.randn(2, 5, 7), torch.full((2, 5), -1))
    assert windows.onecycle_steps_before_error(10, 4) == 10 and windows.onecycle_steps_before_error(10, 1) is None
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x, y = torch.randn(32, 6, dtype=torch.float64), torch.randint(0, 3, (32,))
    ignored = nn.CrossEntropyLoss(ignore_index=0)
    with pytest.raises(ValueError, match="finite, nonzero step"):
        windows.partial_step_ratio(model, ignored, x, torch.zeros_like(y), 4, 4, 1, "sgd", 0.1)
    ratio = windows.partial_step_ratio(
        model, nn.CrossEntropyLoss(), x, y, 4, 4, np.int64(1).item(), "sgd", np.float32(0.1)
    )  # a NumPy learning rate is a number
    assert ratio == pytest.approx(0.25)
    with pytest.raises(ValueError, match="NumPy integer"):
        windows.partial_step_ratio(model, nn.CrossEntropyLoss(), x, y, 4, 4, np.int64(1), "sgd", 0.1)


def test_weighted_token_loss_divides_by_the_summed_target_weights():
    """Chapter 6's recipe for a weighted CrossEntropyLoss: the window's summed loss over its summed target weights
    is the full batch's mean (which divides by them); over the token count it is not. Label smoothing keeps it."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 5, 7, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, 7, (4, 5), generator=gen)
    targets[0, 3:] = -100
    targets[2, 1:] = -100
    weight = torch.rand(7, generator=gen, dtype=torch.float64) + 0.2
    for smoothing in (0.0, 0.1):
        mean = torch.nn.CrossEntropyLoss(weight=weight, label_smoothing=smoothing)
        total = torch.nn.CrossEntropyLoss(weight=weight, label_smoothing=smoothing, reduction="sum")
        full = float(mean(logits.reshape(-1, 7), targets.reshape(-1)))
        window_sum = sum(
            float(total(lg.reshape(-1, 7), tg.reshape(-1))) for lg, tg in zip(logits.chunk(2), targets.chunk(2))
        )
        counted = targets[targets != -100]
        assert abs(window_sum / float(weight[counted].sum()) - full) < 1e-12
        assert abs(window_sum / len(counted) - full) > 1e-3


# ------------------------------------------------------------------ short micro-batches, token counts and schedules


def test_a_short_last_micro_batch_needs_the_sample_count(digits):
    """The page: dividing a partial window by k' is exact only for full micro-batches. With micro-batches of 8, 8
    and 2 images (DataLoader(drop_last=False)), dividing by k' = 3 misses the mean gradient of the 18 samples by
    about half or more; the summed loss over 18 is exact."""
    from gradaccum.accumulate import agreement, flat_grad, full_batch_gradient
    from gradaccum.book.models import make_cnn

    x, y = digits.x_train[:18], digits.y_train[:18]
    for seed in (0, 1, 2):
        model = make_cnn("group", seed=seed)
        ref = full_batch_gradient(model, nn.CrossEntropyLoss(), x, y)
        parts = [(x[:8], y[:8]), (x[8:16], y[8:16]), (x[16:], y[16:])]
        errors = []
        for divide in ("k_prime", "samples"):
            model.zero_grad(set_to_none=True)
            for xb, yb in parts:
                if divide == "k_prime":
                    (nn.functional.cross_entropy(model(xb), yb) / 3).backward()
                else:
                    (nn.functional.cross_entropy(model(xb), yb, reduction="sum") / 18).backward()
            errors.append(agreement(flat_grad(model), ref).rel_error)
        assert errors[0] > 0.3 and errors[1] < 1e-12, (seed, errors)


def test_token_loss_refuses_other_layouts_and_empty_means():
    """Review: logits laid out (N, V, T) for F.cross_entropy failed with torch's message on the batch size (and with
    V = T, which no shape check can tell apart, gave a wrong number: the docstring states the layout); a mean over
    no token was NaN."""
    torch.manual_seed(0)
    logits, y = torch.randn(4, 12, 10), torch.randint(0, 10, (4, 12))
    with pytest.raises(ValueError, match="transpose"):
        windows.token_loss(logits.transpose(1, 2), y)
    with pytest.raises(ValueError, match="every target is padding"):
        windows.token_loss(logits, torch.full_like(y, windows.IGNORE))
    assert float(windows.token_loss(logits, torch.full_like(y, windows.IGNORE), reduction="sum")) == 0.0


def test_a_cosine_schedule_stepped_per_micro_batch_restarts():
    """Sixth review (the diagnosis table): CosineAnnealingLR stepped once per micro-batch does not just decay K
    times too fast: past T_max it follows the cosine back up, reaching 0 after T_max/K optimizer steps and the peak
    again after twice that; stepped once per optimizer step it decays once."""
    t_max, k = 20, 4

    def used(per_micro: bool) -> list[float]:
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, t_max)
        lrs = []
        for _ in range(3 * t_max // k):
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            for _ in range(k if per_micro else 1):
                sched.step()
        return lrs

    wrong, right = used(True), used(False)
    assert wrong[t_max // k] < 1e-12 and abs(wrong[2 * t_max // k] - 1) < 1e-12
    assert all(a >= b for a, b in zip(right, right[1:]))


def test_count_tokens_refuses_float_targets():
    from gradaccum.windows import count_tokens

    assert count_tokens(torch.tensor([-100, 3, 4])) == 2
    with pytest.raises(ValueError, match="integer class targets"):
        count_tokens(torch.tensor([-100.0, -100.5]))


def test_counts_are_graded_exactly_and_weighted_probability_targets_divide_by_samples():
    """Review 7: a count grader accepted anything within half a unit of the third significant digit (999 and 1001
    for 1000); a count now matches exactly, and the round-down slip is named. Chapter 6's weighted-loss rule is for
    class-index targets: with probability targets PyTorch's weighted mean divides by the number of samples."""
    for wrong in (999, 1001):
        assert not ex.grade_warmup_end(wrong, warmup=16000, k=16)
    assert ex.grade_warmup_end(1000, warmup=16000, k=16)
    assert "round up" in ex.grade_warmup_end(3333, warmup=10000, k=3).message
    assert not ex.grade_accelerate_warmup_end(999, warmup=8000, processes=8, k=4)
    assert "sum of the micro-batch means" in ex.grade_window_token_loss(1.3).message
    torch.manual_seed(0)
    logits, labels = torch.randn(6, 4, dtype=torch.float64), torch.tensor([0, 1, 2, 3, 1, 1])
    w = torch.tensor([1.0, 2.0, 0.5, 3.0], dtype=torch.float64)
    total = F.cross_entropy(logits, labels, weight=w, reduction="sum")
    assert torch.allclose(F.cross_entropy(logits, labels, weight=w), total / w[labels].sum())
    soft = F.one_hot(labels, 4).double()
    total = F.cross_entropy(logits, soft, weight=w, reduction="sum")
    assert torch.allclose(F.cross_entropy(logits, soft, weight=w), total / 6)
    with pytest.raises(ValueError, match="seed"):
        windows.partial_step_ratio(
            nn.Linear(3, 2),
            nn.CrossEntropyLoss(),
            torch.randn(8, 3),
            torch.zeros(8).long(),
            4,
            3,
            2,
            "sgd",
            0.1,
            seed=-1,
        )


def loaded(names: tuple[str, ...]) -> list[str]:
    """The modules of ``names`` that the process running this job has not imported."""
    import sys

    return [name for name in names if name not in sys.modules]


@pytest.mark.slow
def test_the_helpers_fork_from_a_server_that_imported_what_they_need():
    """The fork server ignores a preload it cannot import; every name in HELPER_MODULES must be a module, and the
    study's processes must find them imported (the seconds the chapter saves)."""
    from multiprocessing import forkserver

    from gradaccum.book import parallel

    parallel.shutdown()
    forkserver._forkserver._stop()  # a server another test started keeps what it preloaded
    try:
        if not ch6.start_helpers():
            pytest.skip("this platform has no fork server")
        missing = parallel.run_jobs(loaded, [dict(names=ch6.HELPER_MODULES)] * 2, 2, start_method="forkserver")
        assert missing == [[], []]
    finally:
        parallel.shutdown()
        forkserver._forkserver._stop()
