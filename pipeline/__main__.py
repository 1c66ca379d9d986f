"""``python -m pipeline ...``: see pipeline.cli."""

import sys

from pipeline.cli import main

sys.exit(main(prog="python -m pipeline"))
