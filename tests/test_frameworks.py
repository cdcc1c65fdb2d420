"""gradaccum.frameworks: the runners drive the real frameworks (pinned versions), record what each optimizer step
received, and are exact where the framework is; the check adapters; the recorder's handling of closures and of
optimizer wrappers; bad input."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from gradaccum import frameworks as fw
from gradaccum.book import ch07_harness as harness
from gradaccum.book.ddp_workers import launch
from gradaccum.checker import check
from gradaccum.windows import IGNORE, token_loss

pytestmark = pytest.mark.filterwarnings("ignore")


def mlp(widths: list[int], seed: int = 0, dropout: float = 0.0) -> nn.Sequential:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        layers: list[nn.Module] = []
        for a, b in zip(widths, widths[1:]):
            layers += [nn.Linear(a, b), nn.Tanh()]
            if dropout:
                layers.append(nn.Dropout(dropout))
        return nn.Sequential(*layers[: -2 if dropout else -1])


def data(n: int, d: int, classes: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g), torch.randint(0, classes, (n,), generator=g)


def test_the_pinned_versions_are_installed():
    assert harness.versions() == harness.PINNED


def test_recording_sgd_records_the_gradient_after_the_closure():
    w = nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = fw.RecordingSGD([w], lr=0.5)

    def closure():
        opt.zero_grad()
        (w * torch.tensor([3.0, 4.0])).sum().backward()
        return 0.0

    opt.step(closure)
    assert torch.equal(opt.grads[0], torch.tensor([3.0, 4.0], dtype=torch.float64))
    assert torch.allclose(w.detach(), torch.tensor([-0.5, 0.0])) and opt.lrs == [0.5]


def test_counting_lr_counts_calls_and_warms_up_linearly():
    opt = fw.RecordingSGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = fw.CountingLR(opt, warmup=4)
    assert sched.calls == 0 and opt.param_groups[0]["lr"] == pytest.approx(0.25)
    for _ in range(5):
        sched.step()
    assert sched.calls == 5 and opt.param_groups[0]["lr"] == 1.0


@pytest.mark.slow
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    hidden=st.lists(st.integers(1, 9), min_size=0, max_size=2),
    k=st.integers(1, 4),
    b=st.integers(1, 3),
    seed=st.integers(0, 1000),
)
def test_every_runner_equals_the_full_batch_on_generated_models(hidden, k, b, seed):
    """The core of accumulation (no coupling, equal micro-batches): every framework's step is the full batch's."""
    x, y = data(k * b, 5, 3, seed)
    loss = nn.CrossEntropyLoss()
    reference = harness.full_gradient(mlp([5, *hidden, 3], seed), loss, x, y)
    for name in fw.FRAMEWORKS:
        result = fw.run(name, mlp([5, *hidden, 3], seed), loss, fw.split(x, y, k), k)
        assert result.optimizer_steps == 1, name
        assert harness.relative_error(result.grads[0], reference) < 1e-5, name


@pytest.mark.parametrize("k, micro", [(4, 6), (3, 7), (5, 11)])
def test_partial_window_rules(k, micro):
    x, y = data(2 * micro, 6, 4)
    loss = nn.CrossEntropyLoss()
    r = micro % k
    last = harness.full_gradient(mlp([6, 5, 4]), loss, x[-2 * r :], y[-2 * r :])
    expected = {"accelerate": r / k, "lightning": r / k, "trainer": 1.0, "timm": 1.0}
    for name, weight in expected.items():
        result = fw.run(name, mlp([6, 5, 4]), loss, fw.split(x, y, micro), k, lr=0.0)
        assert result.optimizer_steps == micro // k + 1, name
        assert torch.allclose(result.grads[-1], weight * last, rtol=1e-4, atol=1e-7), name
    nano = fw.run("nanogpt", mlp([6, 5, 4]), loss, fw.split(x, y, micro), k, lr=0.0)
    assert nano.optimizer_steps == micro // k  # the micro-batches left over are never used


def padded(n: int = 8, width: int = 12, vocab: int = 7, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(1, vocab, (n, width), generator=g)
    y = torch.randint(1, vocab, (n, width), generator=g)
    for i in range(n):  # lengths grow along the batch: micro-batches hold different token counts
        y[i, 2 + i :] = IGNORE
    return x, y


class LM(nn.Module):
    def __init__(self, vocab: int = 7, seed: int = 0):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.embed, self.out = nn.Embedding(vocab, 5), nn.Linear(5, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.embed(x)))


@pytest.mark.slow
def test_token_recipes_are_exact_and_the_default_is_the_mean_of_means():
    x, y = padded()
    total = lambda o, t: token_loss(o, t, "sum")  # noqa: E731
    reference = harness.full_gradient(LM(), token_loss, x, y, sum_loss=total)
    for name in fw.FRAMEWORKS:
        default = fw.run(name, LM(), token_loss, fw.split(x, y, 4), 4, lr=0.0)
        assert harness.relative_error(default.grads[0], reference) > 0.01, name
        if name in ("accelerate", "trainer", "timm"):
            fixed = fw.run(name, LM(), token_loss, fw.split(x, y, 4), 4, sum_loss=total, lr=0.0)
            assert harness.relative_error(fixed.grads[0], reference) < 1e-5, name
        else:
            with pytest.raises(ValueError, match="token"):
                fw.run(name, LM(), token_loss, fw.split(x, y, 4), 4, sum_loss=total)


def test_clipping_once_and_scheduler_counts():
    x, y = data(16, 5, 3)
    loss = nn.CrossEntropyLoss()
    g = harness.full_gradient(mlp([5, 4, 3]), loss, x, y)
    clipped = g * min(1.0, 0.01 / (float(g.norm()) + 1e-6))
    assert float(g.norm()) > 0.01
    for name in fw.FRAMEWORKS:
        result = fw.run(name, mlp([5, 4, 3]), loss, fw.split(x, y, 4), 4, clip=0.01)
        assert harness.relative_error(result.grads[0], clipped) < 1e-5, name
        assert result.scheduler_steps == (0 if name == "nanogpt" else 1), name


@pytest.mark.slow
def test_fp16_on_the_cpu_is_not_fp16():
    """Accelerate (and the Trainer) turn mixed precision off on the CPU; Lightning switches to bf16-mixed."""
    x, y = data(8, 5, 3)
    loss = nn.CrossEntropyLoss()
    grads = {
        (n, p): fw.run(n, mlp([5, 4, 3]), loss, fw.split(x, y, 2), 2, precision=p).grads[0]
        for n in ("accelerate", "lightning", "trainer")
        for p in fw.PRECISIONS
    }
    for n in ("accelerate", "trainer"):
        assert torch.equal(grads[n, "fp16"], grads[n, "fp32"]), n
    assert torch.equal(grads["lightning", "fp16"], grads["lightning", "bf16"])
    assert not torch.equal(grads["lightning", "bf16"], grads["lightning", "fp32"])


def test_batchnorm_updates_k_times_per_step():
    x, y = data(12, 5, 3)
    model = lambda: nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Linear(4, 3))  # noqa: E731
    for name in fw.FRAMEWORKS:
        torch.manual_seed(0)
        assert fw.run(name, model(), nn.CrossEntropyLoss(), fw.split(x, y, 3), 3).bn_updates == 3, name


@pytest.mark.slow
def test_check_adapters():
    x, y = data(16, 5, 3)
    loss = nn.CrossEntropyLoss()
    model = mlp([5, 8, 3], dropout=0.3)
    assert check(model, loss, x, y, 4, step=fw.accelerate_step()).ok
    assert check(model, loss, x, y, 4, step=fw.lightning_step()).ok
    fixed_k = check(model, loss, x, y, 4, step=fw.lightning_step(k=4))
    assert fixed_k.codes == ["partial_window"] and fixed_k.rel_error < 1e-5
    with pytest.raises(ValueError, match="LightningModule"):
        fw.lightning_module_step()(model, loss, x, y, 4)


@pytest.mark.slow
def test_a_lightning_module_of_ones_own_is_checked():
    import pytorch_lightning as pl

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp([5, 6, 3], seed=3, dropout=0.2)

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            return nn.functional.cross_entropy(self(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    x, y = data(12, 5, 3)
    report = check(Module(), nn.CrossEntropyLoss(), x, y, 3, step=fw.lightning_module_step(k=3))
    assert report.codes == ["partial_window"] and report.rel_error < 1e-5, report
    assert check(Module(), nn.CrossEntropyLoss(), x, y, 3, step=fw.lightning_module_step(), partial=False).ok


@pytest.mark.slow
def test_lightning_clipping_inside_the_step_is_read_as_before_it():
    """Lightning clips inside optimizer.step(closure), after the closure's backward and before the update: a
    correct module is correct with gradient_clip_val set, biting or not, and its isolate_rng (a restore to the
    state it saved) and TemporaryDirectory (a new random.Random) are no seeds. Its partial window, divided by K,
    is named, with what a biting clip hides."""
    import pytorch_lightning as pl

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp([5, 6, 3], seed=4).double()

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            return nn.functional.cross_entropy(self(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    x, y = data(16, 5, 3)
    x = x.double()
    loss = nn.CrossEntropyLoss()
    for threshold in (1e-3, 10.0):
        step = fw.lightning_module_step(k=4, gradient_clip_val=threshold)
        whole = check(Module(), loss, x, y, 4, step=step, partial=False)
        assert whole.ok and whole.findings == [], whole
        partial = check(Module(), loss, x, y, 4, step=step)
        assert partial.codes == ["partial_window"], partial
        evidence = partial.findings[0].evidence
        assert "0.75× its mean gradient = 3/4" in evidence
        assert ("your clip then shrinks it" in evidence) == (threshold < 1), evidence


def test_seeding_calls_that_change_nothing_are_not_seeds():
    import random

    def step(model, loss_fn, x, y, k, how):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        opt.zero_grad()
        for xb, yb in zip(x.chunk(k), y.chunk(k)):
            if how == "restore":
                torch.set_rng_state(torch.get_rng_state())
            elif how == "new rng":
                random.Random()
            elif how == "seed":
                torch.manual_seed(0)
            (loss_fn(model(xb), yb) / k).backward()
        opt.step()

    x, y = data(12, 5, 3)
    for how in ("restore", "new rng", "seed"):
        report = check(
            mlp([5, 4, 3]), nn.CrossEntropyLoss(), x, y, 3, partial=False, step=lambda *a, how=how: step(*a, how)
        )
        assert report.ok, report
        seeded = [f.code for f in report.findings] == ["seed_inside_window"]
        assert seeded == (how == "seed"), (how, report)

    def loader_step(model, loss_fn, x, y, k):  # a DataLoader draws its base seed; the loss misses its 1/K
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        data_set = torch.utils.data.TensorDataset(x, y)
        for xb, yb in torch.utils.data.DataLoader(data_set, batch_size=len(x) // k):
            loss_fn(model(xb), yb).backward()
        opt.step()

    report = check(mlp([5, 4, 3]), nn.CrossEntropyLoss(), x, y, 3, partial=False, step=loader_step)
    assert report.codes and "randomness_not_replayed" not in report.codes, report


def test_the_recorder_reads_closures_and_skips_optimizer_wrappers():
    """A step whose last backward runs inside optimizer.step(closure), and a wrapper optimizer that ignores
    step() until the window ends (Accelerate's pattern), are both recognized as correct loops."""
    x, y = data(12, 5, 3)
    loss = nn.CrossEntropyLoss()

    def closure_step(model, loss_fn, xs, ys, k):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        chunks = list(zip(xs.chunk(k), ys.chunk(k)))
        for xb, yb in chunks[:-1]:
            (loss_fn(model(xb), yb) / k).backward()

        def closure():
            (loss_fn(model(chunks[-1][0]), chunks[-1][1]) / k).backward()

        opt.step(closure)

    class Wrapper(torch.optim.Optimizer):
        def __init__(self, inner, k):
            self.optimizer, self.k, self.calls = inner, k, 0
            self.param_groups = inner.param_groups
            self.state = inner.state
            self.defaults = inner.defaults

        def step(self, closure=None):
            self.calls += 1
            if self.calls % self.k == 0:
                self.optimizer.step()

        def zero_grad(self, set_to_none=True):
            if self.calls % self.k == 0:
                self.optimizer.zero_grad(set_to_none)

    def wrapped_step(model, loss_fn, xs, ys, k):
        opt = Wrapper(torch.optim.SGD(model.parameters(), lr=0.1), k)
        for xb, yb in zip(xs.chunk(k), ys.chunk(k)):
            (loss_fn(model(xb), yb) / k).backward()
            opt.step()
            opt.zero_grad()

    for step in (closure_step, wrapped_step):
        report = check(mlp([5, 4, 3]), loss, x, y, 3, step=step, partial=False)
        assert report.ok and report.counts["optimizer.step"] == 1, (step.__name__, report)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda m, x, y: fw.run("keras", m, nn.CrossEntropyLoss(), fw.split(x, y, 2), 2), "unknown framework"),
        (lambda m, x, y: fw.run("timm", m, nn.CrossEntropyLoss(), fw.split(x, y, 2), 0), "K"),
        (lambda m, x, y: fw.run("timm", m, nn.CrossEntropyLoss(), fw.split(x, y, 2), 2, clip=-1.0), "clip"),
        (lambda m, x, y: fw.run("timm", m, nn.CrossEntropyLoss(), fw.split(x, y, 2), 2, precision="fp8"), "precision"),
        (lambda m, x, y: fw.run("nanogpt", m, nn.CrossEntropyLoss(), fw.split(x, y, 2), 2, precision="fp16"), "fp16"),
        (lambda m, x, y: fw.run("timm", "model", nn.CrossEntropyLoss(), fw.split(x, y, 2), 2), "nn.Module"),
        (lambda m, x, y: fw.run("timm", m, nn.CrossEntropyLoss(), [], 2), "at least one"),
        (lambda m, x, y: fw.run("timm", m, nn.CrossEntropyLoss(), [(x[:3], y[:3]), (x[3:], y[3:])], 2), "one size"),
        (lambda m, x, y: fw.split(x, y, 3), "does not divide"),
        (
            lambda m, x, y: fw.run("timm", m, nn.CrossEntropyLoss(), fw.split(x, y, 2), 2, loss_kwargs=True),
            "loss_kwargs is the Transformers Trainer's",
        ),
        (
            lambda m, x, y: fw.run("trainer", m, nn.CrossEntropyLoss(), fw.split(x, y, 2), 2, loss_kwargs=1),
            "True or False",
        ),
        (lambda m, x, y: fw.framework_step("keras"), "unknown framework"),
        (lambda m, x, y: harness.tiny_causal_lm("bert", 10, 8), "gpt2"),
        (lambda m, x, y: harness.trainer_on_causal_lm(m, x, y, 3), "does not divide"),
    ],
)
def test_bad_input_says_what_to_do(call, message):
    x, y = data(8, 5, 3)
    with pytest.raises(ValueError, match=message):
        call(mlp([5, 3]), x, y)


