"""What chapter 6's helper processes run: every rank of the two-process demo, and every run of the partial-window
study. The ranks (task ``"ch6"`` of :mod:`gradaccum.book.ddp_tasks`) compute the exact token normalization that
needs no count before the window, under DDP, and draw the dropout masks each rank gets when every rank is seeded
alike (the Transformers Trainer's ``set_seed``) or with its rank added (Accelerate's
``set_seed(..., device_specific=True)``). The study's runs (:func:`partial_step_run`) are handed to two processes
by :func:`gradaccum.book.ch06_loss_normalization_and_friends.partial_step_study`.

Workers import this module, so it holds nothing they do not need: torch and the core at the top, Transformers and
Accelerate inside the function that seeds with them (no figures, no scikit-learn).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gradaccum.accumulate import flat_grad, split_batch
from gradaccum.book.models import TinyLM, make_cnn, make_lm
from gradaccum.windows import OptimizerName, count_tokens, partial_step_ratio, scale_grads, token_loss

if TYPE_CHECKING:
    from gradaccum.book.data import Vocab  # imports scikit-learn: not in the workers

#: the seed every rank passes (the Trainer's default ``TrainingArguments.seed``)
SEED = 42
#: how each rank seeds, by name: the Trainer's ``set_seed(seed)`` on every rank, or Accelerate's with the rank added
SEEDINGS = ("same seed on every rank", "seed + rank")


def sum_then_scale(model: nn.Module, x: torch.Tensor, y: torch.Tensor, k: int, ranks: int = 1) -> int:
    """One window without a count before it: each micro-batch's summed token loss backpropagated as it comes
    (under DDP, micro-batches 1..K−1 inside ``no_sync()``), then the window's token count all-reduced over the
    ``ranks`` (when a process group is running) and every gradient multiplied once by ranks / count
    (:func:`gradaccum.windows.scale_grads`). Returns the count over all ranks."""
    tokens = 0
    micro = split_batch(x, y, k)
    for i, (xb, yb) in enumerate(micro):
        last = i == len(micro) - 1
        sync = model.no_sync() if isinstance(model, DDP) and not last else contextlib.nullcontext()
        with sync:
            token_loss(model(xb), yb, "sum").backward()  # no division: the count is not known yet
        tokens += count_tokens(yb)
    total = torch.tensor(tokens)
    if ranks > 1:
        dist.all_reduce(total)  # one integer, after the window
    scale_grads(model.module if isinstance(model, DDP) else model, total, ranks)
    return int(total)


def _seed(how: str, rank: int, world_size: int) -> None:
    """Seed this rank as the Trainer does (``transformers.trainer_utils.set_seed``, called in ``Trainer.__init__``
    with ``args.seed``) or as Accelerate's ``set_seed(seed, device_specific=True)`` does (the rank added)."""
    if how == SEEDINGS[0]:
        from transformers.trainer_utils import set_seed

        set_seed(SEED)
        return
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import set_seed as accelerate_set_seed

    # what torchrun would set (Accelerate joins the running process group), and the one thread the workers use
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    Accelerator(cpu=True)  # joins the running process group
    accelerate_set_seed(SEED, device_specific=True)  # SEED + AcceleratorState().process_index
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def dropout_draws(how: str, rank: int, world_size: int, k: int, shape: tuple[int, ...], p: float) -> torch.Tensor:
    """The dropout masks (True: dropped) of K micro-batches drawn after seeding this rank ``how``: (K, *shape)."""
    _seed(how, rank, world_size)
    layer = nn.Dropout(p).train()
    return torch.stack([layer(torch.ones(shape)) == 0 for _ in range(k)])


def rank_task(
    rank: int,
    world_size: int,
    x: torch.Tensor,
    y: torch.Tensor,
    k: int,
    state: dict[str, torch.Tensor],
    vocab_size: int,
    mask_shape: tuple[int, ...] = (16, 256),
    p: float = 0.1,
) -> dict[str, Any]:
    """On every rank: (1) :func:`sum_then_scale` on this rank's consecutive share of ``(x, y)`` for a DDP-wrapped
    ``TinyLM(vocab_size)`` loaded with ``state`` (float64) — its gradient and counts; (2) the dropout masks after
    each seeding of :data:`SEEDINGS`; (3) a model built after seeding with the rank added, before and after DDP
    wraps it (DDP broadcasts rank 0's parameters when it is built)."""
    xs, ys = split_batch(x, y, world_size)[rank]
    lm = TinyLM(vocab_size).double()
    lm.load_state_dict(state)
    model = DDP(lm)
    total = sum_then_scale(model, xs, ys, k, world_size)
    masks = {how: dropout_draws(how, rank, world_size, k, mask_shape, p) for how in SEEDINGS}
    torch.manual_seed(SEED + rank)
    own = nn.Linear(4, 3).double()
    before = torch.cat([q.detach().flatten() for q in own.parameters()])
    wrapped = DDP(own)
    after = torch.cat([q.detach().flatten() for q in wrapped.module.parameters()])
    return {
        "grad": flat_grad(lm).detach(),
        "own_tokens": count_tokens(ys),
        "total_tokens": total,
        "masks": masks,
        "init_before_ddp": before,
        "init_after_ddp": after,
    }


#: learning rates of the partial-window study's two set-ups, per optimizer
STUDY_LR = {
    "CNN, digits": {"sgd": 0.1, "momentum": 0.05, "adam": 1e-3, "adam_beta1_0": 1e-3},
    "char LM": {"sgd": 0.5, "momentum": 0.1, "adam": 1e-2, "adam_beta1_0": 1e-2},
}


def partial_step_run(
    setup: str,
    optimizer: OptimizerName,
    warm: int,
    seed: int,
    x: torch.Tensor,
    y: torch.Tensor,
    vocab: Vocab,
    k: int = 8,
    present: int = 3,
) -> float:
    """One value of :func:`gradaccum.book.ch06_loss_normalization_and_friends.partial_step_study`:
    :func:`gradaccum.windows.partial_step_ratio` (‖step divided by K‖ / ‖step divided by k'‖) for the set-up named
    ``setup`` (``"CNN, digits"``: the GroupNorm ``SmallCNN``, micro-batches of 8 images ``x`` with labels ``y``;
    ``"char LM"``: the ``TinyLM``, micro-batches of 2 encoded lines ``x`` with targets ``y``, token-mean loss),
    learning rate :data:`STUDY_LR`, initial weights and batches drawn from ``seed``."""
    if setup not in STUDY_LR:
        raise ValueError(f"setup must be one of {list(STUDY_LR)}, got {setup!r}.")
    model: nn.Module
    loss_fn: Callable[..., torch.Tensor]
    if setup == "CNN, digits":
        model, loss_fn, b = make_cnn("group", seed=seed), nn.CrossEntropyLoss(), 8
    else:
        model, loss_fn, b = make_lm(vocab, seed=seed), token_loss, 2
    return partial_step_ratio(
        model, loss_fn, x, y, b, k, present, optimizer, STUDY_LR[setup][optimizer], warm, seed=seed
    )
