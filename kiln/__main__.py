"""``python -m kiln``: the same as the ``kiln`` command."""

import sys

from kiln.cli import main

sys.exit(main())