@pytest.mark.slow
def test_two_processes():
    """The distributed measurements (chapter 7's second table half): Accelerate's scheduler steps once per process,
    every framework reduces once per optimizer step, the token recipes are exact across ranks."""
    x, y = padded(n=8)
    ranks = launch("frameworks", 2, timeout=120, x=x, y=y, k=2, windows=3, warmup=4)
    for a, b in zip(*ranks):
        assert (a.optimizer_steps, a.scheduler_steps, a.allreduces, a.lrs) == (
            b.optimizer_steps,
            b.scheduler_steps,
            b.allreduces,
            b.lrs,
        )
    by = {r.framework: r for r in ranks[0]}
    assert by["accelerate"].scheduler_steps == 2 and by["accelerate"].lrs[:3] == pytest.approx([0.025, 0.075, 0.1])
    for name in ("lightning", "trainer", "timm"):
        assert by[name].scheduler_steps == 1 and by[name].lrs[:3] == pytest.approx([0.025, 0.05, 0.075]), name
    assert all(r.allreduces == r.optimizer_steps == 1 for r in by.values())
    assert all(r.token_error > 0.01 for r in by.values())
    assert all(by[n].recipe_error < 1e-5 for n in ("accelerate", "trainer", "timm"))
    # a **kwargs model returning its mean: not divided by K = 2, multiplied by the 2 processes
    assert by["trainer"].kwargs_mean_factor == pytest.approx(4, rel=1e-5)
    assert all(by[n].kwargs_mean_factor is None for n in by if n != "trainer")


