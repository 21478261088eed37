"""Worker: the default pipeline's training on a real backend, recording what it issues; saves this rank's record.

Usage (by tests/helpers/launch.py): python tests/helpers/collective_worker.py OUT_DIR BACKEND
"""

from helpers.collective_scenarios import run_all
from helpers.scenario_worker import run_scenarios

if __name__ == "__main__":
    run_scenarios(lambda comm, out_dir: run_all(comm))
