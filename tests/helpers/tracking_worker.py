"""Worker: gradient tracking with PowerGossip-compressed trackers on a real backend; saves this rank's results.

Usage (by tests/helpers/launch.py): python tests/helpers/tracking_worker.py OUT_DIR BACKEND
"""

from helpers.scenario_worker import run_scenarios
from helpers.tracking_scenarios import run_all

if __name__ == "__main__":
    run_scenarios(lambda comm, out_dir: run_all(comm, out_dir / f"checkpoint{comm.rank}"))
