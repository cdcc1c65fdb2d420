"""gradaccum.checker: the demo cases, the issue's reports (each one a regression test), and the checker's promises
(it leaves the model and the random streams alone, refuses bad input with a ValueError, reports instead of crashing).

The matrix of loops and models is in test_check_loops.py, the property tests in test_check_properties.py, the
command line in test_check_cli.py, the book page's examples in test_check_page.py.
"""

import copy
import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from test_check_zoo import (
    LAMBDA_TOKEN_LOSS,
    block,
    char_lm,
    correct_whole_iteration,
    lm_batch,
    mlp,
)
from torch import nn

from gradaccum import checker as C
from gradaccum.book import check_demo
from gradaccum.book.models import make_cnn
from gradaccum.checker import CODES
from gradaccum.checker.run import _bn_rerun_finding


@pytest.fixture(scope="module")
def demo_results():
    """Every demo case checked once per worker, when a test here first asks for it (seconds, after conftest's
    one-thread set-up), not at import, where every collection paid for it: each xdist worker's, `--collect-only`'s
    (half a minute idle, over a minute on a loaded machine)."""
    return check_demo.run_demo()


@pytest.fixture(scope="module")
def by_name(demo_results):
    return {r.name: r for r in demo_results}


@pytest.mark.parametrize("name", list(check_demo.DEMO_EXPECTED))
def test_each_demo_case_gets_exactly_its_verdict(name, by_name):
    result = by_name[name]
    assert result.as_expected, str(result.report)
    assert set(result.report.codes) == set(result.expected), str(result.report)
    if not result.expected:
        assert result.report.ok and not result.report.codes


def test_demo_cases_are_usable_as_returned_and_match_the_expectations():
    cases = check_demo.demo_cases()
    assert list(cases) == list(check_demo.DEMO_EXPECTED)
    model, loss_fn, x, y, step, clip = cases["mean of per-micro-batch token means"]
    assert loss_fn is C.token_cross_entropy  # usable as returned: no private swap
    report = C.check(model, loss_fn, x, y, 4, step=step, clip=clip)
    assert report.codes == ["token_normalization"]


def test_chapter_6_assertions_still_hold(by_name):
    """The demo reports name each planted cause in words a reader recognises (chapter 6 prints them)."""
    for name, cause in [
        ("BatchNorm", "BatchNorm"),
        ("clipping inside the loop", "clipping inside"),
        ("RNG re-seeded per micro-batch", "re-seeded"),
        ("scheduler stepped per micro-batch", "scheduler"),
        ("loss scale changed inside the window", "loss scale"),
        ("mean of per-micro-batch token means", "token"),
    ]:
        report = by_name[name].report
        assert not report.ok and any(cause in f.cause for f in report.findings), name
    assert by_name["correct loop, GroupNorm"].report.ok and by_name["dropout, fresh masks (correct)"].report.ok


def test_every_code_the_checker_can_raise_is_documented():
    import importlib
    import inspect
    import pkgutil

    source = "".join(
        inspect.getsource(importlib.import_module(f"gradaccum.checker.{m.name}"))
        for m in pkgutil.iter_modules(C.__path__)
        if m.name != "__main__"
    )
    import re

    raised = set(re.findall(r'(?:out\.add\(|Finding\()\s*"([a-z0-9_]+)"', source))
    raised |= {code for codes in check_demo.DEMO_EXPECTED.values() for code in codes}
    assert raised == set(CODES), raised ^ set(CODES)


# ------------------------------------------------------------------------------- the reports


def test_layernorm_and_two_dropout_layers_correct_loop_is_ok(digits, loss_fn):
    report = C.check(block(p=0.3), loss_fn, digits.x_train[:32], digits.y_train[:32], 4)
    assert report.ok and not report.findings, str(report)
    report = C.check(mlp(p=0.5), loss_fn, digits.x_train[:32], digits.y_train[:32], 4)
    assert report.ok and not report.findings, str(report)


def test_linear_lr_constructor_step_is_not_counted(digits, loss_fn):
    report = C.check(
        make_cnn("group"), loss_fn, digits.x_train[:16], digits.y_train[:16], 4, step=correct_whole_iteration
    )
    assert report.ok and report.counts["scheduler.step"] == 1 and report.counts["optimizer.step"] == 1, str(report)


