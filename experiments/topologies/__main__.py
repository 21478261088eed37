"""``python -m experiments.topologies``: the study (:mod:`experiments.topologies.study`)."""

import sys

from experiments.topologies.study import main

if __name__ == "__main__":
    sys.exit(main())
