"""``python -m diskreplay.cli``: the ``diskreplay`` command."""

import sys

from . import main

sys.exit(main())
