"""Worker: four training steps in which rank 1 calls optimizer.step() twice (step 1); the error is not caught.

Usage (by tests/test_failures_extra_step.py through helpers.failure_launch.run): python
tests/helpers/extra_step_worker.py OUT_DIR BACKEND. Every rank writes its pid to ``OUT_DIR/rank<r>.pid``, its
standard error to ``OUT_DIR/rank<r>.stderr`` and the time it enters close() to ``OUT_DIR/rank<r>.closing_at``.
"""

import os
import sys
import time
import warnings
from pathlib import Path

import torch

import gossip
from helpers import own_stderr
from helpers.parallel_scenarios import make_mlp, train_with_an_extra_step_on_rank_1, wrap

TIMEOUT = 10.0


def main() -> None:
    out_dir, backend = Path(sys.argv[1]), sys.argv[2]
    warnings.simplefilter("ignore")  # the MixingOnlyStepWarning is pinned by the simulator's test
    torch.set_num_threads(1)
    own_stderr.redirect(out_dir)
    comm = gossip.init(backend, timeout=TIMEOUT)
    (out_dir / f"rank{comm.rank}.pid").write_text(str(os.getpid()))
    own_stderr.name_by_rank(out_dir, comm.rank)
    model = wrap(comm, make_mlp(comm.rank))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    train_with_an_extra_step_on_rank_1(model, optimizer, comm.rank)
    (out_dir / f"rank{comm.rank}.closing_at").write_text(repr(time.time()))
    model.close()
    comm.close()


if __name__ == "__main__":
    main()
