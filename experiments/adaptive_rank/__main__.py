"""``python -m experiments.adaptive_rank``: the study (:mod:`experiments.adaptive_rank.study`)."""

import sys

from experiments.adaptive_rank.study import main

if __name__ == "__main__":
    sys.exit(main())
