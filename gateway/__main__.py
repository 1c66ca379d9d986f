"""`python -m gateway` = the `gateway` command."""

import sys

from gateway.cli import main

sys.exit(main())
