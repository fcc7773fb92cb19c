"""``python -m mpifl``: the same command line as the ``mpifl`` console script."""
import sys

from mpifl.cli import main

sys.exit(main())
