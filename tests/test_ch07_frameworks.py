"""Chapter 7's book layer: the measurements behind the behaviour table, the figures, the widget's function, and
the numbers the exercise solutions state (recomputed by running the frameworks)."""

from __future__ import annotations

from types import SimpleNamespace

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from gradaccum import frameworks as fw  # noqa: E402
from gradaccum.book import ch07_frameworks as ch7  # noqa: E402
from gradaccum.book import ch07_harness as harness  # noqa: E402
from gradaccum.book import exercises as ex  # noqa: E402
from gradaccum.book.data import load_corpus, load_digits_split, make_vocab  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def digits():
    d = load_digits_split()
    return d.x_train.float(), d.y_train


@pytest.fixture(scope="module")
def corpus():
    lines = load_corpus()
    vocab = make_vocab(lines)
    return (*ch7.lm_batch(lines, vocab), vocab)


def test_step_weight_is_the_least_squares_factor():
    r = torch.tensor([1.0, 2.0, -1.0])
    assert harness.step_factor(0.375 * r, r) == pytest.approx(0.375)


def test_measure_one_framework(digits, corpus):
    x, y = digits
    lm_x, lm_y, vocab = corpus
    s = ch7.measure("timm", x, y, lm_x, lm_y, vocab)
    assert s.steps_per_window == 1 and s.scheduler_per_step == 1
    assert s.dropout_error < ch7.EXACT and s.dropout_codes == []
    assert s.clip_error < ch7.EXACT and s.partial_weight == pytest.approx(1.0, abs=1e-6)
    assert 0.1 < s.token_error < 0.2 and s.recipe_error < ch7.EXACT
    assert s.bn_per_step == ch7.K and s.bn_error > 0.1
    assert s.fp16 == "not offered" and s.logged == "the last micro-batch's mean"
    assert s.kwargs_mean_factor is None  # the Trainer only
    linear = [fw.LR * min(1, (i + 1) / 8) for i in range(10)]
    assert s.lrs == pytest.approx(linear)


def test_the_logged_loss_is_classified_by_value():
    means, token_mean = [2.0, 4.0], 2.5
    run = fw.Run("x", 2, 2)
    assert ch7._logged(run, means, token_mean) == "nothing (you log)"
    for logged, what in [
        ([2.0, 4.0], "each micro-batch's mean"),
        ([1.0, 2.0], "each micro-batch's mean ÷ K"),
        ([2.5], "the token mean"),
        ([3.0], "the mean of micro-batch means"),
        ([4.0], "the last micro-batch's mean"),
        ([9.0], "other"),
    ]:
        run.logged = logged
        assert ch7._logged(run, means, token_mean) == what


def test_behaviour_rows_have_one_cell_per_framework_and_row(digits, corpus):
    x, y = digits
    lm_x, lm_y, vocab = corpus
    single = {n: ch7.measure(n, x, y, lm_x, lm_y, vocab) for n in ("nanogpt", "timm")}
    multi = {
        n: harness.RankResult(n, 1, 0 if n == "nanogpt" else 1, 1, 0.12, None if n == "nanogpt" else 1e-7, [])
        for n in single
    }
    rows = ch7.behaviour_rows(single, multi, ch7.bf16_full_batch_error(x, y))
    assert [r[0] for r in rows] == list(ch7.ROWS) and all(len(r) == 3 for r in rows)
    table = dict((r[0], r[1:]) for r in rows)
    assert table["last partial window (2 of K = 4)"] == ["never used", "full weight"]
    assert table["padded tokens, its token recipe, 1 process"] == ["no recipe", "✓ exact"]
    assert table["scheduler steps per optimizer step, 1 process"] == ["no scheduler", "1"]
    assert "as the full batch" in table["bf16 autocast: as accurate as a bf16 full batch"][0]


