"""Worker: run every OuterOptimizer scenario on a real backend and save this rank's results.

Usage (by tests/helpers/launch.py): python tests/helpers/outer_worker.py OUT_DIR BACKEND
"""

from helpers.outer_scenarios import run_all
from helpers.scenario_worker import run_scenarios

if __name__ == "__main__":
    run_scenarios(lambda comm, _out_dir: run_all(comm))
