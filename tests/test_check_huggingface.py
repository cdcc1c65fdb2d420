"""gradaccum.check on Hugging Face models as they are: a dict batch passed as ``model(**batch)``, an output that
carries ``.loss`` (``loss_fn=None``) or ``.logits``, dropout replayed whether the step calls the model or a module
inside it, and the Trainer's ``num_items_in_batch`` contract judged for a causal LM (a tiny GPT-2 in float64, in
training mode with dropout, rows of different lengths padded with labels -100)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradaccum.checker import check

transformers = pytest.importorskip("transformers")

K = 4


@pytest.fixture(scope="module")
def gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=16,
        n_head=2,
        vocab_size=50,
        n_positions=32,
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_pdrop=0.1,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config).double().train()


@pytest.fixture(scope="module")
def batch() -> dict[str, torch.Tensor]:
    """Eight rows of different lengths, padded to 12; padding labelled -100, so micro-batches of two rows hold
    different numbers of label tokens."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (8, 12), generator=g)
    lengths = torch.tensor([12, 3, 7, 12, 5, 9, 2, 11])
    mask = (torch.arange(12)[None] < lengths[:, None]).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def split(x: dict[str, torch.Tensor], k: int) -> list[dict[str, torch.Tensor]]:
    return [{key: v.chunk(k)[j] for key, v in x.items()} for j in range(k)]


def label_tokens(x: dict[str, torch.Tensor]) -> torch.Tensor:
    """The tokens a causal LM's loss counts: labels other than -100 after its shift by one."""
    return (x["labels"][:, 1:] != -100).sum()


def whole_model(model, mb, n=None):
    """The loss of one micro-batch, the model called directly (``n``: num_items_in_batch)."""
    return model(**mb).loss if n is None else model(**mb, num_items_in_batch=n).loss


def inner_modules(model, mb, n=None):
    """The loss of one micro-batch from the model's submodules (its transformer, then its head), summed over the
    label tokens and divided by ``n``, or their mean."""
    hidden = model.transformer(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).last_hidden_state
    logits = model.lm_head(hidden)[:, :-1].flatten(0, 1)
    labels = mb["labels"][:, 1:].flatten()
    return F.cross_entropy(logits, labels) if n is None else F.cross_entropy(logits, labels, reduction="sum") / n


def trainer_loop(loss_of):
    """The Trainer's contract: every micro-batch's loss over the window's label tokens, no division by K."""

    def step(model, loss_fn, x, y, k):
        n = label_tokens(x)
        for mb in split(x, k):
            loss_of(model, mb, n).backward()

    return step


def mean_of_token_means(loss_of):
    def step(model, loss_fn, x, y, k):
        for mb in split(x, k):
            (loss_of(model, mb) / k).backward()

    return step


@pytest.mark.parametrize("loss_of", [whole_model, inner_modules], ids=["model", "submodules"])
def test_the_trainers_num_items_in_batch_loop_is_right_with_dropout(gpt2, batch, loss_of):
    report = check(gpt2, None, batch, None, K, step=trainer_loop(loss_of))
    assert report.ok and not [f for f in report.findings if f.severity in ("bug", "inconclusive")], report
    # the model's loss is computed in float32 (transformers casts the logits): the window matches the full batch
    # to that rounding, far inside the tolerance it sets
    assert report.rel_error < 1e-6


@pytest.mark.parametrize("loss_of", [whole_model, inner_modules], ids=["model", "submodules"])
def test_a_mean_of_token_means_is_named_with_dropout(gpt2, batch, loss_of):
    report = check(gpt2, None, batch, None, K, step=mean_of_token_means(loss_of))
    assert report.codes == ["token_normalization"], report
    tokens = [int(label_tokens(mb)) for mb in split(batch, K)]
    assert len(set(tokens)) > 1
    assert report.expected_weights == pytest.approx([t / sum(tokens) for t in tokens], rel=1e-6)
    assert report.weights == pytest.approx([1 / K] * K, rel=1e-4)


class Wrapper(nn.Module):
    """A wrapper that returns the logits, as the checker once required."""

    def __init__(self, hf: nn.Module):
        super().__init__()
        self.hf = hf

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=input_ids).logits


def shifted_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def test_a_step_that_calls_the_wrappers_inner_model_gets_its_dropout_replayed(gpt2, batch):
    """The step calls ``wrapper.hf(...)``, not the model it was given: its dropout is replayed as the wrapper's
    forward draws it, not reported as randomness outside the model's forward."""

    def step(model, loss_fn, x, y, k):
        n = (y[:, 1:] != -100).sum()
        for xb, yb in zip(x.chunk(k), y.chunk(k)):
            model.hf(input_ids=xb, labels=yb, num_items_in_batch=n).loss.backward()

    labels = batch["labels"]
    report = check(Wrapper(gpt2), shifted_token_loss, batch["input_ids"], labels, K, step=step)
    assert report.ok and not [f for f in report.findings if f.severity in ("bug", "inconclusive")], report
    assert report.rel_error < 1e-6


