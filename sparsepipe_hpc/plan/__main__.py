"""``python -m sparsepipe_hpc.plan``: see :mod:`sparsepipe_hpc.plan.cli`."""

import sys

from sparsepipe_hpc.plan.cli import main

if __name__ == "__main__":
    sys.exit(main())
