"""gradaccum: gradient accumulation, correctly. The core needs torch only (``pip install gradaccum``).

What each core module holds (the chapter of the book that derives it in brackets):

* :mod:`gradaccum.accumulate` — cut a batch into K micro-batches; accumulated vs full-batch gradients; a plain
  training loop; the agreement of two gradients [all chapters].
* :mod:`gradaccum.checker` — ``check(model, loss_fn, x, y, k, step=...)`` (exported as ``gradaccum.check``): run a
  reader's accumulation loop and name what makes it differ from one full-batch step; its command line
  (``python -m gradaccum.checker``, or ``python -m gradaccum.check``) serves CI [Check your loop].
* :mod:`gradaccum.bn_statistics` — micro-batch moments, the effective and the corrected BatchNorm momentum [1].
* :mod:`gradaccum.ghost_bn` — ``GhostBatchNorm`` and ``ghostify`` (its compiled kernel in
  :mod:`gradaccum.ghost_bn_compiled`) [2].
* :mod:`gradaccum.fullbatch_bn` — the exact full-batch-statistics scheme under accumulation (its parts in
  :mod:`gradaccum.fullbatch_norm`, ``fullbatch_stats``, ``fullbatch_sweeps``, ``fullbatch_cache``,
  ``fullbatch_trace``) [2].
* :mod:`gradaccum.precise_bn` — PreciseBN: recompute running statistics after training [2].
* :mod:`gradaccum.clipping` — where to clip: the four placements, their bounds, clipping with a GradScaler [3].
* :mod:`gradaccum.precision` — loss scaling × 1/K: formats, casts; the amp window and its mistakes in
  :mod:`gradaccum.amp_recipe` [4].
* :mod:`gradaccum.distributed` — ``no_sync()`` placements, all-reduce counting, the α–β cost model [5].
* :mod:`gradaccum.windows` — token-count normalization, dropout masks, partial windows; scheduler and
  Adam steps counted in :mod:`gradaccum.step_counts` [6].
* :mod:`gradaccum.coupled` — InfoNCE and GradCache, checkpointing that keeps BatchNorm statistics; the window's
  load-balancing loss in :mod:`gradaccum.load_balancing` [8].
* :mod:`gradaccum.frameworks` — Accelerate, Lightning, the Transformers Trainer and two hand-written loops run on the
  same micro-batches, and ``check`` adapters for them (the frameworks are imported only when used); the runners
  are in :mod:`gradaccum.framework_runners`, what they record in :mod:`gradaccum.framework_probes` [7].
* :mod:`gradaccum.integrations` — the check where people train: a Lightning ``Callback``, a Transformers
  ``TrainerCallback`` and an Accelerate decorator that check a run's own first window when it starts, and can
  stop it on a bug (each framework is imported only when its integration is used) [Check your loop].
* :mod:`gradaccum.runtime`, :mod:`gradaccum.timing` — seeds, threads and device; interleaved median timings.

The book layer, :mod:`gradaccum.book` (``pip install "gradaccum[book]"``), holds the data, models, figures,
widgets, exercise graders, course tools and one module of experiments per chapter.
"""

# Functions are exported under names that no module uses: ``gradaccum.check`` is the function (the checker's
# package is ``gradaccum.checker``); ``gradaccum.precise_bn`` stays the module
# (``from gradaccum.precise_bn import precise_bn``).
from .accumulate import accumulate_backward, accumulated_gradient, agreement, full_batch_gradient, split_batch
from .checker import check
from .fullbatch_bn import full_batch_stats_backward
from .ghost_bn import GhostBatchNorm, ghostify
from .runtime import pick_device, seed_everything, setup

__version__ = "0.2.0"
__all__ = [
    "__version__",
    "GhostBatchNorm",
    "accumulate_backward",
    "accumulated_gradient",
    "agreement",
    "check",
    "full_batch_gradient",
    "full_batch_stats_backward",
    "ghostify",
    "pick_device",
    "seed_everything",
    "setup",
    "split_batch",
]
