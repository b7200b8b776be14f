"""`python -m maxbridge.cli`: the `maxbridge` command."""

import sys

from maxbridge.cli import main

sys.exit(main())