def test_trainer_with_a_kwargs_model_that_returns_its_mean():
    """One process, K = 3: the Trainer hands the count to a model that accepts loss kwargs and does not divide
    its loss by K; a model that returns its mean anyway gets K times the default step. The timm-style loop logs
    the last micro-batch's mean."""
    x, y = padded(n=6)
    default = fw.run("trainer", LM(), token_loss, fw.split(x, y, 3), 3, lr=0.0)
    kwargs_mean = fw.run("trainer", LM(), token_loss, fw.split(x, y, 3), 3, lr=0.0, loss_kwargs=True)
    assert harness.step_factor(kwargs_mean.grads[0], default.grads[0]) == pytest.approx(3, rel=1e-5)
    assert harness.relative_error(kwargs_mean.grads[0], 3 * default.grads[0]) < 1e-5
    timm = fw.run("timm", LM(), token_loss, fw.split(x, y, 3), 3, lr=0.0)
    with torch.no_grad():
        last = float(token_loss(LM()(x[4:]), y[4:]))
    assert timm.logged == pytest.approx([last], rel=1e-6)


def test_epochs_cosine_and_parameter_snapshots():
    x, y = data(12, 5, 3)
    loss = nn.CrossEntropyLoss()
    for name in ("accelerate", "lightning", "trainer", "timm"):
        result = fw.run(name, mlp([5, 4, 3]), loss, fw.split(x, y, 6), 4, epochs=3, cosine=6)
        assert result.optimizer_steps == 6 and len(result.params) == 6, name  # 2 steps (4 + 2) per epoch
        expected = [fw.LR * (1 + math.cos(math.pi * s / 6)) / 2 for s in range(6)]
        assert result.lrs == pytest.approx(expected), name
    nano = fw.run("nanogpt", mlp([5, 4, 3]), loss, fw.split(x, y, 6), 4, epochs=3)
    assert nano.optimizer_steps == 3 * 6 // 4  # iterations over the micro-batches in a cycle
    model = mlp([5, 4, 3])
    result = fw.run("timm", model, loss, fw.split(x, y, 6), 3)
    final = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
    assert torch.equal(result.params[-1], final)
    with pytest.raises(ValueError, match="epochs"):
        fw.run("timm", model, loss, fw.split(x, y, 6), 3, epochs=0)
    with pytest.raises(ValueError, match="cosine"):
        fw.run("timm", model, loss, fw.split(x, y, 6), 3, cosine=-1)


