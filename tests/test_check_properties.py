"""Property tests: random models, batch shapes, K and correct loops are never flagged; planted bugs always named.

Hypothesis draws the architecture (an MLP with or without LayerNorm and dropout, the book's CNN with GroupNorm,
LayerNorm or no normalization, a transformer-style block, a padded language model), its width, dropout rate and
precision, K and the micro-batch size, the data and the loop. Examples are derandomized (the same on every run).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from test_check_zoo import (
    CORRECT,
    LAMBDA_TOKEN_LOSS,
    Block,
    CharLM,
    bug_clip_per_micro,
    bug_clip_running,
    bug_double_k,
    bug_missing_k,
    bug_optimizer_each,
    bug_reseed_each,
    bug_scheduler_each,
    bug_zero_grad_inside,
    correct_plain,
    lm_batch,
    token_window_correct,
)
from torch import nn

from gradaccum import checker as C
from gradaccum.book.models import make_cnn

SETTINGS = settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@st.composite
def setups(draw, random_lengths: bool = False):
    """(model, loss_fn, x, y, k, has_dropout) for a random correct set-up without batch-coupled layers."""
    kind = draw(st.sampled_from(["mlp", "cnn", "block", "lm"] if not random_lengths else ["lm"]))
    k = draw(st.integers(1, 4))
    b = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 10_000))
    p = draw(st.sampled_from([0.0, 0.1, 0.5]))
    dtype = draw(st.sampled_from([torch.float64, torch.float64, torch.float32]))
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if kind == "mlp":
            width = draw(st.sampled_from([8, 16, 32]))
            layers: list[nn.Module] = [nn.Flatten(), nn.Linear(64, width)]
            for _ in range(draw(st.integers(0, 2))):
                if draw(st.booleans()):
                    layers.append(nn.LayerNorm(width))
                layers += [nn.Tanh() if draw(st.booleans()) else nn.ReLU(), nn.Dropout(p), nn.Linear(width, width)]
            model = nn.Sequential(*layers, nn.ReLU(), nn.Linear(width, 10))
        elif kind == "cnn":
            model = make_cnn(draw(st.sampled_from(["group", "layer", "none"])), seed=seed, widths=(4, 8, 16))
        elif kind == "block":
            model = Block(d=draw(st.sampled_from([8, 16])), heads=draw(st.sampled_from([1, 2])), p=p)
        else:
            model = CharLM(p=p)
    model = model.to(dtype)
    n = k * b
    lengths: list[int] = []
    if kind == "lm":
        if random_lengths:
            lengths = [int(v) for v in torch.randint(1, 13, (n,), generator=gen)]
        else:
            lengths = [draw(st.integers(1, 12))] * n  # padding everywhere, the same token count per micro-batch
    random_layers = any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules())
    if kind == "lm":
        x, y = lm_batch(lengths, seed=seed)
        return model, LAMBDA_TOKEN_LOSS, x, y, k, random_layers
    d = _digits()
    idx = torch.randperm(d.x_train.shape[0], generator=gen)[:n]
    return model, nn.CrossEntropyLoss(), d.x_train[idx].to(dtype), d.y_train[idx], k, random_layers


_CACHE: dict[str, object] = {}


def _digits():
    if "d" not in _CACHE:
        from gradaccum.book.data import load_digits_split

        _CACHE["d"] = load_digits_split()
    return _CACHE["d"]


@pytest.mark.slow
@SETTINGS
@given(setup=setups(), loop=st.sampled_from(sorted(CORRECT)))
def test_random_correct_loops_are_never_flagged(setup, loop):
    model, loss_fn, x, y, k, _ = setup
    report = C.check(model, loss_fn, x, y, k, step=CORRECT[loop])
    assert report.ok and report.codes == [], f"{loop}, K = {k}\n{report}"


@pytest.mark.slow
@SETTINGS
@given(setup=setups(random_lengths=True))
def test_random_token_windows_normalized_by_window_tokens_are_never_flagged(setup):
    model, loss_fn, x, y, k, _ = setup
    report = C.check(model, loss_fn, x, y, k, step=token_window_correct)
    assert report.ok and report.codes == [], str(report)


BUGS = {
    "missing_1_over_k": bug_missing_k,
    "double_1_over_k": bug_double_k,
    "zero_grad_inside_window": bug_zero_grad_inside,
    "optimizer_step_inside_window": bug_optimizer_each,
    "scheduler_step_inside_window": bug_scheduler_each,
}


@pytest.mark.slow
@SETTINGS
@given(setup=setups(), code=st.sampled_from(sorted(BUGS)))
def test_random_planted_bugs_are_named(setup, code):
    model, loss_fn, x, y, k, _ = setup
    if k == 1:
        k = 2
        x, y = torch.cat([x, x.flip(0)]), torch.cat([y, y.flip(0)])
    report = C.check(model, loss_fn, x, y, k, step=BUGS[code])
    assert report.codes == [code], f"K = {k}\n{report}"


@pytest.mark.slow
@SETTINGS
@given(setup=setups())
def test_reseeding_is_named_whenever_the_model_draws_random_numbers(setup):
    model, loss_fn, x, y, k, has_dropout = setup
    report = C.check(model, loss_fn, x, y, k, step=bug_reseed_each)
    assert report.codes == (["rng_reseeded"] if has_dropout else []), str(report)


@pytest.mark.slow
@SETTINGS
@given(setup=setups(random_lengths=True))
def test_mean_of_token_means_is_named_when_token_counts_differ(setup):
    model, loss_fn, x, y, k, _ = setup
    counts = [int((yb != -100).sum()) for yb in y.chunk(k)]
    report = C.check(model, loss_fn, x, y, k, step=correct_plain)
    assert report.codes == (["token_normalization"] if len(set(counts)) > 1 else []), f"{counts}\n{report}"


@pytest.mark.slow
@SETTINGS
@given(setup=setups(random_lengths=True), per_micro=st.booleans())
def test_a_clip_inside_the_window_does_not_hide_a_mean_of_token_means(setup, per_micro):
    """Review: clipping the running buffer hid the mean of token means (only the clip was named). What each
    backward adds is read before the clip, so both are named, whether the clip bites or not."""
    model, loss_fn, x, y, k, _ = setup
    assume(k > 1)  # (K = 1 has no clip inside the window)
    counts = [int((yb != -100).sum()) for yb in y.chunk(k)]
    step = bug_clip_per_micro if per_micro else bug_clip_running
    report = C.check(model, loss_fn, x, y, k, step=step)
    clip = "clip_per_micro_batch" if per_micro else "clip_running_buffer"
    token = {"token_normalization"} if len(set(counts)) > 1 else set()
    assert set(report.codes) == {clip} | token, f"K = {k}, tokens {counts}\n{report}"
