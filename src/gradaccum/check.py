"""``python -m gradaccum.check``: the checker's command line under the name of the function it runs (the same command
as ``python -m gradaccum.checker``; exit 0 no bug, 1 a bug, 2 a usage error).

Imported, this module is the function :func:`gradaccum.checker.check`: ``from gradaccum import check``,
``import gradaccum.check`` and ``importlib.import_module("gradaccum.check")`` all give that one function. On
import the module puts the function in its own place in ``sys.modules``, and the import system binds what
``sys.modules`` holds once a module has run; ``from gradaccum.check import name`` is an ImportError. The checker's
names (``Report``, ``Finding``, ``CODES``, ``main``) are in :mod:`gradaccum.checker`.
"""

import sys

from gradaccum.checker import check as _check
from gradaccum.checker.cli import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m gradaccum.check"))
else:
    sys.modules[__name__] = _check  # type: ignore[assignment]  # a function where a module would be