def test_missing_1_over_k_reports_k_minus_1_and_cosine_1(by_name):
    result = by_name["missing 1/K"]
    report = result.report
    assert report.rel_error == pytest.approx(3.0, rel=1e-9) and report.cosine == pytest.approx(1.0, abs=1e-12)
    assert report.weights == pytest.approx([1.0] * 4, rel=1e-9)
    assert "= K − 1, cosine 1.0000" in report.findings[0].evidence


def test_scaler_update_every_micro_batch_is_a_finding_not_a_crash(by_name):
    report = by_name["scaler.update() after every micro-batch"].report
    assert report.codes[:2] == ["step_raised", "scaler_update_inside_window"]
    assert "No inf checks were recorded" in report.findings[0].evidence and not report.ok


def test_an_arbitrary_exception_in_the_step_is_reported_with_where_it_happened(digits, loss_fn):
    def broken(model, loss_fn, x, y, k):
        for xb, yb in zip(x.chunk(k), y.chunk(k)):
            (loss_fn(model(xb), yb) / k).backward()
            raise KeyError("labels")

    report = C.check(make_cnn("group"), loss_fn, digits.x_train[:8], digits.y_train[:8], 2, step=broken)
    assert report.codes == ["step_raised"] and "KeyError" in report.findings[0].cause
    assert "test_check.py" in report.findings[0].evidence and "after 1 backward" in report.findings[0].evidence


def test_functional_token_loss_is_probed_not_matched_by_class():
    x, y = lm_batch([1, 2, 3, 4, 9, 10, 11, 12])
    report = C.check(
        char_lm(),
        LAMBDA_TOKEN_LOSS,
        x,
        y,
        2,
        step=lambda m, lf, xs, ys, k: [(lf(m(xb), yb) / k).backward() for xb, yb in zip(xs.chunk(k), ys.chunk(k))],
    )
    assert report.codes == ["token_normalization"], str(report)
    assert "tokens per micro-batch [10, 42]" in report.findings[0].evidence


def test_a_label_smoothing_loss_with_a_custom_padding_id_is_probed_too():
    x, y = lm_batch([1, 2, 3, 4, 9, 10, 11, 12])
    y = torch.where(y == -100, torch.full_like(y, 0), y)  # padding target 0 instead of -100

    def smoothed(out, t):
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), t.reshape(-1), ignore_index=0, label_smoothing=0.1)

    report = C.check(char_lm(), smoothed, x, y, 2)
    assert report.codes == ["token_normalization"], str(report)


def test_clip_grad_norm_imported_by_name_is_recorded(by_name):
    report = by_name["clip once after unscale_ (correct)"].report
    assert report.counts["clip"] == 1 and report.ok
    assert any("clip_grad_norm_ with threshold 1" in n for n in report.notes)


def test_clip_argument_and_loop_threshold_agree(digits, loss_fn):
    from test_check_zoo import correct_clip_once

    model, x, y = make_cnn("group"), digits.x_train[:16], digits.y_train[:16]
    assert C.check(model, loss_fn, x, y, 4, step=correct_clip_once).ok
    assert C.check(model, loss_fn, x, y, 4, step=correct_clip_once, clip=0.05).ok
    wrong = C.check(model, loss_fn, x, y, 4, step=correct_clip_once, clip=0.5)  # the loop clips at 0.05
    assert not wrong.ok and wrong.codes == ["gradient_scaled"], str(wrong)
    unclipped = C.check(model, loss_fn, x, y, 4, clip=0.05)  # plain accumulation never clips
    assert unclipped.codes == ["clip_missing"], str(unclipped)


def test_a_step_that_ignores_its_model_argument_is_told_so(digits, loss_fn):
    other = make_cnn("group")

    def step(model, loss_fn, x, y, k):
        for xb, yb in zip(x.chunk(k), y.chunk(k)):
            (loss_fn(other(xb), yb) / k).backward()

    report = C.check(make_cnn("group"), loss_fn, digits.x_train[:8], digits.y_train[:8], 2, step=step)
    assert report.codes == ["no_gradient"], str(report)


def test_batchnorm_with_micro_batches_of_one_is_a_finding(digits, loss_fn):
    report = C.check(make_cnn("batch"), loss_fn, digits.x_train[:4], digits.y_train[:4], 4)
    assert report.codes == ["model_fails_on_micro_batch"] and "1 sample" in report.findings[0].cause


