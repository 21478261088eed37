"""``python -m experiments.allreduce_vs_gossip``: the comparison (:mod:`experiments.allreduce_vs_gossip.study`)."""

import sys

from experiments.allreduce_vs_gossip.study import main

if __name__ == "__main__":
    sys.exit(main())
