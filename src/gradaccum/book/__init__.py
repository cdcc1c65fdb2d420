"""The book layer of *Gradient Accumulation, Correctly*: data, models, figures, widgets, exercise graders,
the course tools and one module of experiments per chapter, built on the torch-only core (:mod:`gradaccum`).

Installed with ``pip install "gradaccum[book]"`` (scikit-learn, matplotlib, numpy, ipywidgets).
"""

#: The checker treats this layer's code as a user's, not as the toolkit's own: the seeds its demo loops set are the
#: loops' (``gradaccum.checker.recorder``; the core never imports this package).
USER_CODE = True
