"""``python -m experiments.learning_per_step``: the study's runner (:mod:`experiments.learning_per_step.study`)."""

import sys

from experiments.learning_per_step.study import main

if __name__ == "__main__":
    sys.exit(main())