def test_a_custom_batch_coupled_layer_is_located(digits, loss_fn):
    class Centre(nn.Module):  # subtracts the batch mean: couples samples like BatchNorm without statistics
        def forward(self, h):
            return h - h.mean(0, keepdim=True)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), Centre(), nn.Tanh(), nn.Linear(16, 10)).double()
    report = C.check(model, loss_fn, digits.x_train[:16], digits.y_train[:16], 4)
    assert report.codes == ["batch_coupled_layer"] and "Centre '2'" in report.findings[0].evidence
    assert "BatchNorm" not in report.findings[0].cause


def test_an_in_batch_contrastive_loss_is_named(digits):
    def contrastive(out, y):  # each sample's positive is itself; the others in the batch are negatives
        z = F.normalize(out, dim=1)
        return F.cross_entropy(z @ z.T / 0.1, torch.arange(out.shape[0]))

    report = C.check(mlp(p=0.0), contrastive, digits.x_train[:16], digits.y_train[:16], 4)
    assert report.codes == ["loss_couples_samples"], str(report)


def test_a_partial_window_that_raises_is_a_note_not_a_bug(digits, loss_fn):
    def strict(model, loss_fn, x, y, k):
        if k != 4:
            raise ValueError("this loop always runs 4 micro-batches")
        for xb, yb in zip(x.chunk(k), y.chunk(k)):
            (loss_fn(model(xb), yb) / k).backward()

    report = C.check(make_cnn("group"), loss_fn, digits.x_train[:16], digits.y_train[:16], 4, step=strict)
    assert report.ok and [f.code for f in report.findings] == ["partial_window_not_checked"]
    assert (
        C.check(
            make_cnn("group"), loss_fn, digits.x_train[:16], digits.y_train[:16], 4, step=strict, partial=False
        ).findings
        == []
    )


# ------------------------------------------------------------------------------------------ promises


def test_check_leaves_model_and_rng_alone(digits, loss_fn):
    import random

    model = mlp(p=0.3)
    model[1].weight.grad = torch.ones_like(model[1].weight)
    before = copy.deepcopy(model.state_dict())
    torch.manual_seed(42)
    random.seed(7)
    expected_next, expected_py = torch.rand(3), random.random()
    torch.manual_seed(42)
    random.seed(7)
    C.check(
        model,
        loss_fn,
        digits.x_train[:16],
        digits.y_train[:16],
        4,
        step=check_demo.demo_cases()["RNG re-seeded per micro-batch"][4],
    )
    assert torch.equal(torch.rand(3), expected_next) and random.random() == expected_py
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(model[1].weight.grad, torch.ones_like(model[1].weight))
    assert model[2].weight.grad is None if hasattr(model[2], "weight") else True


def test_bad_input(digits, loss_fn):
    model = make_cnn("group")
    x, y = digits.x_train[:10], digits.y_train[:10]
    with pytest.raises(ValueError, match="divisors of 10"):
        C.check(model, loss_fn, x, y, 4)
    with pytest.raises(ValueError, match="K"):
        C.check(model, loss_fn, x, y, 0)
    with pytest.raises(ValueError, match="clip must be a positive"):
        C.check(model, loss_fn, x, y, 2, clip=-1.0)
    with pytest.raises(ValueError, match="tolerance must be a positive"):
        C.check(model, loss_fn, x, y, 2, tolerance=0)
    with pytest.raises(ValueError, match="seed must be a non-negative int"):
        C.check(model, loss_fn, x, y, 2, seed=-1)
    with pytest.raises(ValueError, match="step must be a function"):
        C.check(model, loss_fn, x, y, 2, step="accumulate")
    with pytest.raises(ValueError, match="torch.nn.Module"):
        C.check(lambda t: t, loss_fn, x, y, 2)

    class TupleModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = make_cnn("group")

        def forward(self, x):
            return self.inner(x), None

    with pytest.raises(ValueError, match="must return a tensor"):
        C.check(TupleModel(), loss_fn, x, y, 2)
    with pytest.raises(ValueError, match="scalar"):
        C.check(model, torch.nn.CrossEntropyLoss(reduction="none"), x, y, 2)
    with pytest.raises(ValueError, match="model\\(x\\) raised"):
        C.check(model, loss_fn, x.reshape(10, 64), y, 2)


