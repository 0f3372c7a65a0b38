"""``python -m diskreplay``: the same as the ``diskreplay`` command."""

import sys

from .cli import main

if __name__ == "__main__":  # not when a doctest collector imports this module
    sys.exit(main())
