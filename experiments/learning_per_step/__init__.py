"""Learning per step: why decentralized Adam (PowerGossip, exact gossip) learns less per step than
All-Reduce, and what closes the gap (simulator, n virtual ranks, several seeds).

* :mod:`experiments.learning_per_step.study` -- the configurations and the runner
  (``python -m experiments.learning_per_step``);
* :mod:`experiments.learning_per_step.mixing`, :mod:`~experiments.learning_per_step.optimizers`,
  :mod:`~experiments.learning_per_step.spectrum` -- harness-level mixing rules, AdamW variants, spectrum measurement;
* :mod:`experiments.learning_per_step.tracker_noise` -- what gradient tracking gives each rank's AdamW (noise of the
  tracker and of the moments against plain gossip);
* :mod:`experiments.learning_per_step.report` -- the tables and plots
  (``python -m experiments.learning_per_step.report``).
"""