def test_report_is_json_ready(demo_results):
    for result in demo_results:
        data = json.loads(json.dumps(result.report.to_dict()))
        assert data["ok"] == result.report.ok and [f["code"] for f in data["findings"]] == [
            f.code for f in result.report.findings
        ]
        assert all(f["severity"] in ("bug", "note", "inconclusive") for f in data["findings"])


@pytest.mark.slow
def test_command_line_demo():
    out = subprocess.run(
        [sys.executable, "-m", "gradaccum.book.check_demo"], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.count("== ") == len(check_demo.DEMO_EXPECTED) and "Traceback" not in out.stderr
    assert (
        f"demo: {len(check_demo.DEMO_EXPECTED)} of {len(check_demo.DEMO_EXPECTED)} verdicts as expected" in out.stdout
    )


def test_a_loss_that_does_not_reach_the_parameters_is_a_value_error(digits):
    frozen = make_cnn("group")
    for p in list(frozen.parameters())[:-1]:
        p.requires_grad_(False)

    def detached(out, y):
        return F.cross_entropy(out.detach(), y)

    with pytest.raises(ValueError, match="differentiable"):
        C.check(frozen, detached, digits.x_train[:8], digits.y_train[:8], 2)


def test_a_step_under_autocast_is_inconclusive_at_the_default_tolerance_and_ok_at_its_precision(digits, loss_fn):
    def bf16(model, loss_fn, x, y, k):
        for xb, yb in zip(x.chunk(k), y.chunk(k)):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_fn(model(xb), yb) / k
            loss.backward()

    def bf16_missing_k(model, loss_fn, x, y, k):
        for xb, yb in zip(x.chunk(k), y.chunk(k)):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_fn(model(xb), yb)
            loss.backward()

    model, x, y = make_cnn("group").float(), digits.x_train[:32].float(), digits.y_train[:32]
    report = C.check(model, loss_fn, x, y, 4, step=bf16)
    assert report.codes == ["autocast_precision"] and not report.ok, str(report)
    assert C.check(model, loss_fn, x, y, 4, step=bf16, tolerance=3e-2).ok
    assert C.check(model, loss_fn, x, y, 4, step=bf16_missing_k, tolerance=3e-2).codes == ["missing_1_over_k"]


def test_non_finite_gradients_are_named(digits, loss_fn):
    def overflow(model, loss_fn, x, y, k):
        for xb, yb in zip(x.chunk(k), y.chunk(k)):
            (loss_fn(model(xb), yb) * float("inf")).backward()

    report = C.check(make_cnn("group"), loss_fn, digits.x_train[:8], digits.y_train[:8], 2, step=overflow)
    assert report.codes == ["non_finite"], str(report)


def test_an_optimizer_built_outside_step_is_a_note_and_the_model_is_untouched(digits, loss_fn):
    model = make_cnn("group")
    before = copy.deepcopy(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=1.0, weight_decay=0.5)

    def step(m, loss_fn, x, y, k):
        for xb, yb in zip(x.chunk(k), y.chunk(k)):
            (loss_fn(m(xb), yb) / k).backward()
        opt.step()  # holds the original model's parameters, not the copy's

    report = C.check(model, loss_fn, digits.x_train[:8], digits.y_train[:8], 2, step=step)
    assert report.ok and [f.code for f in report.findings] == ["optimizer_not_on_model"], str(report)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_step_that_cuts_the_window_differently_is_told_so(digits, loss_fn):
    def eight_chunks(model, loss_fn, x, y, k):
        for xb, yb in zip(x.chunk(2 * k), y.chunk(2 * k)):
            (loss_fn(model(xb), yb) / (2 * k)).backward()

    x, y = digits.x_train[:32], digits.y_train[:32]
    assert C.check(make_cnn("group"), loss_fn, x, y, 4, step=eight_chunks).ok  # the same mean gradient
    report = C.check(make_cnn("batch"), loss_fn, x, y, 4, step=eight_chunks)
    assert report.codes == ["batch_coupled_layer", "micro_batches_differ"], str(report)
    assert "size(s) [4]" in report.findings[1].evidence


def test_randomness_without_a_batch_dimension_is_inconclusive(digits, loss_fn):
    class Noisy(nn.Module):  # one noise vector shared by every sample of a forward pass
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(64, 16), nn.Linear(16, 10)

        def forward(self, x):
            h = self.a(x.flatten(1))
            return self.b(torch.tanh(h + torch.rand(16, dtype=h.dtype)))

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Noisy().double()
    report = C.check(
        model,
        loss_fn,
        digits.x_train[:16],
        digits.y_train[:16],
        4,
        step=lambda m, lf, xs, ys, k: [(lf(m(xb), yb) / k).backward() for xb, yb in zip(xs.chunk(k), ys.chunk(k))],
    )
    assert report.codes == ["randomness_not_replayed"] and not report.ok, str(report)
    assert report.findings[0].severity == "inconclusive"


def test_clipping_scaled_gradients_inside_the_loop_names_both_mistakes(digits, loss_fn):
    def step(model, loss_fn, x, y, k):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu")
        for xb, yb in zip(x.chunk(k), y.chunk(k)):
            scaler.scale(loss_fn(model(xb), yb) / k).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()

    report = C.check(make_cnn("group"), loss_fn, digits.x_train[:32], digits.y_train[:32], 4, step=step)
    assert report.codes == ["clip_before_unscale", "clip_running_buffer"], str(report)


class _CheckpointedBN(nn.Module):
    """Linear → (Linear → BatchNorm1d → ReLU) → Linear, with the block run in one of several ways."""

    def __init__(self, momentum: float | None = 0.1, how: str = "checkpoint"):
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Linear(4, 4)  # so that the block's input needs a gradient (reentrant checkpoint needs one)
        self.block = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6, momentum=momentum), nn.ReLU())
        self.head = nn.Linear(6, 3)
        self.how = how

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        x = self.stem(x)
        from gradaccum.coupled import checkpoint_keeping_bn_stats

        if self.how == "shared":  # the same BatchNorm applied twice in one forward, by design: no rerun
            return self.head(self.block[2](self.block[1](self.block[1](self.block[0](x)))))
        if self.how == "kept":
            return self.head(checkpoint_keeping_bn_stats(self.block, x))
        if self.how == "nested":
            return self.head(
                checkpoint(lambda t: checkpoint(self.block, t, use_reentrant=False), x, use_reentrant=False)
            )
        return self.head(checkpoint(self.block, x, use_reentrant=self.how == "reentrant"))


