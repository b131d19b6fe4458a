"""`python -m stitchcuda`: the same command line as the `stitchcuda` script."""

import sys

from .cli import main

sys.exit(main())
