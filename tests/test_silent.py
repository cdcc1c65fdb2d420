import pytest
import torch

from gradaccum import silent as S
from gradaccum.accumulate import agreement


@pytest.fixture(scope="module")
def lm():
    lines = S.load_corpus()
    vocab = S.make_vocab(lines)
    return lines, vocab, S.make_lm(vocab)


def test_corpus_and_encoding(lm):
    lines, vocab, _ = lm
    assert len(lines) == 52 and min(map(len, lines)) == 19 and max(map(len, lines)) == 157
    x, y = S.encode_batch(["abc", "hello"], S.make_vocab(["abc", "hello"]))
    assert x.shape == (2, 4) and S.count_tokens(y) == 2 + 4 and (y[0, 2:] == S.IGNORE).all()
    with pytest.raises(ValueError):
        S.encode_batch([], vocab)


def test_equal_token_counts_make_mean_of_means_exact(lm):
    lines, vocab, model = lm
    x, y = S.encode_batch(S.spread_lines(lines, 16, 40, 0), vocab)
    ref = S.token_mean_gradient(model, x, y)
    assert agreement(ref, S.window_gradient(model, x, y, 4, "mean_of_means")).rel_error < 1e-12


def test_unequal_counts_need_window_tokens(lm):
    lines, vocab, model = lm
    x, y = S.encode_batch(S.spread_lines(lines, 16, 50, 39, seed=1, sort=True), vocab)
    ref = S.token_mean_gradient(model, x, y)
    assert agreement(ref, S.window_gradient(model, x, y, 4, "mean_of_means")).rel_error > 0.05
    assert agreement(ref, S.window_gradient(model, x, y, 4, "window_tokens")).rel_error < 1e-12
    assert agreement(ref, S.ranks_gradient(model, x, y, 2, 2, global_count=True)).rel_error < 1e-12
    assert agreement(ref, S.ranks_gradient(model, x, y, 2, 2, global_count=False)).rel_error > 0.05


def test_window_backward_errors(lm):
    lines, vocab, model = lm
    x, y = S.encode_batch(lines[:4], vocab)
    with pytest.raises(ValueError, match="normalization"):
        S.window_backward(model, x, y, 2, "median")  # type: ignore[arg-type]
    y_pad = torch.full_like(y, S.IGNORE)
    with pytest.raises(ValueError, match="no tokens"):
        S.window_backward(model, x, y_pad, 2)
    with pytest.raises(ValueError, match="only padding"):
        S.window_backward(model, x, y_pad, 2, "mean_of_means")
    with pytest.raises(ValueError, match="spread"):
        S.spread_lines(lines, 4, 10, 10)


def test_dropout_masks():
    fresh = S.mask_agreement(S.dropout_masks(8, 4, (256,)))
    reset = S.mask_agreement(S.dropout_masks(8, 4, (256,), reset_seed=True))
    assert abs(fresh[0] - 0.5) < 0.05 and reset[0] == 1.0 and abs(reset[1] - 0.5) < 0.05
    with pytest.raises(ValueError):
        S.dropout_masks(2, 2, (4,), p=1.0)


def test_step_counting():
    right, warned_right = S.lr_trajectory(8, 4, 8, per_micro=False)
    wrong, warned_wrong = S.lr_trajectory(8, 4, 8, per_micro=True)
    assert right == pytest.approx([(i + 1) / 8 for i in range(8)]) and not warned_right
    assert wrong[1] == 1.0 and warned_wrong  # warmup over after 2 optimizer steps instead of 8
    assert S.adam_step_count(5, 4, False) == 5 and S.adam_step_count(5, 4, True) == 20


def test_partial_window(digits, loss_fn):
    from gradaccum.accumulate import full_batch_gradient
    from gradaccum.models import make_cnn

    model = make_cnn("group")
    x, y = digits.x_train[:24], digits.y_train[:24]  # 3 micro-batches of 8, K = 4
    mean = full_batch_gradient(model, loss_fn, x, y)
    by_k = S.partial_window_gradient(model, loss_fn, x, y, 8, 4, "divide_by_K")
    actual = S.partial_window_gradient(model, loss_fn, x, y, 8, 4, "divide_by_actual")
    assert agreement(mean, actual).rel_error < 1e-12 and torch.allclose(by_k, 0.75 * actual, atol=1e-14)
    assert S.partial_window_gradient(model, loss_fn, x, y, 8, 4, "drop") is None
    with pytest.raises(ValueError, match="between 1 and K"):
        S.partial_window_gradient(model, loss_fn, x, y, 8, 3, "drop")


def test_window_log(lm):
    lines, vocab, model = lm
    x, y = S.encode_batch(S.spread_lines(lines, 8, 50, 39, seed=1, sort=True), vocab)
    log = S.window_log(model, x, y, 4)
    with torch.no_grad():
        assert log.token_mean == pytest.approx(float(S.token_loss(model(x), y)))
    assert log.last_micro < log.token_mean
