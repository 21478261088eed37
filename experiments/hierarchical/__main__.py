"""``python -m experiments.hierarchical``: the study (:mod:`experiments.hierarchical.study`)."""

import sys

from experiments.hierarchical.study import main

if __name__ == "__main__":
    sys.exit(main())
