"""The main job's defaults against its own baselines (--algorithm ddp, --algorithm diloco), same command and seeds."""
