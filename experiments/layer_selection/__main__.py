"""``python -m experiments.layer_selection``: the study (:mod:`experiments.layer_selection.study`)."""

import sys

from experiments.layer_selection.study import main

if __name__ == "__main__":
    sys.exit(main())
