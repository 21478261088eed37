"""``python -m experiments.time_to_loss``: the benchmark (:mod:`experiments.time_to_loss.study`)."""

import sys

from experiments.time_to_loss.study import main

if __name__ == "__main__":
    sys.exit(main())