@pytest.mark.slow
def test_partial_weights_follow_the_rules(digits):
    x, y = digits
    points = ch7.partial_weights(x, y, ks=(2, 3), frameworks=("lightning", "timm"))
    assert [(k, r) for k, r, _ in points["lightning"]] == [(2, 1), (3, 1), (3, 2)]
    assert all(w == pytest.approx(r / k, abs=1e-6) for k, r, w in points["lightning"])
    assert all(w == pytest.approx(1.0, abs=1e-6) for _, _, w in points["timm"])


@pytest.mark.slow
def test_figures_and_the_widget_function(digits):
    x, y = digits
    for fig in (
        ch7.plot_lrs({"timm": [0.1, 0.2]}, {"timm": [0.1, 0.2]}, 2),
        ch7.plot_partial_weights({"timm": [(2, 1, 1.0)], "lightning": [(2, 1, 0.5)]}),
        ch7.plot_epoch_weights(x, y, 5, 2),
    ):
        assert fig.axes
        plt.close(fig)
    with pytest.raises(ValueError, match="at least one micro-batch"):
        ch7.plot_epoch_weights(x, y, 0, 2)
    with pytest.raises(ValueError, match="samples"):
        ch7.step_weights("timm", x, y, 1000, 4, b=4)


def test_digits_module_is_a_lightning_module_of_the_readers_kind(digits):
    import pytorch_lightning as pl

    x, y = digits
    module = ch7.digits_module()
    assert isinstance(module, pl.LightningModule) and module(x[:3]).shape == (3, 10)


def test_exercise_solution_numbers(digits, monkeypatch):
    """ex-ch7-partial: 90 micro-batches, K = 16 → Lightning 10/16 = 0.625, the Trainer 1 (both run). ex-ch7-tokens:
    the recipe's factor 4 · 2 / 260 (the recipe itself runs exact on two processes: test_frameworks.test_two_processes).
    ex-ch7-warmup:
    Accelerate's prepared scheduler (its real step(), told there are 8 processes) has taken a 600-step warmup's
    600 steps after optimizer step 75."""
    x, y = digits
    weights = {n: ch7.step_weights(n, x, y, 90, 16, b=2) for n in ("lightning", "trainer")}
    assert weights["lightning"][-1] == pytest.approx(0.625, abs=1e-6) and len(weights["lightning"]) == 6
    assert weights["trainer"][-1] == pytest.approx(1.0, abs=1e-6)
    assert ex.grade_framework_partial_weight(weights["lightning"][-1], micro_batches=90, k=16)
    tokens = ((30, 50, 20, 40), (40, 40, 10, 30))
    assert ex.grade_accelerate_token_factor(4 * 2 / sum(map(sum, tokens)), rank_tokens=tokens)
    assert 4 * 2 / 260 == pytest.approx(0.0308, abs=5e-5)

    import accelerate.scheduler as acc_scheduler
    from accelerate.state import GradientState

    class EightProcesses:
        num_processes = 8

    monkeypatch.setattr(acc_scheduler, "AcceleratorState", EightProcesses)
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    warm = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 600))
    wrapped = SimpleNamespace(step_was_skipped=False)  # what the scheduler asks of a prepared optimizer
    prepared = acc_scheduler.AcceleratedScheduler(warm, [wrapped], step_with_optimizer=True, split_batches=False)
    GradientState._reset_state()
    state = GradientState()
    peak = None
    for step in range(1, 200):
        for micro in range(4):  # K = 4: the scheduler is stepped on every micro-batch, as the guide does
            state._set_sync_gradients(micro == 3)
            prepared.step()
        if peak is None and opt.param_groups[0]["lr"] == 1.0:
            peak = step
    GradientState._reset_state()
    assert peak == 75 and ex.grade_accelerate_warmup_end(peak, warmup=600, processes=8, k=4)


