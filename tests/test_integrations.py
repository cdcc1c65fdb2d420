"""gradaccum.integrations: the check where people train. Each integration runs live in its framework (the pinned
Lightning, Accelerate and Transformers) on models and data written here: a correct run passes and trains exactly
as it would without the check; the commonest real mistake of each framework is named, and the run stops (or
raises) before its first optimizer step; bad options are refused when the callback is made."""

from __future__ import annotations

import copy
import subprocess
import sys
import tempfile
import warnings

import pytest
import torch
from layout import ROOT
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from gradaccum.checker import Finding, Report
from gradaccum.integrations import AccumulationBug, AccumulationWarning, check_accelerate
from gradaccum.integrations.common import act, concat, options, rebuild, rows_needed

K = 4


def data(n: int, d: int = 5, classes: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=torch.float64), torch.randint(0, classes, (n,), generator=g)


def net(seed: int = 0, dropout: float = 0.2) -> nn.Sequential:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Dropout(dropout), nn.Linear(8, 3)).double()


def params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


# ---------------------------------------------------------------------------------------------------- the core


@pytest.mark.slow
def test_the_integrations_import_no_framework_until_one_is_used():
    code = (
        "import sys, gradaccum.integrations as i; "
        "assert not {'pytorch_lightning', 'transformers', 'accelerate'} & set(sys.modules), sorted(sys.modules); "
        "i.check_accelerate; assert 'accelerate' in sys.modules and 'pytorch_lightning' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT / "src")})


def test_bad_options_are_refused_when_the_check_is_made():
    for bad in ({"on_bug": "crash"}, {"allow": ["no_such_code"]}, {"micro_batch_size": 0}, {"tolerance": -1.0}):
        kwargs = {"on_bug": "raise", "allow": (), "micro_batch_size": None, "tolerance": None, **bad}
        with pytest.raises(ValueError):
            options(**kwargs)
    with pytest.raises(ValueError):
        check_accelerate(None)  # type: ignore[arg-type]


def test_the_window_is_one_training_micro_batch_cut_into_k():
    assert rows_needed(32, 4, None) == (8, 32)
    assert rows_needed(30, 4, None) == (7, 28)
    assert rows_needed(2, 4, None) == (1, 4)  # fewer samples than K: one each, from the first batches
    assert rows_needed(32, 4, 2) == (2, 8)
    a, b = torch.zeros(2, 3), torch.ones(2, 3)
    assert torch.equal(concat([[a, b]], 3)[0], torch.cat([a, b])[:3])
    with pytest.raises(ValueError, match="pad"):
        concat([[a, torch.zeros(2, 4)]], 3)


def test_the_runs_optimizer_and_scheduler_are_copied_onto_the_checked_model_not_shared():
    model = net(dropout=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=10)
    x, y = data(8)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    sched.step()  # the run is one step in: momentum buffers, and the warmup one step along
    before, momentum = params(model), opt.state[next(model.parameters())]["momentum_buffer"].clone()
    work = copy.deepcopy(model)
    (copied,), (warmup,) = rebuild(model, work, [opt], [sched])
    assert all(p is q for p, q in zip(copied.param_groups[0]["params"], work.parameters()))
    assert warmup.optimizer is copied and warmup.last_epoch == sched.last_epoch
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()" from the copy
        work.zero_grad()
        nn.functional.cross_entropy(work(x), y).backward()
        copied.step()
        warmup.step()
    assert torch.equal(params(model), before) and sched.last_epoch == 1 and warmup.last_epoch == 2
    assert torch.equal(opt.state[next(model.parameters())]["momentum_buffer"], momentum)
    assert copied.param_groups[0]["lr"] == pytest.approx(0.1 * (0.1 + 0.9 * 2 / 10))


def test_a_bug_acts_as_asked_and_an_inconclusive_verdict_only_warns():
    bug = Finding("missing_1_over_k", "cause", "evidence", "fix")
    unsure = Finding("gradient_cancels", "cause", "evidence", "fix", severity="inconclusive")
    stops: list[bool] = []

    def report(*findings, allowed=()):
        return Report(K, float("nan"), float("nan"), 1e-9, findings=list(findings), allowed=allowed)

    with pytest.raises(AccumulationBug):
        act(report(bug), "raise", lambda: stops.append(True), "test")
    act(report(bug), "stop", lambda: stops.append(True), "test")
    assert stops == [True]
    with pytest.warns(AccumulationWarning, match="missing_1_over_k"):
        act(report(bug), "warn", lambda: stops.append(True), "test")
    with pytest.warns(AccumulationWarning, match="inconclusive"):
        act(report(unsure), "raise", lambda: stops.append(True), "test")
    act(report(bug, allowed=("missing_1_over_k",)), "raise", lambda: stops.append(True), "test")
    assert stops == [True]


# --------------------------------------------------------------------------------------------------- Lightning


def lightning_module(per_batch_scheduler: bool = False):
    import pytorch_lightning as pl

    class Classifier(pl.LightningModule):
        """SGD with a warmup stepped per optimizer step (``interval="step"``, as Lightning's docs configure it);
        ``per_batch_scheduler`` also steps it in ``training_step``, the plain-loop habit carried into Lightning."""

        def __init__(self) -> None:
            super().__init__()
            self.net = net()

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            if per_batch_scheduler:
                self.lr_schedulers().step()
            return nn.functional.cross_entropy(self(x), y)

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=10)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}

    return Classifier()


