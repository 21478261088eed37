"""Worker: run PowerGossip's iterations-during-backward scenarios on a real backend and save this rank's results.

Usage (by tests/helpers/launch.py): python tests/helpers/progress_worker.py OUT_DIR BACKEND
"""

from helpers.progress_scenarios import run_all
from helpers.scenario_worker import run_scenarios

if __name__ == "__main__":
    run_scenarios(run_all)