def test_batchnorm_statistics_recomputed_in_backward_are_named():
    x, y = torch.randn(16, 4, generator=torch.Generator().manual_seed(1)), torch.arange(16) % 3
    ce = nn.CrossEntropyLoss()
    report = C.check(_CheckpointedBN(), ce, x, y, 4)
    assert "bn_stats_updated_twice" in report.codes and "batch_coupled_layer" in report.codes
    finding = next(f for f in report.findings if f.code == "bn_stats_updated_twice")
    assert "'block.1': 4 call(s) in forward passes, 4 more during backward" in finding.evidence
    assert "(1 - m)^2 " in finding.evidence and "checkpoint_keeping_bn_stats" in finding.fix
    assert "bn_stats_updated_twice" in C.check(_CheckpointedBN(how="reentrant"), ce, x, y, 4).codes
    assert "bn_stats_updated_twice" in C.check(_CheckpointedBN(how="nested"), ce, x, y, 4).codes
    thrice = _bn_rerun_finding({"block.1": (4, 8)})  # two recomputations per forward (nested, reentrant)
    assert thrice is not None and "(1 - m)^3 " in thrice.evidence and "(1/3)" in thrice.fix
    # layers recomputed a different number of times (one inside a nested checkpoint): one r per layer
    mixed = _bn_rerun_finding({"outer.bn": (4, 4), "inner.bn": (4, 8)})
    assert mixed is not None and "'outer.bn': r = 2; 'inner.bn': r = 3" in mixed.evidence
    assert "with its own r" in mixed.fix and "(1/3)" not in mixed.fix
    # frozen statistics in the rerun, a cumulative average (momentum=None), a layer shared by design: no finding
    for model in (_CheckpointedBN(how="kept"), _CheckpointedBN(momentum=None), _CheckpointedBN(how="shared")):
        assert "bn_stats_updated_twice" not in C.check(model, ce, x, y, 4).codes

    def checkpoint_whole_model(model, loss_fn, xs, ys, k):  # a step that checkpoints the whole model
        from torch.utils.checkpoint import checkpoint

        for xb, yb in zip(xs.chunk(k), ys.chunk(k)):
            (loss_fn(checkpoint(model, xb, use_reentrant=False), yb) / k).backward()

    plain = _CheckpointedBN(how="shared")
    assert "bn_stats_updated_twice" in C.check(plain, ce, x, y, 4, step=checkpoint_whole_model).codes