class KeywordModel(nn.Module):
    """Not a Hugging Face model: keyword tensors in, a dict out, with a mean loss over the samples (and the
    logits only when asked)."""

    def __init__(self, logits: bool = False, norm: type[nn.Module] = nn.Dropout):
        super().__init__()
        torch.manual_seed(0)
        middle = nn.Dropout(0.2) if norm is nn.Dropout else norm(16)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), middle, nn.Linear(16, 3)).double()
        self.logits = logits

    def forward(self, features: torch.Tensor, scale: torch.Tensor, target: torch.Tensor | None = None) -> dict:
        out = self.net(features * scale)
        result = {"logits": out} if self.logits or target is None else {}
        if target is not None:
            result["loss"] = F.cross_entropy(out, target)
        return result


def keyword_batch(target: bool = True) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = {
        "features": torch.randn(16, 6, generator=g, dtype=torch.float64),
        "scale": torch.rand(16, 1, generator=g, dtype=torch.float64) + 0.5,
    }
    if target:
        x["target"] = torch.randint(0, 3, (16,), generator=g)
    return x


def keyword_loop(divide: bool):
    def step(model, loss_fn, x, y, k):
        for mb in split(x, k):
            (model(**mb)["loss"] / (k if divide else 1)).backward()

    return step


@pytest.mark.parametrize("logits", [False, True], ids=["loss only", "loss and logits"])
def test_a_keyword_model_returning_a_dict_with_its_loss(logits):
    model, x = KeywordModel(logits), keyword_batch()
    report = check(model, None, x, None, K, step=keyword_loop(True))
    assert report.ok and report.tolerance <= 1e-9, report  # a float64 loss keeps float64's tolerance
    assert check(model, None, x, None, K).ok  # plain accumulation on dict micro-batches
    assert check(model, None, x, None, K, step=keyword_loop(False)).codes == ["missing_1_over_k"]


@pytest.mark.parametrize("logits", [False, True], ids=["loss only", "loss and logits"])
def test_batchnorm_in_a_model_computing_its_own_loss_is_a_coupled_layer_not_a_coupled_loss(logits):
    """The weights of the model's own loss are read at the full batch's outputs, so BatchNorm's share of the
    difference is the model's: named as the layer, with the full batch's weights those of a mean (1/K each)."""
    report = check(KeywordModel(logits, nn.BatchNorm1d), None, keyword_batch(), None, K)
    assert report.codes == ["batch_coupled_layer"], report
    assert report.expected_weights == pytest.approx([1 / K] * K, rel=1e-9)


class ParameterModel(nn.Module):
    """A model without submodules (its parameters used directly), returning its loss only: the output its loss
    is computed from is no module's, so the full batch's weights are fitted from the gradients."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.weight = nn.Parameter(torch.randn(6, 3, dtype=torch.float64))

    def forward(self, features: torch.Tensor, scale: torch.Tensor, target: torch.Tensor) -> dict:
        out = F.dropout(torch.tanh(features * scale) @ self.weight, 0.2, self.training)
        return {"loss": F.cross_entropy(out, target, reduction="sum")}


def test_a_model_whose_loss_comes_from_no_module_output_has_its_weights_fitted():
    x = keyword_batch()
    assert check(ParameterModel(), None, x, None, K, step=keyword_loop(False)).ok  # a sum: no division by K
    report = check(ParameterModel(), None, x, None, K, step=keyword_loop(True))
    assert report.codes == ["double_1_over_k"], report
    assert report.expected_weights == pytest.approx([1.0] * K, rel=1e-9)


def test_a_dict_batch_with_a_loss_fn_takes_the_logits_of_a_dict_output():
    x = keyword_batch(target=False)
    y = torch.randint(0, 3, (16,), generator=torch.Generator().manual_seed(2))

    def step(model, loss_fn, x, y, k):
        for mb, yb in zip(split(x, k), y.chunk(k)):
            loss_fn(model(**mb)["logits"], yb).backward()

    assert check(KeywordModel(), F.cross_entropy, x, y, K).ok
    assert check(KeywordModel(), F.cross_entropy, x, y, K, step=step).codes == ["missing_1_over_k"]


def test_the_boundary_refuses_what_it_cannot_use_with_a_value_error():
    model, x = KeywordModel(), keyword_batch()
    y = torch.zeros(16, dtype=torch.long)
    unlabelled = keyword_batch(target=False)
    refused = [
        (model, None, x, y),  # y given, but the model computes its own loss
        (model, F.cross_entropy, unlabelled, None),  # a loss_fn without targets
        (model, None, {**x, "scale": x["scale"][:8]}, None),  # tensors of different batch sizes
        (model, None, {"flag": True}, None),  # no tensor at all
        (model, None, {**x, "step": torch.tensor(3.0)}, None),  # a tensor without a batch dimension
        (model, None, unlabelled, None),  # no labels in x: the output has no loss
        (nn.Linear(6, 3).double(), None, unlabelled["features"], None),  # a tensor output has no .loss
        (model, None, [x["features"]], None),  # neither a tensor nor a dict
    ]
    for args in refused:
        with pytest.raises(ValueError):
            check(*args, K)
    with pytest.raises(ValueError, match="cannot be cut"):
        check(model, None, x, None, 3)
