r"""Check *your* training step: does accumulating K micro-batches compute what one full batch would?

``check(model, loss_fn, x, y, k, step=None)`` runs one accumulated window — your own loop if you pass ``step`` — and
one full-batch pass from the same state, under the same randomness (dropout masks are drawn per sample, so a
sample gets the same mask in the full batch and in its micro-batch), and compares the gradients. It measures how
your step weighs each micro-batch's gradient, what it calls (optimizer, scheduler, ``GradScaler``, ``zero_grad``,
clipping, seeding: seen by the code that runs, however it was imported), how the ``.grad`` buffer evolves between
backward passes, which layers couple the samples of a batch, and how the loss weighs micro-batches (token counts),
and names every cause it finds with its evidence and fix (see :mod:`gradaccum.checker.rules`). An exception
inside your step is reported as a finding. It works on copies and restores the random state: your model and random
streams are left as they were.

Hugging Face models need no wrapper: ``x`` may be a dict of tensors that share the batch dimension (called as
``model(**x)``, cut into dict micro-batches), an output may be a ``ModelOutput`` or a dict (``loss_fn`` takes its
``logits``), and ``loss_fn=None`` with ``y=None`` uses the loss the model computes from the labels in ``x``
(``output.loss``); transformers itself is never imported.

``step(model, loss_fn, x, y, k)`` does what your training loop does for one window of K micro-batches: either
between ``zero_grad()`` and ``optimizer.step()`` (leaving the gradient in ``.grad``), or a whole iteration with an
optimizer and scheduler built inside ``step`` from ``model.parameters()`` (the gradient at its optimizer step is
compared). It is also called once with the first K − 1 micro-batches and ``k = K − 1``, as the last partial window
of an epoch. Command line::

    python -m gradaccum.checker my_module:make -k 4    # make() returns (model, loss_fn, x, y) or (..., step)
    python -m gradaccum.book.check_demo              # the book's demo: every planted bug, and correct loops

Exit status: 0 no bug found, 1 a bug found (or no verdict possible), 2 a usage error.
"""

from .cli import main
from .pipeline import check, token_cross_entropy
from .report import CODES, Finding, Report
from .run import Step

__all__ = ["CODES", "Finding", "Report", "Step", "check", "main", "token_cross_entropy"]
