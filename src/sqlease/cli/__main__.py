"""``python -m sqlease.cli``, as ``python -m sqlease``."""

import sys

from sqlease.cli import main

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
