"""Learning at cluster scale: n = 16 ... 1024 gossip replicas against DDP on one machine (issue 60).

* :mod:`experiments.scale.engine` -- the replica-axis engine: every worker a row of one ``(n, P)`` buffer, the
  library's step (gradients, mixing, trackers, mean gradient, optimizer) on all rows at once;
* :mod:`experiments.scale.replicas`, :mod:`~experiments.scale.batched_gpt` -- the rows, their per-replica gradients
  (replica by replica, vmap, or a hand-batched GPT) and every worker's batches;
* :mod:`experiments.scale.steps`, :mod:`~experiments.scale.mixing` -- W(t) as index arrays, exact mixing by gathers;
* :mod:`experiments.scale.powergossip`, :mod:`~experiments.scale.sign` -- PowerGossip and ChocoSign over all edges;
* :mod:`experiments.scale.config`, :mod:`~experiments.scale.reference` -- a run's configuration, and the same run on
  the library's simulator (the equivalence oracle of ``tests/test_scale_engine.py``);
* :mod:`experiments.scale.study` -- the sweeps (``python -m experiments.scale``).
"""
