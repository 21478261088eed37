"""``python -m experiments.elastic_churn``: the churn study (:mod:`experiments.elastic_churn.study`)."""

import sys

from experiments.elastic_churn.study import main

if __name__ == "__main__":
    sys.exit(main())
