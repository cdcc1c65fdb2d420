"""``python -m gradaccum.checker``: see :func:`gradaccum.checker.cli.main`."""

import sys

from .cli import main

sys.exit(main())
