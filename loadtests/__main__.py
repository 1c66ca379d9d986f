"""``python -m loadtests load|chaos|check``."""

import sys

from loadtests.cli import main

sys.exit(main())
