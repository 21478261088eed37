"""Time to loss: how long DDP, gossip and decent-dp take to DDP's final training loss on an emulated network.

* :mod:`experiments.time_to_loss.study` -- the benchmark (``python -m experiments.time_to_loss``);
* :mod:`experiments.time_to_loss.decentdp_runner` -- one worker of the same task trained with decent-dp.
"""