def test_checkpoint_without_preserved_rng_state_is_named():
    """A step that checkpoints the model with preserve_rng_state=False draws new dropout masks in the recomputation
    (a wrong gradient the per-sample replay hides): the checker reads the argument and names it; the default
    (True) and a model without randomness stay OK."""
    from torch.utils.checkpoint import checkpoint

    def checkpointed(preserve):
        def step(model, loss_fn, xs, ys, k):
            for xb, yb in zip(xs.chunk(k), ys.chunk(k)):
                out = checkpoint(model, xb, use_reentrant=False, preserve_rng_state=preserve)
                (loss_fn(out, yb) / k).backward()

        return step

    torch.manual_seed(0)
    x, y = torch.randn(16, 6, dtype=torch.float64), torch.randint(0, 3, (16,))
    dropout = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Dropout(0.3), nn.Linear(8, 3)).double()
    plain = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).double()
    ce = nn.CrossEntropyLoss()
    report = C.check(dropout, ce, x, y, 4, step=checkpointed(False))
    assert report.codes == ["checkpoint_rng_not_preserved"]
    assert "preserve_rng_state=False" in report.findings[0].evidence
    assert C.check(dropout, ce, x, y, 4, step=checkpointed(True)).codes == []
    assert C.check(plain, ce, x, y, 4, step=checkpointed(False)).codes == []


def test_checkpoint_rng_finding_needs_the_draws_inside_the_unpreserved_checkpoint():
    """Review: a preserve_rng_state=False checkpoint around the (non-random) loss, with the dropout model under a
    preserving checkpoint, was called broken; checkpoint_sequential and a checkpoint inside the model's forward
    were never named."""
    from torch.utils.checkpoint import checkpoint, checkpoint_sequential

    torch.manual_seed(0)
    x, y = torch.randn(16, 8, dtype=torch.float64), torch.randint(0, 3, (16,))
    ce = nn.CrossEntropyLoss()

    def mlp(p: float) -> nn.Sequential:
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(p), nn.Linear(16, 3)).double()

    def loss_unpreserved(model, loss_fn, xs, ys, k):
        for xb, yb in zip(xs.chunk(k), ys.chunk(k)):
            out = checkpoint(model, xb, use_reentrant=False)
            (checkpoint(loss_fn, out, yb, use_reentrant=False, preserve_rng_state=False) / k).backward()

    def sequential_unpreserved(model, loss_fn, xs, ys, k):
        for xb, yb in zip(xs.chunk(k), ys.chunk(k)):
            out = checkpoint_sequential(model, 2, xb, use_reentrant=False, preserve_rng_state=False)
            (loss_fn(out, yb) / k).backward()

    assert C.check(mlp(0.3), ce, x, y, 4, step=loss_unpreserved).codes == []

    def deep(p: float) -> nn.Sequential:  # checkpoint_sequential leaves its last segment alone: dropout in the first
        return nn.Sequential(
            nn.Linear(8, 16), nn.Dropout(p), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)
        ).double()

    assert "checkpoint_rng_not_preserved" in C.check(deep(0.3), ce, x, y, 4, step=sequential_unpreserved).codes
    assert "checkpoint_rng_not_preserved" not in C.check(mlp(0.3), ce, x, y, 4, step=sequential_unpreserved).codes
    assert "checkpoint_rng_not_preserved" not in C.check(deep(0.0), ce, x, y, 4, step=sequential_unpreserved).codes

    class Inside(nn.Module):
        def __init__(self, preserve: bool):
            super().__init__()
            self.body, self.preserve = mlp(0.3), preserve

        def forward(self, t):
            return checkpoint(self.body, t, use_reentrant=False, preserve_rng_state=self.preserve)

    inside = C.check(Inside(False), ce, x, y, 4)
    assert inside.codes[0] == "checkpoint_rng_not_preserved" and "randomness_not_replayed" in inside.codes
    assert "checkpoint_rng_not_preserved" not in C.check(Inside(True), ce, x, y, 4).codes
