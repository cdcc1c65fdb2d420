"""The book layer of *Gradient Accumulation, Correctly*: data, models, figures, widgets, exercise graders,
the course tools and one module of experiments per chapter, built on the torch-only core (:mod:`gradaccum`).

Installed with ``pip install "gradaccum[book]"`` (scikit-learn, matplotlib, numpy, ipywidgets).
"""
