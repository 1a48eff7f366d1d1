"""`python -m lcx.cli ...`, the same as `lcx ...`."""

import sys

from lcx.cli import main

sys.exit(main())
