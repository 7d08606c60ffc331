"""``python -m router`` is ``prefix-router``."""

import sys

from router.cli import main

sys.exit(main())
