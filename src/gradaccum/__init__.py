"""gradaccum: the companion package of *Gradient Accumulation, Correctly*.

Each chapter of the book has a module here that computes what the chapter shows:

* :mod:`gradaccum.accumulate` — splitting batches, accumulated vs full-batch gradients, the training loop;
* :mod:`gradaccum.bn` — chapter 1, BatchNorm's micro-batch statistics;
* :mod:`gradaccum.book.exercises` — checkers that explain wrong answers;
* :mod:`gradaccum.runtime`, :mod:`gradaccum.book.data`, :mod:`gradaccum.book.models`, :mod:`gradaccum.book.plotting`,
  :mod:`gradaccum.book.widgets` — shared set-up, data, models, figures and widgets.
"""

from .runtime import pick_device, seed_everything, setup

__version__ = "0.1.0"
__all__ = ["__version__", "pick_device", "seed_everything", "setup"]
