"""`python -m stack`: the same as the `meridian` command."""

import sys

from stack.cli import main

sys.exit(main())