def fit(module, loader, callbacks):
    import pytorch_lightning as pl

    with tempfile.TemporaryDirectory() as root:
        trainer = pl.Trainer(
            accumulate_grad_batches=K,
            max_epochs=1,
            callbacks=callbacks,
            default_root_dir=root,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(module, loader)
    return trainer


def loader(n: int = 64, batch: int = 8, seed: int = 0) -> DataLoader:
    return DataLoader(
        TensorDataset(*data(n)), batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(seed)
    )


@pytest.mark.slow
def test_lightning_check_passes_a_correct_module_and_the_run_trains_as_without_it():
    from gradaccum.integrations import LightningCheck

    check = LightningCheck(nn.functional.cross_entropy)
    torch.manual_seed(1)
    checked = lightning_module()
    trainer = fit(checked, loader(), [check])
    torch.manual_seed(1)
    plain = lightning_module()
    fit(plain, loader(), [])
    assert check.report is not None and check.report.ok and check.report.findings == [], check.report
    assert trainer.global_step == 64 // 8 // K
    assert torch.equal(params(checked), params(plain))  # same data order, same dropout masks, same steps


@pytest.mark.parametrize("on_bug", ["raise", "stop"])
def test_lightning_check_names_a_scheduler_stepped_in_training_step_and_stops_the_run(on_bug):
    """The mistake: ``self.lr_schedulers().step()`` in ``training_step`` while Lightning also steps the scheduler
    (``interval="step"``): K + 1 steps per optimizer step (Lightning's forum, "OneCycleLR ... tried to step X+2
    times", 2022)."""
    from gradaccum.integrations import LightningCheck

    check = LightningCheck(nn.functional.cross_entropy, on_bug=on_bug)
    module = lightning_module(per_batch_scheduler=True)
    before = params(module)
    if on_bug == "raise":
        with pytest.raises(AccumulationBug) as raised:
            fit(module, loader(), [check])
        assert raised.value.report is check.report
    else:
        assert fit(module, loader(), [check]).global_step == 0
    assert check.report is not None and check.report.codes == ["scheduler_step_inside_window"], check.report
    assert f"{K + 1} scheduler step(s) in one window" in check.report.findings[0].evidence
    assert torch.equal(params(module), before)


def test_lightning_check_names_the_partial_window_only_where_the_run_has_one():
    """Lightning divides the last window of an epoch by K however few micro-batches it holds: 6 batches per epoch
    with K = 4 leave one of 2, 8 batches none. ``on_bug="warn"`` warns and the run goes on."""
    from gradaccum.integrations import LightningCheck

    check = LightningCheck(nn.functional.cross_entropy, on_bug="warn")
    with pytest.warns(AccumulationWarning, match="partial_window"):
        trainer = fit(lightning_module(), loader(n=48), [check])
    assert check.report is not None and check.report.codes == ["partial_window"], check.report
    assert trainer.global_step == 2


# -------------------------------------------------------------------------------------------------- Accelerate


def accelerate_run(guarded: bool, batch: int = 8, on_bug: str = "raise", checked: bool = True):
    """An ``accelerator.accumulate()`` loop with AdamW and a warmup; ``guarded=False`` clips on every micro-batch
    instead of under ``if accelerator.sync_gradients:``. Returns the model, the step function and the optimizer
    steps taken."""
    from accelerate import Accelerator

    from gradaccum.framework_probes import _own_accelerate_state

    def train_step(accelerator, model, optimizer, scheduler, batch):
        x, y = batch
        with accelerator.accumulate(model):
            accelerator.backward(nn.functional.cross_entropy(model(x), y))
            if accelerator.sync_gradients or not guarded:
                accelerator.clip_grad_norm_(model.parameters(), 0.05)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()

    if checked:
        train_step = check_accelerate(nn.functional.cross_entropy, on_bug=on_bug)(train_step)
    with _own_accelerate_state():
        accelerator = Accelerator(gradient_accumulation_steps=K, cpu=True)
        torch.manual_seed(1)
        model = net()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=10)
        model, opt, data_loader, warmup = accelerator.prepare(model, opt, loader(batch=batch), warmup)
        for b in data_loader:
            train_step(accelerator, model, opt, warmup, b)
            if accelerator.check_trigger():
                break
    return model, train_step, warmup.scheduler.last_epoch  # the scheduler steps once per optimizer step