class _Module:
    """LightningModules for the recorder tests (built lazily: Lightning is imported only when they run)."""

    @staticmethod
    def make(optimizer_factory, seed=3):
        import pytorch_lightning as pl

        class Module(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.net = mlp([5, 6, 3], seed=seed)

            def forward(self, x):
                return self.net(x)

            def training_step(self, batch, batch_idx):
                return nn.functional.cross_entropy(self(batch[0]), batch[1])

            def configure_optimizers(self):
                return optimizer_factory(self.parameters())

        return Module()


class ForwardingSGD(torch.optim.SGD):
    """A subclass whose step takes *args: its closure is not named ``closure``."""

    def step(self, *args, **kwargs):
        return super().step(*args, **kwargs)


class InPlaceDecaySGD(torch.optim.SGD):
    """Adds weight decay to ``.grad`` in place after the closure, as several optimizer libraries do."""

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                p.grad.add_(p.detach(), alpha=0.1)
        super().step()
        return loss


@pytest.mark.parametrize(
    "factory",
    [lambda ps: ForwardingSGD(ps, lr=0.1), lambda ps: InPlaceDecaySGD(ps, lr=0.1)],
    ids=["forwarding-subclass", "in-place-decay"],
)
def test_the_recorder_reads_the_gradient_when_the_closure_returns(factory):
    """Found by review: a closure passed positionally through a subclass's *args, and an optimizer that changes
    .grad after the closure, made correct Lightning loops look wrong."""
    x, y = data(12, 5, 3)
    report = check(
        _Module.make(factory), nn.CrossEntropyLoss(), x, y, 3, step=fw.lightning_module_step(), partial=False
    )
    assert report.ok, report


def test_a_wrapper_that_updates_by_itself_is_counted():
    """An 'optimizer wrapper' whose step changes the parameters every micro-batch without calling its inner
    optimizer, and an optimizer that names itself as its .optimizer, are still seen stepping inside the window."""
    x, y = data(12, 5, 3)

    class Updating(torch.optim.Optimizer):
        def __init__(self, inner):
            self.optimizer = inner
            self.param_groups, self.state, self.defaults = inner.param_groups, inner.state, inner.defaults

        def step(self, closure=None):
            with torch.no_grad():
                for g in self.param_groups:
                    for p in g["params"]:
                        p -= 0.1 * p.grad

    def updating(model, loss_fn, xs, ys, k):
        opt = Updating(torch.optim.SGD(model.parameters(), lr=0.1))
        for xb, yb in zip(xs.chunk(k), ys.chunk(k)):
            (loss_fn(model(xb), yb) / k).backward()
            opt.step()

    def self_named(model, loss_fn, xs, ys, k):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        opt.optimizer = opt
        for xb, yb in zip(xs.chunk(k), ys.chunk(k)):
            (loss_fn(model(xb), yb) / k).backward()
            opt.step()

    for step in (updating, self_named):
        report = check(mlp([5, 4, 3]), nn.CrossEntropyLoss(), x, y, 3, step=step, partial=False)
        assert "optimizer_step_inside_window" in report.codes, (step.__name__, report)


def test_adapters_leave_the_callers_accelerator_working_and_take_trainer_options():
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    x, y = data(12, 5, 3)
    assert check(mlp([5, 4, 3]), nn.CrossEntropyLoss(), x, y, 3, step=fw.accelerate_step(), partial=False).ok
    assert acc.device.type == "cpu" and acc.prepare(mlp([5, 3])) is not None
    report = check(
        _Module.make(lambda ps: torch.optim.SGD(ps, lr=0.1)),
        nn.CrossEntropyLoss(),
        x,
        y,
        3,
        step=fw.lightning_module_step(gradient_clip_val=0.5),
        partial=False,
    )
    assert "step_raised" not in report.codes, report
    with pytest.raises(ValueError, match="unknown option"):
        fw.accelerate_step(precison="bf16")
    with pytest.raises(ValueError, match="int >= 1 or None"):
        fw.lightning_module_step(k=0)


def test_accelerate_ignores_its_split_batches_keyword():
    """Review: chapters 6 and 7 told readers to build `Accelerator(split_batches=True)`; the pinned Accelerate never
    reads that keyword (no warning). The DataLoaderConfiguration spelling is the one that works."""
    assert harness.accelerate_split_batches() == {
        "Accelerator(split_batches=True)": False,
        "DataLoaderConfiguration(split_batches=True)": True,
    }


def test_framework_tools_and_graders_refuse_impossible_input():
    """Found by review: mismatched inputs paired silently, a zero reference gave nan or inf, and the chapter 7
    graders crashed (ZeroDivisionError, IndexError) or graded a negative count."""
    import pytest

    from gradaccum.book import exercises

    with pytest.raises(ValueError, match="samples but y has"):
        fw.split(torch.zeros(12, 2), torch.zeros(8), 4)
    with pytest.raises(ValueError, match="zero"):
        harness.step_factor(torch.ones(3), torch.zeros(3))
    with pytest.raises(ValueError, match="zero"):
        harness.relative_error(torch.ones(3), torch.zeros(3))
    for kwargs in (dict(k=0), dict(k=-4), dict(micro_batches=-2, k=4), dict(micro_batches=10.5), dict(k=4.0)):
        with pytest.raises(ValueError):
            exercises.grade_framework_partial_weight(0.5, **kwargs)
    for tokens in ((), ((),), "ab", ((1.5, 2),), ((True, 2),)):
        with pytest.raises(ValueError):
            exercises.grade_accelerate_token_factor(0.5, rank_tokens=tokens)


def test_tools_refuse_mismatched_empty_and_late_input():
    """Chapter 7's review: relative_error broadcast (2, 3) against (3,) to 0.0, NaN passed through or was called a
    zero reference, empty batches trained, clip=True was a clip of 1.0, and framework options failed only inside
    check() (blamed on the reader's loop)."""
    import numpy as np

    bad = [
        lambda: harness.relative_error(torch.ones(2, 3), torch.ones(3)),
        lambda: harness.relative_error(torch.ones(5), torch.ones(3)),
        lambda: harness.relative_error(torch.tensor([1.0, float("nan")]), torch.ones(2)),
        lambda: harness.step_factor(torch.ones(3), torch.tensor([float("nan"), 1.0, 1.0])),
        lambda: fw.split(torch.zeros(0, 3), torch.zeros(0), 4),
        lambda: fw.split(np.ones((4, 3)), np.ones(4), 2),
        lambda: fw.framework_step("timm", precision="fp8"),
        lambda: fw.framework_step("accelerate", clip=True),
        lambda: fw.lightning_module_step(k=4, foo=1),
        lambda: fw.run(
            "timm",
            nn.Linear(3, 2),
            nn.CrossEntropyLoss(),
            [(torch.ones(8, 3), torch.zeros(7, dtype=torch.long))] * 4,
            4,
        ),
    ]
    for call in bad:
        with pytest.raises(ValueError):
            call()
    assert harness.relative_error(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0])) == 0.0


