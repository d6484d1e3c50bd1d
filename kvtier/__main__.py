"""``python -m kvtier``: the same command as the ``kvtier`` console script."""

import sys

from kvtier.cli import main

if __name__ == "__main__":
    sys.exit(main())