@pytest.mark.parametrize("batch", [8, 2])
def test_accelerate_check_passes_a_correct_loop_and_the_run_trains_as_without_it(batch):
    """Batches of 8 are cut into K micro-batches of 2; batches of 2 < K give micro-batches of one sample, taken from
    the first two calls (the first trains before the check: no optimizer step comes before the K-th)."""
    checked, step, steps = accelerate_run(guarded=True, batch=batch)
    plain, _, plain_steps = accelerate_run(guarded=True, batch=batch, checked=False)
    assert step.report.ok and step.report.findings == [], step.report
    assert step.report.micro_batch == max(1, batch // K)
    assert steps == plain_steps == 64 // batch // K
    assert torch.equal(params(checked), params(plain))


def test_accelerate_check_names_a_clip_outside_sync_gradients():
    with pytest.raises(AccumulationBug) as raised:
        accelerate_run(guarded=False)
    assert raised.value.report.codes == ["clip_running_buffer"], raised.value.report
    model, step, steps = accelerate_run(guarded=False, on_bug="stop")
    assert step.report.codes == ["clip_running_buffer"] and steps == 0
    assert torch.equal(params(model), params(net()))


def test_accelerate_check_needs_the_accelerator_as_an_argument():
    from accelerate import Accelerator

    from gradaccum.framework_probes import _own_accelerate_state

    with _own_accelerate_state():
        accelerator = Accelerator(gradient_accumulation_steps=K, cpu=True)

        @check_accelerate(nn.functional.cross_entropy)
        def train_step(model, batch):
            with accelerator.accumulate(model):
                accelerator.backward(nn.functional.cross_entropy(model(batch[0]), batch[1]))

        with pytest.raises(ValueError, match="Accelerator"):
            train_step(net(), data(8))


# ----------------------------------------------------------------------------------------- Transformers Trainer


class Columns(Dataset):
    """Token sequences padded to one length: ``input_ids``, ``attention_mask`` and ``labels`` (-100 on padding)."""

    def __init__(self, n: int = 32, length: int = 6, vocab: int = 11, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)
        keep = torch.arange(length) < torch.randint(2, length + 1, (n, 1), generator=g)
        self.mask = keep.long()
        self.labels = self.ids.masked_fill(~keep, -100)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i]}


