r"""Chapter 7's harness over :mod:`gradaccum.frameworks`: measurements against one full batch, the frameworks on
two processes (:func:`rank_task`), Transformers' own models built from configs, and the ``Trainer`` on them.

The relative error and the step factor compare a framework's step with the full batch's gradient:
:math:`\lVert g - g_\text{full}\rVert / \lVert g_\text{full}\rVert` and the least-squares :math:`c` with
:math:`g \approx c\, g_\text{full}` (1 for a correctly weighted step).
"""

from __future__ import annotations

import importlib.metadata
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gradaccum import _tensors
from gradaccum._validate import require_k
from gradaccum.book.models import TinyLM
from gradaccum.framework_probes import (
    FRAMEWORKS,
    CountingLR,
    LossFn,
    RecordingSGD,
    Run,
    _finish,
    _import,
    _own_accelerate_state,
    _quiet,
    _young_gc_only,
    flat_grads,
)
from gradaccum.framework_runners import _Columns, _hf_trainer_class
from gradaccum.frameworks import run, split
from gradaccum.windows import IGNORE

#: The distributions whose behaviour the chapter asserts (the versions pinned in requirements.txt).
PINNED = {"accelerate": "1.15.0", "pytorch-lightning": "2.6.6", "transformers": "5.23.0"}


def versions() -> dict[str, str]:
    """The installed version of each framework (``"missing"`` when it is not installed)."""
    out = {}
    for dist_name in PINNED:
        try:
            out[dist_name] = importlib.metadata.version(dist_name)
        except importlib.metadata.PackageNotFoundError:
            out[dist_name] = "missing"
    return out


def accelerate_split_batches() -> dict[str, bool]:
    """What ``Accelerator.split_batches`` reads after each of two ways of asking for split batches: the keyword
    ``Accelerator(split_batches=True)`` (accelerate 1.x keeps it in the signature but never reads it) and
    ``Accelerator(dataloader_config=DataLoaderConfiguration(split_batches=True))``. On fresh Accelerate states;
    the caller's is put back."""
    _import("accelerate")
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    read = {}
    for spelling, kwargs in (
        ("Accelerator(split_batches=True)", {"split_batches": True}),
        (
            "DataLoaderConfiguration(split_batches=True)",
            {"dataloader_config": DataLoaderConfiguration(split_batches=True)},
        ),
    ):
        with _own_accelerate_state(), _quiet():
            read[spelling] = bool(Accelerator(cpu=True, **kwargs).split_batches)
    return read


# ------------------------------------------------------------------------------------------- measurements