def test_the_trainer_runs_leave_garbage_collection_as_they_found_it():
    """The Trainer runner freezes the objects made before it (its train() runs a full gc.collect()) and unfreezes
    them after; a caller that froze objects itself keeps exactly its frozen set."""
    import gc

    from gradaccum.framework_probes import _young_gc_only

    assert gc.get_freeze_count() == 0
    with _young_gc_only():
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with _young_gc_only():
            pass
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()


def test_a_trainer_run_under_a_callers_freeze_gives_the_same_gradient():
    import gc

    x, y = data(16, 6, 3)
    micro = fw.split(x, y, 4)
    plain = fw.run("trainer", mlp([6, 5, 3]), nn.CrossEntropyLoss(), micro, 4)
    gc.freeze()
    try:
        frozen = fw.run("trainer", mlp([6, 5, 3]), nn.CrossEntropyLoss(), micro, 4)
    finally:
        gc.unfreeze()
    assert torch.equal(plain.grads[0], frozen.grads[0])


def test_quiet_silences_every_framework_logger_and_restores_their_levels():
    import logging

    from gradaccum.framework_probes import _quiet

    own = logging.getLogger("transformers.gradaccum_test_own_level")
    own.setLevel(logging.INFO)
    inherited = logging.getLogger("transformers.gradaccum_test_own_level.leaf")
    top = logging.getLogger("accelerate")
    before = top.level
    try:
        with _quiet():
            assert own.getEffectiveLevel() == inherited.getEffectiveLevel() == logging.ERROR
            assert top.getEffectiveLevel() == logging.ERROR
        assert own.level == logging.INFO and inherited.level == logging.NOTSET and top.level == before
    finally:
        own.setLevel(logging.NOTSET)
