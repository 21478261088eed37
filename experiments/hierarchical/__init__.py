"""Hierarchical gossip on an emulated two-level network (2 nodes x 2 ranks), and the runtime model's prediction of it.

* :mod:`experiments.hierarchical.study` -- the emulated network, table, plot and model validation
  (``python -m experiments.hierarchical``);
* ``worker.py`` -- one rank, started by the study as a script.
"""
