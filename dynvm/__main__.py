"""`python -m dynvm`: the same command line as the `dynvm` script."""

import sys

from dynvm.cli import main

sys.exit(main())
