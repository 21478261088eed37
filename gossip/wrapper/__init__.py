"""The wrapper layer: :class:`~gossip.wrapper.parallel.DecentralizedDataParallel` and its helpers.

``parallel`` (the wrapper: when the exchange starts and ends inside an ordinary training loop), ``step_phase`` (the
phases of one step and their legal moves), ``optimizer_hooks`` (torch's global optimizer-step hooks, once per
process), ``replicas`` (the cross-rank consistency check and the initial broadcast), ``consensus`` (consensus
distance and the global average) and ``metrics`` (per-step metrics). This layer imports the algorithms, the
communicators and the topologies below it, never the checkpoint layer or the main job above it. The public name is
``gossip.DecentralizedDataParallel``; this package re-exports nothing, so importing one helper does not load the rest.
"""