def _gradient_pair(a: Any, b: Any, names: tuple[str, str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Two finite flat gradients of one length, in float64 (``ValueError`` naming what is wrong)."""
    for name, t in zip(names, (a, b)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() != 1:
            raise ValueError(
                f"{name} must be a flat floating-point gradient (1-D, e.g. flat_grads(...)), got "
                f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}."
            )
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name} contains inf or NaN: no error or factor is defined for it.")
    if a.shape != b.shape:
        raise ValueError(
            f"{names[0]} has {a.numel()} entries and {names[1]} {b.numel()}: the two gradients must "
            "cover the same parameters."
        )
    if not bool(b.abs().max() > 0):
        raise ValueError(f"the reference gradient {names[1]} is zero: nothing relates a step to it.")
    return a.double(), b.double()


def step_factor(grad: torch.Tensor, reference: torch.Tensor) -> float:
    """The factor ``c`` with ``grad ≈ c · reference`` (least squares): 1 for a correctly weighted step."""
    grad, reference = _gradient_pair(grad, reference, ("grad", "reference"))
    return float(grad @ reference / (reference @ reference))


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in float64."""
    a, b = _gradient_pair(a, b, ("a", "b"))
    return _tensors.relative_error(a, b)


def full_gradient(
    model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, sum_loss: LossFn | None = None
) -> torch.Tensor:
    """The gradient of one full batch: ``loss_fn`` on all of it, or, for a token loss, its summed token loss over
    its tokens. Works on a copy in train mode; the model is left as it was."""
    import copy

    net = copy.deepcopy(model).train()
    net.zero_grad(set_to_none=True)
    out = net(x)
    loss = sum_loss(out, y) / (y != IGNORE).sum() if sum_loss is not None else loss_fn(out, y)
    loss.backward()
    return flat_grads(list(net.parameters()))


# ------------------------------------------------------------------------------------------ two processes


@dataclass
class RankResult:
    """What one framework did on two (or more) processes for one window per process."""

    framework: str
    optimizer_steps: int
    scheduler_steps: int
    allreduces: int
    token_error: float  # per-micro-batch mean loss against the global token mean
    recipe_error: float | None  # the framework's token recipe (None: it has none)
    lrs: list[float]  # learning rate at each optimizer step under a linear warmup (``warmup`` scheduler steps)
    # the Trainer only: a model that accepts loss kwargs and returns its mean loss, its step as a multiple of
    # the default's (the mean of micro-batch means)
    kwargs_mean_factor: float | None = None


def _distributed_env(rank: int, world_size: int) -> None:
    """What torchrun would set, so that every framework finds the process group it is running in."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        GROUP_RANK="0",
        ROLE_RANK=str(rank),
        TORCHELASTIC_RUN_ID="gradaccum",
    )


def rank_task(
    rank: int,
    world_size: int,
    x: torch.Tensor,
    y: torch.Tensor,
    k: int,
    seed: int = 0,
    frameworks: Sequence[str] = FRAMEWORKS,
    warmup: int = 8,
    windows: int = 10,
) -> list[RankResult]:
    """Run on every rank of an initialized process group: each framework trains a fresh character LM
    (``TinyLM``, float32) for one window of ``k`` micro-batches per rank on ``(x, y)`` — the whole global batch,
    ``world_size · k`` equal micro-batches; Accelerate and the Trainer shard it themselves, Lightning (without its
    distributed sampler) and the hand-written loops get the same shard, every ``world_size``-th micro-batch — and is
    compared with the gradient of one full batch over all of it."""
    from gradaccum.windows import token_loss

    _distributed_env(rank, world_size)
    vocab = int(max(x.max(), y.max())) + 1
    micro = split(x, y, world_size * k)

    def fresh() -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return TinyLM(vocab)

    mean, total = token_loss, lambda o, t: token_loss(o, t, "sum")
    reference = full_gradient(fresh(), mean, x, y, sum_loss=total)
    results = []
    for framework in frameworks:
        # Accelerate and the Trainer shard the data loader by batches (rank r: batches r, r + p, ...); the others
        # get that shard
        own = micro if framework in ("accelerate", "trainer") else micro[rank::world_size]
        plain = run(framework, fresh(), mean, own, k)
        recipe: float | None = None
        try:
            fixed = run(framework, fresh(), mean, own, k, sum_loss=total)
            recipe = relative_error(fixed.grads[0], reference)
        except ValueError:
            pass
        longer = run(framework, fresh(), mean, list(own) * windows, k, warmup=warmup)
        factor = None
        if framework == "trainer":
            kwargs_mean = run(framework, fresh(), mean, own, k, loss_kwargs=True)
            factor = step_factor(kwargs_mean.grads[0], plain.grads[0])
        results.append(
            RankResult(
                framework,
                plain.optimizer_steps,
                plain.scheduler_steps,
                plain.allreduces,
                relative_error(plain.grads[0], reference),
                recipe,
                longer.lrs,
                factor,
            )
        )
    return results


# ------------------------------------------------------------------ the Trainer with Transformers' own models


def tiny_causal_lm(kind: str, vocab: int, positions: int, seed: int = 0) -> nn.Module:
    """A one-layer Transformers language model built from a config (no download): ``"gpt2"``
    (``GPT2LMHeadModel``) or ``"llama"`` (``LlamaForCausalLM``), or the encoder-decoder ``"t5"``
    (``T5ForConditionalGeneration``: the labels are its targets, its decoder's inputs the labels shifted right),
    float32, dropout off."""
    _import("trainer")
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        T5Config,
        T5ForConditionalGeneration,
    )

    with _quiet(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if kind == "gpt2":
            return GPT2LMHeadModel(
                GPT2Config(
                    vocab_size=vocab,
                    n_positions=positions,
                    n_embd=16,
                    n_layer=1,
                    n_head=2,
                    resid_pdrop=0.0,
                    embd_pdrop=0.0,
                    attn_pdrop=0.0,
                )
            )
        if kind == "llama":
            return LlamaForCausalLM(
                LlamaConfig(
                    vocab_size=vocab,
                    hidden_size=16,
                    intermediate_size=32,
                    num_hidden_layers=1,
                    num_attention_heads=2,
                    num_key_value_heads=2,
                    max_position_embeddings=positions,
                )
            )
        if kind == "t5":
            config = T5Config(
                vocab_size=vocab,
                d_model=16,
                d_kv=8,
                d_ff=32,
                num_layers=1,
                num_decoder_layers=1,
                num_heads=2,
                dropout_rate=0.0,
                pad_token_id=0,
            )
            setattr(config, "decoder_start_token_id", 0)  # noqa: B010  (its labels shifted right start with 0)
            return T5ForConditionalGeneration(config)
    raise ValueError(f"kind must be 'gpt2', 'llama' or 't5', got {kind!r}.")


#: The Transformers heads :func:`tiny_classifier` builds: a label per sequence, or per token (``-100`` skipped).
CLASSIFIER_KINDS = {
    "bert": "sequence",
    "llama": "sequence",
    "bert-token": "token",
    "bert-mlm": "token",
    "vit": "image",
    "vit-regression": "image",
}


def tiny_classifier(kind: str, vocab: int, positions: int, num_labels: int = 3, seed: int = 0) -> nn.Module:
    """A one-layer Transformers classifier built from a config (no download), float32, dropout off: a label per
    sequence, ``"bert"`` (``BertForSequenceClassification``) or ``"llama"`` (``LlamaForSequenceClassification``, pad
    token 0), or per token, ``"bert-token"`` (``BertForTokenClassification``) or ``"bert-mlm"``
    (``BertForMaskedLM``, the vocabulary as classes), or per image, ``"vit"`` (``ViTForImageClassification`` on
    one-channel images of side ``positions``, patches of half that; ``vocab`` unused) or ``"vit-regression"`` (the
    same with one output, a regression). Every ``forward`` takes ``**kwargs``; the text heads compute a mean loss
    that ignores ``num_items_in_batch`` (transformers issue #47688), as ViT's regression (an MSE mean) does, while
    ViT's single-label loss (``self.loss_function``) divides its summed loss by it."""
    _import("trainer")
    if kind not in CLASSIFIER_KINDS:
        raise ValueError(f"kind must be one of {sorted(CLASSIFIER_KINDS)}, got {kind!r}.")
    with _quiet(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if kind.startswith("bert"):
            return _bert_classifier(kind, vocab, positions, num_labels)
        if kind.startswith("vit"):
            return _vit_classifier(positions, 1 if kind == "vit-regression" else num_labels)
        return _llama_classifier(vocab, positions, num_labels)


def _bert_classifier(kind: str, vocab: int, positions: int, num_labels: int) -> nn.Module:
    """:func:`tiny_classifier`'s BERT heads: ``"bert"`` (a label per sequence), ``"bert-token"`` (per token),
    ``"bert-mlm"`` (the masked-LM head, the vocabulary as classes)."""
    from transformers import BertConfig, BertForMaskedLM, BertForSequenceClassification, BertForTokenClassification

    bert = BertConfig(
        vocab_size=vocab,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=positions,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    bert.num_labels = num_labels
    head = {
        "bert": BertForSequenceClassification,
        "bert-token": BertForTokenClassification,
        "bert-mlm": BertForMaskedLM,
    }[kind]
    return head(bert)


def _vit_classifier(side: int, num_labels: int) -> nn.Module:
    """:func:`tiny_classifier`'s ViT: one-channel images of side ``side``, patches of half that; one label is a
    regression."""
    from transformers import ViTConfig, ViTForImageClassification

    vit = ViTConfig(
        image_size=side,
        patch_size=max(1, side // 2),
        num_channels=1,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    vit.num_labels = num_labels
    return ViTForImageClassification(vit)


def _llama_classifier(vocab: int, positions: int, num_labels: int) -> nn.Module:
    """:func:`tiny_classifier`'s Llama: a label per sequence, pad token 0."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    llama = LlamaConfig(
        vocab_size=vocab,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=positions,
        pad_token_id=0,
    )
    llama.num_labels = num_labels
    return LlamaForSequenceClassification(llama)


def trainer_on_causal_lm(
    model: nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    k: int,
    compute_loss_func: Callable[..., torch.Tensor] | None = None,
    loss_is_scaled_for_ga: bool | None = None,
) -> tuple[Run, torch.Tensor]:
    """One window of ``k`` equal micro-batches of a Transformers model called with ``input_ids`` (under the
    model's ``main_input_name``: ``pixel_values`` for ViT) and ``labels`` (a causal LM, or a classifier from
    :func:`tiny_classifier`) through the Trainer (the model's own loss, with
    ``num_items_in_batch`` where its ``forward`` takes it), learning rate 0. Returns the run and the full batch's
    gradient (the model's own loss on all of it, one backward on a copy in train mode), to compare with
    :func:`relative_error` and :func:`step_factor`. ``compute_loss_func`` goes to the Trainer, and
    ``loss_is_scaled_for_ga`` to the Trainer attribute that decides whether it divides the loss by K (``None``: it
    decides from the model and ``compute_loss_func``)."""
    import copy

    require_k(k)
    if len(input_ids) % k:
        raise ValueError(f"k = {k} does not divide the batch of {len(input_ids)}.")
    from transformers import PrinterCallback, TrainingArguments

    _import("trainer")
    name = getattr(model, "main_input_name", "input_ids")
    with _quiet():
        reference = copy.deepcopy(model).train()
        reference(**{name: input_ids}, labels=labels).loss.backward()
    full = flat_grads(list(reference.parameters()))
    opt = RecordingSGD(model.parameters(), 0.0)
    sched = CountingLR(opt)
    with _quiet(), _own_accelerate_state(), tempfile.TemporaryDirectory() as out_dir, _young_gc_only():
        args = TrainingArguments(
            output_dir=out_dir,
            per_device_train_batch_size=len(input_ids) // k,
            gradient_accumulation_steps=k,
            num_train_epochs=1,
            max_grad_norm=0.0,
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            disable_tqdm=True,
            learning_rate=0.0,
            seed=0,
        )
        state = torch.get_rng_state()
        columns = _Columns(**{name: input_ids}, labels=labels)
        trainer = _hf_trainer_class()(
            model=model, args=args, train_dataset=columns, optimizers=(opt, sched), compute_loss_func=compute_loss_func
        )
        trainer.loss_is_scaled_for_ga = loss_is_scaled_for_ga
        torch.set_rng_state(state)
        trainer.remove_callback(PrinterCallback)
        trainer.train()
    return _finish(Run("trainer", k, k), opt, sched, None), full
