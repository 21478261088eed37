"""The main job, ``gossip-train``: a small byte-level GPT trained with the library (model, corpus, one worker's
loop, run directory, torch-DDP baseline, command line and local launcher).

The library (everything in :mod:`gossip` outside this package, :mod:`optim`, :mod:`topologies`) never imports it.
"""
