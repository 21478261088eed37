"""``python -m experiments.scale``: the scale sweeps and step timings (:mod:`experiments.scale.study`)."""

import sys

from experiments.scale.study import main

if __name__ == "__main__":
    sys.exit(main())