def _token_lm_counting_after_the_window(k: int):
    """A LightningModule written for this test (the ex-ch7-lightning-tokens solution's second way): each
    micro-batch returns its summed token loss times K (undoing Lightning's 1/K), counts its target tokens, and
    ``on_before_optimizer_step`` divides the window's gradient by the count once."""
    import pytorch_lightning as pl

    class CountAfterWindow(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(7, 5, dtype=torch.float64)
            self.head = nn.Linear(5, 7, dtype=torch.float64)
            self.tokens = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.embed(x))

        def training_step(self, batch, batch_idx):
            x, y = batch
            self.tokens += int((y != -100).sum())
            summed = nn.functional.cross_entropy(self(x).flatten(0, 1), y.flatten(), reduction="sum")
            return summed * k

        def on_before_optimizer_step(self, optimizer):
            for p in self.parameters():
                p.grad /= self.tokens
            self.tokens = 0

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return CountAfterWindow()


@pytest.mark.slow
@pytest.mark.parametrize("clip", [None, 0.05])
def test_lightning_can_divide_by_the_window_tokens_after_the_last_backward(clip):
    """ex-ch7-lightning-tokens: the token count need not be known before the window. Lightning calls
    on_before_optimizer_step after the window's last backward and before its clip, so dividing the gradient by the
    counted tokens there gives the full batch's token-mean gradient, clipped or not, and a short last window is
    divided by its own count (the checker finds no partial-window weighting)."""
    from gradaccum.checker import check

    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 7, (32, 6), generator=gen)
    y = torch.randint(0, 7, (32, 6), generator=gen)
    lengths = torch.randint(1, 7, (32,), generator=gen)
    y[torch.arange(6)[None, :] >= lengths[:, None]] = -100  # padded rows of unequal length

    def token_mean(logits, labels):
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())

    options = {} if clip is None else {"gradient_clip_val": clip}
    report = check(
        _token_lm_counting_after_the_window(4),
        token_mean,
        x,
        y,
        4,
        step=fw.lightning_module_step(k=4, **options),
        clip=clip,
    )
    assert report.codes == [] and report.rel_error < 1e-9


def test_partial_window_curves(digits):
    x, y = digits
    curves = ch7.partial_window_curves(
        x, y, seeds=(0,), schedules=("constant",), epochs=3, frameworks=("lightning", "timm")
    )
    light, timm = curves.losses["lightning", 0, "constant"], curves.losses["timm", 0, "constant"]
    assert len(light) == len(timm) == 3
    assert all(a > b for a, b in zip(light, timm))  # the half-weight step: less progress
    fig = ch7.plot_partial_curves(curves, seed=0)
    assert len(fig.axes) == 1
    plt.close(fig)


@pytest.mark.slow
def test_the_trainer_on_transformers_own_causal_lms(corpus):
    """Llama declares its shifting loss and is exact; GPT-2 (5.23.0) does not, and each step is the ratio of the
    shifted to the counted labels."""
    lm_x, lm_y, vocab = corpus
    labels = ch7.causal_lm_labels(lm_x, lm_y)
    assert torch.equal(labels != fw.IGNORE, lm_y != fw.IGNORE)
    llama = ch7.builtin_lm_step("llama", lm_x, lm_y, vocab)
    gpt2 = ch7.builtin_lm_step("gpt2", lm_x, lm_y, vocab)
    ratio = float((labels[:, 1:] != fw.IGNORE).sum() / (labels != fw.IGNORE).sum())
    assert llama.error < ch7.EXACT and llama.weight == pytest.approx(1.0, abs=1e-6)
    assert gpt2.weight == pytest.approx(ratio, abs=1e-6) and ratio < 0.99


