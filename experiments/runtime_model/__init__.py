"""The runtime model: predicted seconds per iteration of All-Reduce (DDP) and decentralized gossip training
(docs/design.md B.5, E.2).

* :mod:`experiments.runtime_model.costs` -- seconds to move M bytes (ring all-reduce, exchanges, hierarchical
  gossip) on a network of given latency and bandwidth;
* :mod:`experiments.runtime_model.model` -- per-iteration predictions: compute, stragglers, overlap, optimizer;
* :mod:`experiments.runtime_model.cli` -- tables for n = 64..1024, the predicted-vs-measured table, and the
  command line ``python -m experiments.runtime_model``;
* :mod:`experiments.runtime_model.validate` -- the model against emulated runs,
  ``python -m experiments.runtime_model.validate``.

Imports run one way: costs <- model <- cli <- validate.
"""