def token_mean(outputs, labels, num_items_in_batch=None):
    """The mistake: a causal-LM loss averaged over the micro-batch's own tokens, ``num_items_in_batch`` ignored."""
    logits = outputs.logits[:, :-1].reshape(-1, outputs.logits.shape[-1])
    return nn.functional.cross_entropy(logits, labels[:, 1:].reshape(-1), ignore_index=-100)


def token_sum(outputs, labels, num_items_in_batch=None):
    """Right: the summed token loss over the window's tokens."""
    logits = outputs.logits[:, :-1].reshape(-1, outputs.logits.shape[-1])
    summed = nn.functional.cross_entropy(logits, labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum")
    return summed / num_items_in_batch


def tiny_lm(kind: str):
    """A one-layer causal LM from a config (no download): GPT-2 in float64 (its layers compute in the parameters'
    dtype), or Llama in float32 (its RMSNorm and rotary embeddings compute in float32 whatever the dtype)."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "gpt2":
        config = GPT2Config(vocab_size=11, n_positions=6, n_embd=8, n_layer=1, n_head=2, attn_pdrop=0.0)
        return GPT2LMHeadModel(config).double()  # resid and embd dropout 0.1: replayed per sample by the check
    config = LlamaConfig(
        vocab_size=11,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM(config)


def train(model, callback, compute_loss_func=None):
    from transformers import PrinterCallback, Trainer, TrainingArguments

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=8,
            gradient_accumulation_steps=K,
            max_grad_norm=1.0,
            num_train_epochs=1,
            learning_rate=1e-3,
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
        )
        trainer = Trainer(
            model=model, args=args, train_dataset=Columns(), compute_loss_func=compute_loss_func, callbacks=[callback]
        )
        trainer.remove_callback(PrinterCallback)
        trainer.train()
    return trainer


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "loss"), [("llama", None), ("gpt2", token_sum)], ids=["model-loss", "token-sum"])
def test_trainer_check_passes_a_correct_configuration_and_training_proceeds(kind, loss):
    """The model's own loss (Llama: the Trainer passes ``num_items_in_batch``, counted over the shifted labels), and
    a ``compute_loss_func`` that divides the summed token loss by ``num_items_in_batch``."""
    from transformers import TrainerCallback

    from gradaccum.integrations import TrainerCheck

    check = TrainerCheck()
    checked = tiny_lm(kind)
    trainer = train(checked, check, loss)
    assert check.report is not None and check.report.ok, check.report
    assert trainer.state.global_step == 1 and check.report.micro_batch == 8 // K
    plain = tiny_lm(kind)
    train(plain, TrainerCallback(), loss)
    assert torch.equal(params(checked), params(plain))  # the check leaves the run's data order and randomness


@pytest.mark.parametrize("on_bug", ["raise", "stop"])
def test_trainer_check_names_a_loss_that_ignores_num_items_in_batch(on_bug):
    """Each micro-batch's mean over its own tokens, not divided by K (the Trainer leaves the scaling to a
    ``compute_loss_func``): K times too large, and the micro-batches weighted equally instead of by their tokens."""
    from gradaccum.integrations import TrainerCheck

    check = TrainerCheck(on_bug=on_bug)
    model = tiny_lm("gpt2")
    before = params(model)
    if on_bug == "raise":
        with pytest.raises(AccumulationBug):
            train(model, check, token_mean)
    else:
        assert train(model, check, token_mean).state.global_step == 0
    assert check.report is not None and check.report.codes == ["token_normalization", "missing_1_over_k"], check.report
    assert torch.equal(params(model), before)