def test_study_helpers_and_runner_refuse_input_that_would_measure_nothing():
    """Found by review: step_weights with b = 0, a seed past the data (empty slices: NaN ratios), a misspelt
    schedule (silently constant), lr = nan, a nanoGPT-style run with fewer micro-batches than K (no step at all)
    and trainer_on_causal_lm with k = 0 (ZeroDivisionError)."""
    x, y = torch.randn(64, 64), torch.arange(64) % 10
    with pytest.raises(ValueError, match="micro-batch size"):
        ch7.step_weights("timm", x, y, 6, 4, b=0)
    with pytest.raises(ValueError, match="seed 100"):
        ch7.bf16_accumulation_ratios(x, y, seeds=(100,))
    with pytest.raises(ValueError, match="'Cosine'"):
        ch7.partial_window_curves(x, y, schedules=("Cosine",))
    ce, micro = nn.CrossEntropyLoss(), fw.split(x[:24], y[:24], 3)
    with pytest.raises(ValueError, match="lr"):
        fw.run("timm", ch7.digits_mlp(), ce, micro, 2, lr=float("nan"))
    with pytest.raises(ValueError, match="nanoGPT"):
        fw.run("nanogpt", ch7.digits_mlp(), ce, micro, 4)
    with pytest.raises(ValueError, match="K"):
        harness.trainer_on_causal_lm(ch7.digits_mlp(), torch.zeros(4, 3, dtype=torch.int64), torch.zeros(4, 3), 0)


def test_helpers_refuse_empty_and_impossible_arguments():
    """bf16_full_batch_error(k=1000) used fewer samples than asked, k=0 blamed a zero reference; empty ks, seeds and
    schedules returned nothing or a NumPy error; K = 1 has no partial window."""
    from gradaccum.book import data as book_data

    digits = book_data.load_digits_split()
    x, y = digits.x_train.float(), digits.y_train
    bad = [
        lambda: ch7.bf16_full_batch_error(x, y, k=1000),
        lambda: ch7.bf16_full_batch_error(x, y, k=0),
        lambda: ch7.bf16_accumulation_ratios(x, y, ks=()),
        lambda: ch7.bf16_accumulation_ratios(x, y, seeds=()),
        lambda: ch7.partial_weights(x, y, ks=()),
        lambda: ch7.partial_weights(x, y, ks=(1,)),
        lambda: ch7.partial_window_curves(x, y, schedules=()),
    ]
    for call in bad:
        with pytest.raises(ValueError):
            call()


# ------------------------------------------------------------------ transformers' heads and nanoGPT's loop


@pytest.mark.slow
@pytest.mark.parametrize("k", [2, 4])
def test_transformers_classification_heads_get_k_times_the_gradient(k):
    """Review (transformers #47688): BertForSequenceClassification and LlamaForSequenceClassification take
    **kwargs, so the Trainer skips its 1/K, but their loss ignores num_items_in_batch: the step is K times the full
    batch's; accepts_loss_kwargs = False restores it. The token-level heads (BertForTokenClassification,
    BertForMaskedLM; fifth review) do the same with their token means: about K times, each micro-batch's token mean
    weighted alike (not exactly K: the micro-batches hold different numbers of tokens)."""
    lines = load_corpus()
    vocab = make_vocab(lines)
    lm_x, lm_y = ch7.lm_batch(lines, vocab)
    for kind in ("bert", "llama"):
        assert abs(ch7.builtin_classifier_step(kind, lm_x, lm_y, vocab, k=k).weight - k) < 1e-4
    for kind in ("bert-token", "bert-mlm"):
        step = ch7.builtin_classifier_step(kind, lm_x, lm_y, vocab, k=k)
        assert 0.95 * k < step.weight < 1.05 * k and step.error > k - 1.1, (kind, step)
    assert ch7.builtin_classifier_step("bert", lm_x, lm_y, vocab, k=k, opt_out=True).error < ch7.EXACT
    assert ch7.builtin_classifier_step("bert-token", lm_x, lm_y, vocab, k=k, opt_out=True).error > 0.01
    if k == 2:  # sixth review: ViT hands the count to the library's loss; compute_loss_func; loss_is_scaled_for_ga
        assert ch7.builtin_classifier_step("vit", lm_x, lm_y, vocab, k=k).error < ch7.EXACT
        assert abs(ch7.builtin_classifier_step("vit-regression", lm_x, lm_y, vocab, k=k).weight - k) < 1e-4
        assert abs(ch7.builtin_classifier_step("bert", lm_x, lm_y, vocab, k=k, loss_func="mean").weight - k) < 1e-4
        assert ch7.builtin_classifier_step("bert-token", lm_x, lm_y, vocab, k=k, loss_func="count").error < ch7.EXACT
        flag = ch7.builtin_classifier_step("vit-regression", lm_x, lm_y, vocab, k=k, scaled_for_ga=False)
        assert flag.error < ch7.EXACT
        for bad in ({"loss_func": "sum"}, {"scaled_for_ga": 1}):
            with pytest.raises(ValueError, match="must be None"):
                ch7.builtin_classifier_step("bert", lm_x, lm_y, vocab, k=k, **bad)
    with pytest.raises(ValueError, match="kind must be one of"):
        harness.tiny_classifier("gpt2", vocab.size, lm_x.shape[1])


