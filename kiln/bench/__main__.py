"""``python -m kiln.bench``: the same as ``kiln bench``."""

import sys

from kiln.bench.command import main

sys.exit(main())
