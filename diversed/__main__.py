"""`python -m diversed` (and `torchrun -m diversed`) runs the command line."""

import sys

from diversed.cli import main

sys.exit(main())