def test_the_nanogpt_loop_refuses_what_it_does_not_do(digits):
    """Review: cosine was ignored, and partial-window measurements reported a weight for a window it never runs."""
    x, y = digits
    micro = fw.split(x[:16], y[:16], 8)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    with pytest.raises(ValueError, match="cosine is not supported"):
        fw.run("nanogpt", model, nn.CrossEntropyLoss(), micro, 4, cosine=6)
    with pytest.raises(ValueError, match="never runs a partial window"):
        ch7.partial_weights(x, y, ks=(4,), frameworks=("nanogpt",))
    frozen = nn.Sequential(nn.Flatten(), nn.Linear(64, 10)).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameter"):
        fw.run("timm", frozen, nn.CrossEntropyLoss(), micro, 4)


def test_loss_type_is_refused_when_not_a_name():
    with pytest.raises(ValueError, match="loss_type"):
        ch7.builtin_lm_step(
            "gpt2", torch.zeros(4, 3, dtype=torch.long), torch.zeros(4, 3, dtype=torch.long), None, loss_type=1
        )  # type: ignore[arg-type]


def _features(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random 64-feature inputs and 10-class labels (the shape the chapter's MLP takes)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g)


@pytest.mark.parametrize("k", [2, 3])
def test_an_unguarded_accelerate_clip_raises_at_the_second_micro_batch_under_fp16(k):
    from gradaccum.book import ch07_fp16

    x, y = _features(4 * k)
    with_scaler = ch07_fp16.unguarded_clip(x, y, k=k, b=4)
    assert with_scaler.failed_at == 2 and with_scaler.clips == 1
    assert "unscale_() has already been called" in with_scaler.error  # GradScaler's own refusal
    without = ch07_fp16.unguarded_clip(x, y, k=k, b=4, scaler=False)
    assert without.error is None and without.clips == without.micro_batches == k


def test_a_step_the_scaler_skips_skips_acceleratess_prepared_scheduler():
    from gradaccum.book import ch07_fp16

    x, y = _features(2 * 2 * 4, seed=1)
    first = ch07_fp16.skipped_windows(x, y, k=2, b=4, windows=2, overflow_window=0)
    assert first.skipped == [True, False]
    assert first.optimizer_steps == first.scheduler_steps == 1
    assert first.scales == [2.0**15, 2.0**15]
    last = ch07_fp16.skipped_windows(x, y, k=2, b=4, windows=2, overflow_window=1)
    assert last.skipped == [False, True] and last.optimizer_steps == last.scheduler_steps == 1
    assert last.scales == [2.0**16, 2.0**15]


def test_the_fp16_probes_refuse_impossible_arguments():
    from gradaccum.book import ch07_fp16

    x, y = _features(16)
    with pytest.raises(ValueError, match="overflow_window"):
        ch07_fp16.skipped_windows(x, y, k=2, b=4, windows=2, overflow_window=2)
    with pytest.raises(ValueError, match="samples"):
        ch07_fp16.skipped_windows(x, y, k=2, b=4, windows=3)
    with pytest.raises(ValueError):
        ch07_fp16.unguarded_clip(x, y, k=0)
