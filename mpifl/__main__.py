import sys

from mpifl.cli import main

sys.exit(main())
