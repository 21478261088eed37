"""All-Reduce (torch DDP) vs exact gossip vs PowerGossip on the main job at equal steps, 4 workers.

* :mod:`experiments.allreduce_vs_gossip.study` -- the runs through ``gossip-train`` and their table
  (``python -m experiments.allreduce_vs_gossip``).
"""
